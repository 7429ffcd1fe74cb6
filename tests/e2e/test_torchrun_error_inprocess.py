"""`nanaudit run` under torchrun (two gloo ranks) when rank 1's script raises on a non-finite
value while rank 0 waits in the step's next collective (issue 35). DDP: rank 1 replays its
window alone on its local module, names the op, and every rank reports that finding, exit 1,
with no re-run (the re-run waited for the blocked peer until killed: no rank could answer).
FSDP2: a forward needs every rank's all-gather, so the model is not run again: the loss code
alone is replayed from the model's recorded output, which names a value the loss code made; a
value the forward made is not replayed and not re-run, and every rank says why, with the first
run's finding (nanaudit/script/error_ranks.py)."""

from __future__ import annotations

import pytest
from helpers import ROOT, launch_ranks, line_of, rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
DDP = ROOT / "tests" / "e2e" / "scripts" / "ddp_raising.py"
FSDP = ROOT / "tests" / "e2e" / "scripts" / "fsdp_steps.py"


def logged_steps(log, rank: int) -> list[str]:
    return [line.split()[0] for line in log.with_name(f"{log.name}.rank{rank}").read_text()
            .splitlines()]


def run_ranks(tmp_path, *argv) -> list:
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, *argv], 2,
                                  timeout_s=120)
    assert codes == [1, 1], outputs
    return rank_reports(out, 2)


@pytest.mark.parametrize(("mode", "error", "op", "cause", "samples", "line"), [
    # torch.multinomial inside the policy's forward refuses the NaN that row 3's temperature
    # of 0 made (logits / 0 = +-inf, their softmax NaN).
    ("sample", "RuntimeError", "aten.div.Tensor", "div-by-zero", [3],
     "probs = torch.softmax(self.net(obs) / temperature[:, None]"),
    # The script's own assert on the loss that row 2's zero weight made -inf through log.
    ("assert", "AssertionError", "aten.log.default", "log-domain", [2],
     "loss = -(torch.log(probs[:, 0] * weight)).mean()"),
])
def test_ddp_error_of_one_rank_is_localized_in_process_on_every_rank(tmp_path, mode, error, op,
                                                                     cause, samples, line):
    log = tmp_path / "log"
    reports = run_ranks(tmp_path, DDP, mode, log)
    for rank, report in enumerate(reports):
        f = report["finding"]
        assert report["status"] == "nonfinite"
        assert (f["step"], f["rank"], f["where"], f["op"], f["cause"], f["samples"]) == (
            2, 1, "forward", op, cause, samples)
        assert f["source"]["line"] == line_of(DDP, line)
        assert f["localized_by"] == "in-process"
        assert report["run"]["replay"]["status"] == "reproduced"
        assert "rerun" not in report["run"]
        # The raising rank keeps its exception; its peer was freed by it, not failed.
        assert (report.get("error") or {}).get("exception") == (error if rank == 1 else None)
        assert [s["rank"] for s in report["distributed"]["ranks"]] == ([0, 1] if rank == 0
                                                                       else [1])
    # Written once, by the first run alone: steps 0-1 (step 2 raised on rank 1, and rank 0
    # never finished its backward).
    assert [logged_steps(log, r) for r in (0, 1)] == [["0", "1"], ["0", "1"]]


def test_fsdp_error_of_one_rank_says_why_it_is_not_replayed_on_every_rank(tmp_path):
    log = tmp_path / "log"
    for report in run_ranks(tmp_path, FSDP, log, "--assert"):
        f = report["finding"]
        assert (f["step"], f["rank"], f.get("op"), f.get("localized_by")) == (3, 1, None, None)
        assert f["tensors"] == [f"`loss` in <module> (fsdp_steps.py:"
                                f"{line_of(FSDP, 'assert torch.isfinite(loss)')})"]
        replay = report["run"]["replay"]
        assert replay["status"] == "skipped" and "FSDP2" in replay["note"]
        assert "the model's output was already non-finite" in replay["note"]
        assert "rerun" not in report["run"]
        assert "not re-run: the peer ranks, blocked in a collective" in f["explanation"]
    assert [logged_steps(log, r) for r in (0, 1)] == [["0", "1", "2"], ["0", "1", "2"]]


def test_fsdp_error_made_in_the_loss_code_is_localized_from_the_recorded_output(tmp_path):
    # Rank 1's loss code takes the log of a zero sample weight at step 3 and its assert raises
    # while rank 0 waits in the backward's reduce-scatter. Before: refused (FSDP2's forward
    # needs the peers), no op. Now the loss code is replayed alone from the model's output.
    log = tmp_path / "log"
    for report in run_ranks(tmp_path, FSDP, log, "--assert-weight"):
        f = report["finding"]
        assert (f["step"], f["rank"], f["where"], f["op"], f["cause"], f["samples"]) == (
            3, 1, "forward", "aten.log.default", "log-domain", [2]), f
        assert f["source"]["line"] == line_of(FSDP, "- torch.log(weight)")
        assert f["localized_by"] == "in-process"
        assert report["run"]["replay"]["status"] == "reproduced"
        assert "rerun" not in report["run"]
    assert [logged_steps(log, r) for r in (0, 1)] == [["0", "1", "2"], ["0", "1", "2"]]
