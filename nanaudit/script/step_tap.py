"""What `nanaudit run` keeps of the current step so that it can be replayed in-process at a trip:
the step record (run/step_record.py) filled from the auditor's hooks, and the loss code recorded
from the model's return to `backward` (run/loss_code.py).

The model's return is heard by a forward hook put on the step's outermost module in its own
call and removed as it fires (one hook call a micro-batch; the forward's inner modules keep
PyTorch's hook-free path). Only the first run records: a re-run traces instead."""

from __future__ import annotations

from typing import Any

import torch

from nanaudit.run.loss_code import LossCodeRecorder
from nanaudit.run.step_record import ModelCall, StepRecord


class StepTap:
    """Feeds the step record; `enabled` False (a re-run) keeps nothing."""

    def __init__(self, enabled: bool = True, on_return: Any = None):
        self.enabled = enabled
        self.on_return = on_return        # told when the model's outermost call returned
        self.record = StepRecord()
        self._recorder = LossCodeRecorder()
        self._handle: Any = None

    def called(self, module: torch.nn.Module, entry: Any, args: tuple, kwargs: dict) -> None:
        """A micro-batch's outermost module call (before its forward)."""
        if not self.enabled:
            return
        self.stop()
        call = self.record.called(module, entry, args, kwargs)
        if entry is module:         # a compiled call never meets the module's hooks
            self._handle = module.register_forward_hook(
                lambda _m, _a, output: self._returned(call, output))

    def _returned(self, call: ModelCall, output: Any) -> None:
        self._unhook()
        call.output = output
        self._recorder.start(call.code)
        if self.on_return is not None:
            self.on_return()

    def loss(self, loss: torch.Tensor) -> None:
        """An unscaled loss reaching backward: the current micro-batch's."""
        last = self.record.last
        if self.enabled and last is not None:
            last.losses.append(loss)

    def skipped_loss(self) -> torch.Tensor | None:
        """The loss the last micro-batch's code made, non-finite, and never differentiated
        (None: it reached backward, or was finite, or the code made no differentiable scalar).
        One host read, only after a forward that had no backward. A bad one joins the
        micro-batch's losses: the step's check reads it, the replay verifies it."""
        last = self.record.last
        if not self.enabled or last is None or last.losses or last.output is None:
            return None
        loss = last.code.skipped_loss()
        if loss is None or bool(torch.isfinite(loss.detach())):
            return None
        last.skipped = True
        last.losses.append(loss)
        return loss

    def stop(self) -> None:
        """The loss code ended (a model call, an optimizer step, the script's end)."""
        self._unhook()
        self._recorder.stop()

    def close(self) -> None:
        """The window was checked: drop it."""
        self.stop()
        self.record.close()

    def _unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
