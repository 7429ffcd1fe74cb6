"""One `optimizer.step()` call of a framework's training loop held back, for the callbacks'
`on_finding="skip"` (transformers.py, lightning.py).

The framework calls its optimizer's `step` itself, right after the hook where the Sentinel
decided to skip, so the hook cannot leave the call out; it makes that one call a no-op
instead: an instance attribute shadows the optimizer's `step` until it has been called once
(or `release` runs), then the class's method is back. Nothing of the optimizer runs, so its
state (moments, step counts) is exactly as before.

A GradScaler that took part in the step (its `unscale_` for gradient clipping) expects its
`update()` before the next step: the held call runs `update(new_scale=...)` with the scale it
has, which clears its per-step record and leaves the scale and growth count as they were.
Accelerate's optimizer (the HF Trainer's) also reports the step as skipped, as it does when
its GradScaler skips one, so the Trainer does not step the learning-rate scheduler.
"""

from __future__ import annotations

from typing import Any


class HeldStep:
    """The next `optimizer.step()` does nothing (see the module docstring)."""

    def __init__(self, optimizer: Any, scaler: Any = None):
        self.optimizer, self.scaler = optimizer, scaler
        self.called = False
        # A `step` the instance already had (a wrapper someone installed) comes back after.
        self.previous = optimizer.__dict__.get("step")
        optimizer.step = self._held       # shadows the optimizer's own step for one call

    @classmethod
    def hold(cls, trainer: Any) -> HeldStep:
        """The HF Trainer's next optimizer step (its accelerator's GradScaler, if any)."""
        return cls(trainer.optimizer, getattr(trainer.accelerator, "scaler", None))

    def _held(self, *args: Any, **kwargs: Any) -> None:
        self.called = True
        self._unshadow()
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.update(new_scale=self.scaler.get_scale())
        if hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = True    # accelerate: "this step was skipped"

    def release(self) -> None:
        """After the framework has read the step: everything as it was."""
        self._unshadow()
        if self.called and hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = False

    def _unshadow(self) -> None:
        if self.optimizer.__dict__.get("step") != self._held:
            return
        if self.previous is not None:
            self.optimizer.step = self.previous
        else:
            del self.optimizer.step
