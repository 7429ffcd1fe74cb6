"""`nanaudit run --keep-going` on an unmodified script: each bad step is localized in-process at
its trip, recorded, and skipped without a trace (the update held back, the buffers put back,
the script's RNG, scheduler and log its own), in every step shape; the run stops when skipping
cannot help. The reference is the same loop doing by hand what a skip must come to
(tests/e2e/scripts/keep_going_loop.py --reference)."""

from __future__ import annotations

import json
import runpy
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, run_cli

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

LOOP = ROOT / "tests" / "e2e" / "scripts" / "keep_going_loop.py"
DDP = ROOT / "tests" / "e2e" / "scripts" / "keep_going_ddp.py"
GUARDED = ROOT / "tests" / "e2e" / "scripts" / "guarded_loss.py"


def reference(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """The by-hand reference's final state and log (run in this process: no torch import)."""
    out = tmp_path / "reference.pt"
    argv = sys.argv
    sys.argv = [str(LOOP), str(out), *args, "--reference"]
    try:
        runpy.run_path(str(LOOP), run_name="__main__")
    finally:
        sys.argv = argv
    return torch.load(out, weights_only=True), Path(f"{out}.log").read_text()


def audited(tmp_path: Path, *args: str, **options: Any):
    out = tmp_path / "audited.pt"
    report = run_script(ScriptTarget(path=str(LOOP), args=(str(out), *args)),
                        ScriptOptions(keep_going=True, **options))
    return report, torch.load(out, weights_only=True), Path(f"{out}.log").read_text()


def same(a: Any, b: Any) -> bool:
    """Exactly equal, tensors by torch.equal, through dicts and lists (state dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_three_bad_steps_of_different_kinds_are_skipped_without_a_trace(tmp_path):
    # A forward log(-1) in the model (it also makes BatchNorm's running statistics NaN), a
    # backward-only sqrt(0) and a loss-code log(0), each in its own step.
    bad = "2:forward,4:backward,6:loss"
    expected, expected_log = reference(tmp_path, "--bad", bad)
    out, report_path, skips = tmp_path / "audited.pt", tmp_path / "r.json", tmp_path / "skip.json"
    result = run_cli("run", "-q", "--keep-going", "--json", report_path, "--skip-list", skips,
                     LOOP, out, "--bad", bad)
    assert result.code == 1, result.stderr
    got = torch.load(out, weights_only=True)
    assert same(got["model"], expected["model"])          # weights and buffers
    assert same(got["optimizers"], expected["optimizers"])  # Adam's moments and step counts
    # The script ran every step once, with its own RNG draws and learning rates.
    log = Path(f"{out}.log").read_text()
    assert log == expected_log and [json.loads(line)["step"] for line in log.splitlines()] == \
        list(range(9))
    report = json.loads(report_path.read_text())
    findings = report["findings"]
    assert [(f["step"], f["where"], f["op"], f["cause"], f["action"], f["localized_by"])
            for f in findings] == [
        (2, "forward", "aten.log.default", "log-domain", "skipped", "in-process"),
        (4, "backward", "aten.div.Tensor", "sqrt-domain", "skipped", "in-process"),
        (6, "forward", "aten.log.default", "log-domain", "skipped", "in-process")]
    assert findings[0]["samples"] == [3] and report["finding"] == findings[0]
    assert report["status"] == "nonfinite"
    assert (report["bad_steps"]["count"], report["bad_steps"]["skipped"],
            report["bad_steps"]["stopped"]) == (3, 3, None)
    assert [e["step"] for e in report["timeline"] if e.get("bad") == "skipped"] == [2, 4, 6]
    entries = json.loads(skips.read_text())["skip"]
    assert [(e["step"], e["rows"]) for e in entries] == [(2, [3]), (4, None), (6, None)]


SHAPES = {
    # One bad micro-batch (the second of two) skips its whole step, both micro-batches'
    # BatchNorm updates undone.
    "accumulate": ("2:forward,5:backward", [2, 5]),
    # The scale starts at 1e38: the first steps overflow, the scaler's own skips (steps, as the
    # loop counts them, not findings). Step 5's NaN loss is skipped by the scaler too; step 7's
    # inf loss has finite gradients, so nanaudit holds the update back and the scale backs off
    # as after an overflow. (Before: steps 3 and 4, the scaler's skips left uncounted.)
    "scaler": ("5:forward,7:loss", [5, 7]),
    # LBFGS: the closure's first evaluation trips; the optimizer must not move, and its state
    # (func_evals, which it counts before it looks at the gradient) stays as it was.
    "closure": ("3:forward,6:loss", [3, 6]),
    # Two optimizers stepped one after the other: both hold back (each counts its steps).
    "two": ("2:backward,5:loss", [4, 10]),
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_step_shape_skips_without_a_trace(tmp_path, shape):
    bad, steps = SHAPES[shape]
    args = ("--shape", shape, "--bad", bad)
    expected, expected_log = reference(tmp_path, *args)
    report, got, log = audited(tmp_path, *args)
    assert same(got, expected) and log == expected_log
    assert exit_code(report) == 1
    assert [(f.step, f.action, f.localized_by) for f in report.findings] == [
        (step, "skipped", "in-process") for step in steps]
    if shape == "scaler":
        assert report.run.first_run.skipped >= 3      # two overflows, one bad step


def test_a_persistent_bad_shard_stops_at_max_bad_steps_and_the_skip_list_has_every_step(
        tmp_path):
    # Steps 3..27 all make log(0) at the same line: 24 skipped, the 25th stops the run; the
    # report keeps 20 findings whole, the skip list has all 25.
    bad = ",".join(f"{s}:loss" for s in range(3, 28))
    report_path, skips = tmp_path / "r.json", tmp_path / "skip.json"
    result = run_cli("run", "-q", "--keep-going", "--max-bad-steps", "24", "--json",
                     report_path, "--skip-list", skips, LOOP, tmp_path / "out.pt", "--bad", bad,
                     "--steps", "30")
    assert result.code == 1, result.stderr
    report = json.loads(report_path.read_text())
    section = report["bad_steps"]
    assert (section["count"], section["skipped"], section["stopped"], section["persistent"],
            section["whole"]) == (25, 24, "max-bad-steps", True, 20)
    assert len(report["findings"]) == 20 and report["findings"][0]["step"] == 3
    assert section["summarized"][0]["count"] == 5
    entries = json.loads(skips.read_text())["skip"]
    assert [e["step"] for e in entries] == list(range(3, 28))
    assert report["findings"][0]["action"] == "skipped"


def write(tmp_path: Path, code: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def test_a_nan_weight_from_a_checkpoint_stops_at_once(tmp_path):
    # Skipping changes nothing when the weights are bad before the step.
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        state = model.state_dict()
        state["weight"][0, 2] = float("nan")
        torch.save(state, "ckpt.pt")
        model.load_state_dict(torch.load("ckpt.pt", weights_only=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
        print("ran", step)
    """)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(keep_going=True))
    assert exit_code(report) == 1
    assert [(f.step, f.action, f.stop_reason) for f in report.findings] == [
        (0, "stopped", "nonfinite-state")]
    assert report.bad_steps.skipped == 0


