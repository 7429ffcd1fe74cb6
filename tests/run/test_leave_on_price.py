"""The leave-on price of `nanaudit run`'s step record on a clean step, counted rather than timed
(a shared machine's timings drift; a count of Python calls does not): the calls the recording
makes each step stay within a budget, `--keep-going` adds none, and however long the run, the
record holds one window (memory flat). The timings are scripts/bench_long.py's."""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nanaudit.run.loss_code import LossCode, LossCodeRecorder, RecordedOp
from nanaudit.run.step_record import ModelCall
from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.keep_going import KeepGoing

RECORDING = ("nanaudit/run/loss_code.py", "nanaudit/run/step_record.py",
             "nanaudit/script/step_tap.py", "nanaudit/script/hooks.py")
# Python calls into the recording's modules and the hooks that feed it per clean step of the
# loop below: the model call (the first-call hook, ModelCall, LossCode, RNG state), its return
# (the mode pushed, the next forward awaited), one loss op, zero_grad with the mode paused,
# backward (popped), the loss, the check's stop, the update's hooks and the window's close. It
# was 31 for the recording alone before its price was first cut, then 18 + 12 from the hooks;
# a new per-step call must be paid for somewhere else.
BUDGET = 26


@contextmanager
def audited(keep_going: bool = False) -> Iterator[tuple[ScriptAuditor, Any]]:
    """An auditor installed as `nanaudit run` installs it, and the script's objects built after
    (an optimizer built before the hooks would make the auditor think the script steps by
    hand)."""
    auditor = ScriptAuditor()
    if keep_going:
        auditor.keep = KeepGoing(10, lambda trip: None, lambda: auditor.step)
    auditor.install()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(16, 4), torch.randn(16, 1)

        def step() -> None:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        yield auditor, step
    finally:
        auditor.remove()


def calls_per_step(step: Any, steps: int = 10) -> Counter:
    """Python calls per step, by file (nanaudit's files by their path in the package)."""
    counts: Counter = Counter()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename.replace("\\", "/")
            counts[name[name.rfind("nanaudit/"):] if "nanaudit/" in name else "other"] += 1
    for _ in range(3):
        step()                         # the first steps build the optimizer's state
    # Another test's garbage collected mid-count would run its finalizers here ("other" one
    # call higher in a full suite): collect it first and keep the collector off while counting.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
        gc.enable()
    return Counter({name: n // steps for name, n in counts.items()})


def test_a_clean_step_calls_the_recording_within_its_budget() -> None:
    with audited() as (auditor, step):
        counts = calls_per_step(step)
        assert auditor.trip is None and auditor.step == 13
    recording = sum(counts[name] for name in RECORDING)
    assert 0 < recording <= BUDGET, counts


def test_keep_going_adds_no_call_to_a_clean_step() -> None:
    with audited() as (_, step):
        plain = calls_per_step(step)
    with audited(keep_going=True) as (auditor, step):
        keeping = calls_per_step(step)
        assert auditor.keep is not None and not auditor.keep.held.active
    assert keeping == plain


def _records() -> int:
    """How many step records (model calls, recorded ops) are alive now."""
    gc.collect()
    return sum(type(o) in (ModelCall, RecordedOp) for o in gc.get_objects())


def test_the_record_holds_one_window_however_long_the_run() -> None:
    # Counted from what was alive before (another test in this process may hold its own).
    before = _records()
    with audited() as (auditor, step):
        step()
        first = _records() - before
        for _ in range(300):
            step()
        record = auditor.hooks.tap.record
        assert record.calls == []                   # checked and closed at each step
        assert _records() - before <= first <= 2


def test_a_recorded_op_names_the_users_line_and_its_backward_root() -> None:
    """What the inline record keeps: the op by reference, the user's line, no autocast region,
    and the backward that ended the code."""
    out, target = torch.randn(4, 1, requires_grad=True), torch.randn(4, 1)
    code, recorder = LossCode(), LossCodeRecorder()
    recorder.start(code)
    line = sys._getframe().f_lineno + 1
    loss = nn.functional.mse_loss(out, target)
    recorder.reached_backward(torch.Tensor.backward, (loss,), {})
    assert not recorder.pushed
    (op,) = code.ops
    assert isinstance(op, RecordedOp) and op.func is nn.functional.mse_loss
    assert op.args == (out, target) and op.out is loss and op.autocast == ()
    assert op.where == (__file__, line, sys._getframe().f_code.co_name)
    assert code.roots == [(torch.Tensor.backward, (loss,), {})] and not code.overflowed
