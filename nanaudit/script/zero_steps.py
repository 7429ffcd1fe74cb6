"""A DeepSpeed engine's ZeRO steps as the script's hooks hear them (run/deepspeed_zero.py).

The engine's ZeRO optimizer is wrapped on the instance when the engine is first called, once
per optimizer, and unwrapped on exit. Every stage steps the torch optimizer once per part
(ZeRO-1/2: per param group, ZeRO-3: per sub-group), each holding only its own flat, after
DeepSpeed's overflow all-reduce: the ZeRO step is the step. It is checked once at its entry,
before that all-reduce, over every part; its torch steps are left unheard (`running`) and
count as one step when it returns, none when DeepSpeed skipped it.

Under fp16's dynamic loss scale the check stays at the entry, the step's one host read: the
state before the update is intact there for the in-process replay, and DeepSpeed has not yet
zeroed the gradients it skips. The read's gradients are the scaled ones, so a check that finds
only non-finite gradients (losses, inputs, weights and buffers finite, on every rank) is no
finding there: DeepSpeed will skip the step, as a GradScaler does while it calibrates. When the
step returns skipped, `scale_skipped` hears the scale it skipped at and the one DeepSpeed's own
backoff (its scale factor, its hysteresis) moved it to, read off its scaler (Python floats, no
host read): a step, skipped, as DeepSpeed's `global_steps` counts it; a finding only when the
scale collapsed (run/check/scaler.py, the GradScaler's rule).
A skip whose loss or inputs were already non-finite trips at the entry: the forward made the
value. Under a static scale, fp32 or bf16, non-finite gradients trip at the entry: a skip there
is a finding; a skip of finite gradients (DeepSpeed's float32 sum of a partition overflowed on
them) is a step marked skipped, with a warning (StepLog.update_dropped).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nanaudit.run.deepspeed_zero import (
    dynamic_loss_scale,
    note_zero,
    wrap_zero_step,
    zero_flats,
    zero_optimizer,
)
from nanaudit.script.step_log import StepLog


class Listener(Protocol):
    """What of the auditor a ZeRO step tells (hooks.Listener)."""

    log: StepLog          # the timeline: a step DeepSpeed skipped on finite values says so

    def update_starting(self) -> None: ...
    def before_update(self, optimizer: Any, evaluation: int | None) -> None: ...
    def after_update(self, optimizer: Any) -> None: ...
    def scale_skipped(self, optimizer: Any, scale: float, next_scale: float | None,
                      params: list[torch.Tensor], scaler: str = ...) -> None: ...


class Tap(Protocol):
    """The step record's tap (step_tap.StepTap): what a step's end does to it."""

    def stop(self) -> None: ...
    def close(self) -> None: ...


class ZeroSteps:
    """The ZeRO optimizers of one script run, wrapped (see the module docstring)."""

    def __init__(self, listener: Listener, tap: Tap, await_forward: Callable[[], None]):
        self.listener = listener
        self.tap = tap
        self.await_forward = await_forward
        self.running: Any = None     # the torch optimizer of the ZeRO step running
        self._scale: float | None = None     # its dynamic loss scale at the entry (fp16)
        self._wrapped: set[int] = set()
        self._restore: list[Callable[[], None]] = []

    def wrap(self, engine: Any) -> None:
        """The engine's ZeRO optimizer, once."""
        zero = zero_optimizer(engine)
        if zero is None or id(zero) in self._wrapped:
            return
        self._wrapped.add(id(zero))
        note_zero(engine)            # its flats, read at the step's check (also without ranks)
        self._restore.append(wrap_zero_step(zero, functools.partial(self._entered, zero),
                                            functools.partial(self._left, zero)))

    def remove(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        self._wrapped.clear()
        self.running = None

    def _entered(self, zero: Any) -> None:
        """A ZeRO step, before DeepSpeed reads its gradients: its one check (a finding raises
        StepHalted, every rank together), then its torch steps unheard."""
        self.tap.stop()
        self.listener.update_starting()
        self._scale = dynamic_loss_scale(zero)
        self.listener.before_update(zero.optimizer, None)
        self.running = zero.optimizer

    def _left(self, zero: Any, updated: bool) -> None:
        """The ZeRO step returned: one step when DeepSpeed updated; under a dynamic loss scale
        a step it skipped with nothing found at the check is a step, skipped (as a GradScaler's
        is), and a finding only when the scale collapsed. Otherwise (fp32, bf16, a static
        scale) a step it skipped is one step too, as the script's loop and DeepSpeed's
        `global_steps` count it: mostly one whose non-finite gradients the check at its entry
        found and --keep-going skipped (its update, held back, is let go); but DeepSpeed's own
        check sums each gradient partition in float32, so finite gradients large enough to
        overflow that sum are skipped too: the timeline marks that step skipped, and warns."""
        optimizer, self.running = self.running, None
        scale, self._scale = self._scale, None
        if updated or scale is None:
            if not updated:
                self.listener.log.update_dropped()     # on finite values: DeepSpeed's own skip
            self.listener.after_update(optimizer)
        else:
            self.listener.scale_skipped(optimizer, scale, dynamic_loss_scale(zero),
                                        zero_flats(optimizer) or [], "DeepSpeed")
            self.tap.close()
        self.await_forward()