def test_an_update_that_made_the_weights_nonfinite_was_applied_and_cannot_be_skipped(tmp_path):
    """transformers' run_clm.py (the Trainer) with `--adam_epsilon 0`: the position embedding's
    rows no token reached have zero moments, and AdamW's first update divides 0 by 0 there.
    The weights were finite before that step, and its update was applied before the read that
    saw it: the run stops with `cannot-skip` (it said `nonfinite-state`: "non-finite before
    the step"), naming step 0's update."""
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        pos = nn.Embedding(64, 8)                 # block size 16: rows 16.. get no gradient
        head = nn.Linear(8, 1)
        params = list(pos.parameters()) + list(head.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3, eps=0.0)
        for step in range(5):
            optimizer.zero_grad()
            head(pos(torch.arange(16))).pow(2).mean().backward()
            optimizer.step()
        print("ran", step)
    """)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(keep_going=True))
    assert exit_code(report) == 1
    assert [(f.step, f.action, f.stop_reason, f.cause) for f in report.findings] == [
        (0, "stopped", "cannot-skip", "optimizer-update")]
    assert report.bad_steps.skipped == 0


@pytest.mark.slow
def test_a_hand_written_update_cannot_be_skipped_and_stops(tmp_path):
    # No optimizer call to leave out: the run stops at the bad step and says why.
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        for step in range(5):
            x = torch.rand(8, 4) + 0.5
            if step == 2:
                x[1, 0] = 0.0
            model.zero_grad()
            model(torch.log(x)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.01)
    """)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(keep_going=True))
    assert exit_code(report) == 1
    assert [(f.step, f.action, f.stop_reason) for f in report.findings] == [
        (2, "stopped", "cannot-skip")]


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_every_rank_skips_the_step_one_rank_made_bad(tmp_path):
    # Rank 1's loss of step 3 is inf, its gradients of step 4 NaN: the one exchange gives both
    # ranks each verdict, both hold the update back, and the replicas stay equal, and equal to
    # the by-hand reference. Each bad step is localized in-process by rank 1's replay of its
    # own step (its gradients before DDP's all-reduce), on every rank's report.
    from helpers import launch_ranks
    ref, got, out = tmp_path / "ref", tmp_path / "got", tmp_path / "report.json"
    codes, outputs = launch_ranks([DDP, ref, "--reference"], 2, timeout_s=120)
    assert codes == [0, 0], outputs
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--keep-going", "--json",
                                   out, DDP, got], 2, timeout_s=120)
    assert codes == [1, 1], outputs
    expected = torch.load(f"{ref}.rank0.pt", weights_only=True)
    for rank in (0, 1):
        assert same(torch.load(f"{got}.rank{rank}.pt", weights_only=True), expected)
    for path in (out, tmp_path / "report.rank1.json"):
        report = json.loads(path.read_text())
        assert [(f["step"], f["rank"], f["where"], f["action"]) for f in report["findings"]] == [
            (3, 1, "forward", "skipped"), (4, 1, "backward", "skipped")]
        log0, sqrt0 = report["findings"]
        assert (log0["op"], log0["cause"], log0["localized_by"]) == (
            "aten.log.default", "log-domain", "in-process")
        assert (sqrt0["op"], sqrt0["forward_op"], sqrt0["cause"], sqrt0["localized_by"]) == (
            "aten.div.Tensor", "aten.sqrt.default", "sqrt-domain", "in-process")
        assert all("not localized" not in f.get("explanation", "") for f in report["findings"])
        assert [r["steps_run"] for r in report["distributed"]["ranks"]] == [6, 6]


