"""`nanaudit run` under torchrun with FSDP2 (two gloo ranks): every rank replays the bad step
together at the trip (FSDP2's all-gathers and reduce-scatters need every rank), each walking
back from its own gradients before the reduce-scatter, so the rank whose own op made the value
is named, in-process, and the script is not run a second time (issue 35). `run --keep-going`
skips a bad step on both ranks alike, localizes it the same way and trains on: the final
parameters equal those of the script that leaves out those updates by hand (issue 36). The
faults are planted in rank 1's batches (tests/e2e/scripts/fsdp_steps.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, launch_ranks, line_of, rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "fsdp_steps.py"


def logged_steps(log, rank: int) -> list[str]:
    return [line.split()[0] for line in log.with_name(f"{log.name}.rank{rank}").read_text()
            .splitlines()]


def test_backward_only_value_is_localized_by_every_rank_replaying_the_step(tmp_path):
    log, out = tmp_path / "log", tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, SCRIPT, log],
                                  2, timeout_s=120)
    assert codes == [1, 1], outputs
    for report in rank_reports(out, 2):
        f = report["finding"]
        # Every loss finite; rank 1's own gradients (before the reduce-scatter) went bad.
        assert (f["step"], f["rank"], f["where"], f["forward_op"], f["module"], f["cause"],
                f["samples"]) == (2, 1, "backward", "aten.sqrt.default", "length",
                                  "sqrt-domain", [5])
        assert f["source"]["line"] == line_of(SCRIPT, "return torch.sqrt(")
        assert f["tensors"][0].startswith("blocks.")
        assert f["localized_by"] == "in-process"
        assert report["run"]["replay"]["status"] == "reproduced"
        assert "rerun" not in report["run"]
    # Written once, by the first run alone: steps 0-1 (step 2 stopped before its update).
    assert [logged_steps(log, r) for r in (0, 1)] == [["0", "1"], ["0", "1"]]


def test_keep_going_skips_both_bad_steps_on_every_rank_and_trains_on(tmp_path):
    log, out = tmp_path / "log", tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--keep-going", "--json",
                                   out, SCRIPT, log], 2, timeout_s=150)
    assert codes == [1, 1], outputs
    for report in rank_reports(out, 2):
        backward, forward = report["findings"]
        assert (backward["step"], backward["rank"], backward["where"], backward["forward_op"],
                backward["module"], backward["cause"], backward["samples"],
                backward["action"]) == (2, 1, "backward", "aten.sqrt.default", "length",
                                        "sqrt-domain", [5], "skipped")
        assert (forward["step"], forward["rank"], forward["where"], forward["op"],
                forward["cause"], forward["samples"], forward["action"]) == (
            3, 1, "forward", "aten.log.default", "log-domain", [2], "skipped")
        assert forward["source"]["line"] == line_of(SCRIPT, "h = torch.log(x)")
        assert {backward["localized_by"], forward["localized_by"]} == {"in-process"}
        assert "rerun" not in report["run"]
    assert [logged_steps(log, r) for r in (0, 1)] == [[str(s) for s in range(6)]] * 2
    ref = tmp_path / "ref"
    codes, outputs = launch_ranks([SCRIPT, ref, "--reference"], 2, timeout_s=60)
    assert codes == [0, 0], outputs
    expected = torch.load(f"{ref}.rank0.pt", weights_only=True)
    assert all(int(v) == 4 for k, v in expected.items() if k.endswith(".step"))
    for rank in (0, 1):
        got = torch.load(f"{log}.rank{rank}.pt", weights_only=True)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.isfinite(got[key]).all(), key
            assert torch.equal(got[key], expected[key]), (rank, key)


def test_a_shard_whose_sum_of_squares_overflowed_is_confirmed_before_it_trips(tmp_path):
    """Finite weights near 1e30 after a huge learning rate's update: each rank's float32 norm
    of its shard overflows, but every rank confirms its shard element-wise (one more exchange,
    on that step only), so the trip is step 1's forward overflow, not an update at step 0
    naming no parameter."""
    script = ROOT / "tests" / "e2e" / "scripts" / "fsdp_diverging.py"
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, script], 2,
                                  timeout_s=120)
    assert codes == [1, 1], outputs
    for report in rank_reports(out, 2):
        f = report["finding"]
        assert (f["step"], f["where"], f["op"], f["cause"]) == (
            1, "forward", "aten.pow.Tensor_Scalar", "divergence")
        assert f["source"]["line"] == line_of(script, "loss = model(x).pow(2).mean()")
        assert "lr=1e+30" in f["fix"]
