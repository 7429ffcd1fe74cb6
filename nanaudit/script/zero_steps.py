"""A DeepSpeed engine's ZeRO steps as the script's hooks hear them (run/deepspeed_zero.py).

The engine's ZeRO optimizer is wrapped on the instance when the engine is first called, once
per optimizer, and unwrapped on exit:

* ZeRO-1 and ZeRO-2 step the torch optimizer as the hooks hear any other (one step per param
  group); a step DeepSpeed skips for an overflow calls no torch optimizer, so it is told to the
  listener and checked as the step it was.
* ZeRO-3 steps the torch optimizer once per sub-group, each holding only its own flat: the
  ZeRO step is the step. It is checked once at its entry, before DeepSpeed's overflow
  all-reduce, over every sub-group; its torch steps are left unheard (`running`) and count as
  one step when it returns, none when DeepSpeed skipped it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from nanaudit.run.deepspeed_zero import (
    wrap_zero3_step,
    wrap_zero_step,
    zero_optimizer,
    zero_stage,
)


class Listener(Protocol):
    """What of the auditor a ZeRO step tells (hooks.Listener)."""

    def update_starting(self) -> None: ...
    def before_update(self, optimizer: Any, evaluation: int | None) -> None: ...
    def after_update(self, optimizer: Any) -> None: ...
    def stepped(self) -> int: ...


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
        self.running: Any = None     # the torch optimizer of the ZeRO-3 step running
        self._wrapped: set[int] = set()
        self._restore: list[Callable[[], None]] = []

    def wrap(self, engine: Any) -> None:
        """The engine's ZeRO optimizer, once."""
        zero = zero_optimizer(engine)
        if zero is None or id(zero) in self._wrapped:
            return
        self._wrapped.add(id(zero))
        if zero_stage(engine) == 3:
            entered = functools.partial(self._zero3_entered, zero.optimizer)
            self._restore.append(wrap_zero3_step(zero, entered, self._zero3_left))
        else:
            self._restore.append(wrap_zero_step(zero, self.listener.stepped, self._skipped))

    def remove(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        self._wrapped.clear()
        self.running = None

    def _zero3_entered(self, optimizer: Any) -> None:
        """A ZeRO-3 step, before DeepSpeed reads its gradients: its one check (a finding
        raises StepHalted, every rank together), then its torch steps unheard."""
        self.tap.stop()
        self.listener.update_starting()
        self.listener.before_update(optimizer, None)
        self.running = optimizer

    def _zero3_left(self, updated: bool) -> None:
        """The ZeRO-3 step returned: one step when DeepSpeed updated; a step it skipped with
        nothing found at the check is not a step (as a GradScaler's skip is not)."""
        optimizer, self.running = self.running, None
        if updated:
            self.listener.after_update(optimizer)
        else:
            self.tap.close()
        self.await_forward()

    def _skipped(self, optimizer: Any) -> None:
        self.tap.stop()
        self.listener.update_starting()
        # Checked as the step it was, every rank together (each skips alike): a finding raises
        # StepHalted; a skip the check finds nothing in is not a step, as a GradScaler's is not.
        self.listener.before_update(optimizer, None)
        self.tap.close()
        self.await_forward()