def test_a_loss_the_scripts_own_guard_skipped_is_recorded_and_the_next_update_applies(
        tmp_path):
    # `if not torch.isfinite(loss): continue`: the script left step 3 out itself; the update
    # nanaudit checks next is the next batch's, and must run (the weights end as without
    # nanaudit), while step 3's loss is still a localized finding.
    path = GUARDED
    argv = sys.argv
    sys.argv = [str(path), str(tmp_path / "plain.pt")]
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    report = run_script(ScriptTarget(path=str(path), args=(str(tmp_path / "audited.pt"),)),
                        ScriptOptions(keep_going=True))
    assert [(f.step, f.op, f.action, f.localized_by) for f in report.findings] == [
        (3, "aten.log.default", "skipped", "in-process")]
    assert same(torch.load(tmp_path / "audited.pt", weights_only=True),
                torch.load(tmp_path / "plain.pt", weights_only=True))


def test_every_bad_step_of_a_diverged_run_is_told_the_same_way(tmp_path):
    """lr 1e30: step 0's update grows the weights past 1e29 (an update-ratio warning) and every
    later forward overflows the same op. Each skipped step's finding is linked to the warning
    when the run meets it, as the first one is at the end: all `divergence` (before: only the
    first, the rest `dtype-overflow`), so the log sees one persistent cause."""
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e30)
        for step in range(12):
            optimizer.zero_grad()
            model(torch.randn(8, 8)).pow(2).mean().backward()
            optimizer.step()
    """)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(keep_going=True,
                                                                    max_bad_steps=4))
    assert exit_code(report) == 1
    assert [(f.step, f.cause, f.first_warning.kind) for f in report.findings] == [
        (step, "divergence", "update-ratio") for step in range(1, 6)]
    assert {f.fix for f in report.findings} == {report.finding.fix}
    assert report.finding.fix.startswith("lower the learning rate")
    assert report.bad_steps.persistent and report.bad_steps.stopped == "max-bad-steps"
