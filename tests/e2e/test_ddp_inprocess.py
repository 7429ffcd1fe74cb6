"""`nanaudit run` under torchrun (DDP, two gloo ranks): a backward-only NaN that rank 1's own
shard of the batch made is localized at the trip, in-process, by rank 1's replay of its own
step on its local module (its gradients before DDP's all-reduce), and every rank's report
carries that finding; the script is not run a second time (issue 35)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, launch_ranks

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ddp_backward_sqrt.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_backward_nan_of_one_rank_is_localized_in_process_on_every_rank(tmp_path):
    log, out = tmp_path / "log", tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, SCRIPT, log],
                                  2, timeout_s=120)
    assert codes == [1, 1], outputs
    for path in (out, tmp_path / "report.rank1.json"):
        report = json.loads(path.read_text())
        finding = report["finding"]
        assert (finding["step"], finding["rank"], finding["where"]) == (3, 1, "backward")
        # sqrt's backward (1/(2*sqrt(x)) at the zero row) in module `0`, the script's line.
        assert (finding["op"], finding["forward_op"]) == ("aten.div.Tensor", "aten.sqrt.default")
        assert finding["module"] == "0" and finding["cause"] == "sqrt-domain"
        assert finding["source"]["line"] == 23
        assert "torch.sqrt" in finding["source"]["code"]
        assert finding["samples"] == [5] and finding["tensors"] == ["0.weight"]
        assert finding["localized_by"] == "in-process"
        assert report["run"]["replay"]["status"] == "reproduced"
        assert "rerun" not in report["run"]
    # Written once, by the first run alone: steps 0-2 (step 3 stopped before its log line).
    for rank in (0, 1):
        lines = (tmp_path / f"log.rank{rank}").read_text().splitlines()
        assert [line.split()[0] for line in lines] == ["0", "1", "2"]
