"""`scan --keep-going` under the deferred read (`sentinel_read: deferred`, a fused Adam): the
read stays deferred, every bad step is a skipped finding as under the sync read, and the run
leaves exactly the sync read's parameters, buffers (BatchNorm, Dropout's RNG) and optimizer
state, with two bad steps in a row and a bad last step too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import keep_going_scan_case as case
import pytest
import torch

from nanaudit.commands.scan import audit
from nanaudit.report.model import Report
from nanaudit.report.vocabulary import BadStepAction, Status, StopReason, Where


def _config(tmp_path: Path, read: str, bad: str) -> Path:
    path = tmp_path / f"{read}.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: keep_going_scan_case:build_model
        data: {{entrypoint: keep_going_scan_case:batches, args: {bad}}}
        loss: keep_going_scan_case:compute_loss
        optimizer: {{entrypoint: keep_going_scan_case:fused_adam}}
        sentinel_read: {read}
        seed: 0
        """))
    return path


def _scan(tmp_path: Path, read: str, bad: str, **options) -> tuple[Report, dict, dict]:
    """The report, the trained model's state and its optimizer's state."""
    report = audit(_config(tmp_path, read, bad), keep_going=True, **options)
    model = {k: v.detach().clone() for k, v in case.BUILT[-1].state_dict().items()}
    state = case.OPTIMIZERS[-1].state_dict()["state"]
    return report, model, {k: {n: torch.as_tensor(t).clone() for n, t in s.items()}
                           for k, s in state.items()}


def _assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_same(value, got[key])
        else:
            assert torch.equal(value, got[key]), key


def _findings(report: Report) -> list[tuple]:
    return [(f.step, f.where, f.op, f.cause.value, f.samples, f.batch_index, f.action)
            for f in report.findings]


@pytest.mark.parametrize("bad, run_again", [
    ("{bad: {3: forward, 6: backward}}", 2),
    # Two bad steps in a row; the data draws from the global RNG between steps.
    ("{bad: {4: backward, 5: forward}, noise: true}", 2),
    ("{bad: {8: forward, 9: backward}}", 1),       # the last one is read after the loop
])
def test_skips_under_the_deferred_read_leave_the_sync_reads_state(tmp_path, bad, run_again):
    deferred, model, optimizer = _scan(tmp_path, "deferred", bad)
    sync, sync_model, sync_optimizer = _scan(tmp_path, "sync", bad)
    assert deferred.sentinel_read is not None and sync.sentinel_read is not None
    assert deferred.sentinel_read.mode == "deferred"
    assert deferred.sentinel_read.sync_from_step is None
    assert deferred.sentinel_read.steps_run_again == run_again
    assert sync.sentinel_read.mode == "sync" and sync.sentinel_read.steps_run_again is None
    assert deferred.status == sync.status == Status.NONFINITE
    assert deferred.steps_run == sync.steps_run == 10
    kinds = {int(k): v for k, v in
             (part.split(": ") for part in bad[bad.index("{", 1) + 1:bad.index("}")].split(", "))}
    assert _findings(deferred) == _findings(sync)
    assert [f.step for f in deferred.findings] == sorted(kinds)
    for finding in deferred.findings:
        assert finding.action == BadStepAction.SKIPPED
        if kinds[finding.step] == "forward":
            assert (finding.where, finding.cause.value) == (Where.INPUT, "nonfinite-input")
            assert finding.samples == [3]
        else:
            assert (finding.where, finding.cause.value) == (Where.BACKWARD, "sqrt-domain")
            assert finding.forward_op == "aten.sqrt.default"
    assert [e.step for e in deferred.timeline] == list(range(10))
    assert [repr(e.loss) for e in deferred.timeline] == [repr(e.loss) for e in sync.timeline]
    _assert_same(sync_model, model)
    _assert_same(sync_optimizer, optimizer)


def test_a_persistent_bad_shard_stops_at_max_bad_steps_under_the_deferred_read(tmp_path):
    report, model, optimizer = _scan(tmp_path, "deferred", "{every: backward}",
                                     max_bad_steps=2)
    sync, sync_model, sync_optimizer = _scan(tmp_path, "sync", "{every: backward}",
                                             max_bad_steps=2)
    assert report.steps_run == sync.steps_run == 3
    assert _findings(report) == _findings(sync)
    assert [(f.step, f.action) for f in report.findings] == [
        (0, BadStepAction.SKIPPED), (1, BadStepAction.SKIPPED), (2, BadStepAction.STOPPED)]
    assert report.findings[-1].stop_reason == StopReason.MAX_BAD_STEPS
    assert report.sentinel_read is not None
    assert (report.sentinel_read.mode, report.sentinel_read.sync_from_step,
            report.sentinel_read.steps_run_again) == ("deferred", 2, 2)
    _assert_same(sync_model, model)
    # No update ever ran. The fused Adam made its state at the first (skipped) step on the
    # device, as a fresh one would be (step 0, zero moments); the sync read never called it.
    assert sync_optimizer == {}
    assert all(not t.any() for s in optimizer.values() for t in s.values())
