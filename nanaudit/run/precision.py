"""Mixed precision: autocast for forward and loss, and a GradScaler driven without extra syncs.

torch's `GradScaler.step()` reads its found-inf flags with `.item()`: a second host sync per
step. nanaudit already reads whether the gradients are finite in its one readout, so it drives
the scaler itself: `unscale_()` records found-inf on the device, the optimizer steps only when
the readout said the scaled gradients were finite, and `update()` moves the scale on the device
with torch's own backoff and growth rules. The host keeps a mirror of the scale (the same
arithmetic, exact in binary) for the timeline and for replays, so the scale is never read back.

A skipped step is normal AMP behaviour and only goes into the timeline; when the skips become a
finding (the scale collapsed) is the check core's rule (run/check/scaler.py), the same for
`Sentinel` and `nanaudit run`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.config.schema import RunOptions
from nanaudit.run.check.scaler import ScalerWatch, backoff_scale

DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ScaleStep:
    """What the scaler did at one step: the scale before and after, and whether it skipped."""

    before: float
    after: float
    skipped: bool
    collapsed: str | None = None     # why the skips became a finding, when they did


_NO_AUTOCAST = contextlib.nullcontext()    # reusable: one fewer object per step


class Precision:
    """The run's precision: autocast dtype, GradScaler, and the host mirror of its scale."""

    def __init__(self, config: RunOptions, device: torch.device) -> None:
        self.name = config.precision
        self.dtype = DTYPES[config.precision]
        self.device_type = torch.device(device).type
        self.amp = config.amp
        self.scaler: torch.amp.GradScaler | None = None
        self.scale = 1.0
        if config.uses_grad_scaler:
            self.scaler = torch.amp.GradScaler(self.device_type, init_scale=self.amp.init_scale,
                                               growth_interval=self.amp.growth_interval)
            self.scale = float(self.amp.init_scale)
        self._growth = 0
        self.watch = ScalerWatch(self.amp.scale_floor, self.amp.max_skipped)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The tensor to backpropagate: the loss times the step's scale (the live scaler's own
        tensor in the loop; the recorded float on a replay)."""
        if self.scaler is None:
            return loss
        if scale is not None:
            return loss * scale
        return self.scaler.scale(loss)

    def after_readout(self, optimizers: Sequence[torch.optim.Optimizer],
                      grads_finite: bool) -> ScaleStep | None:
        """Unscale and update the scaler after the step's readout (no sync); None without one.

        Returns the step's scale record; the caller runs each `optimizer.step()` only when the
        gradients were finite, after this unscaled them."""
        if self.scaler is None:
            return None
        before = self.scale
        for optimizer in optimizers:
            self.scaler.unscale_(optimizer)
        collapsed = None
        if grads_finite:
            self.watch.applied()
            self._growth += 1
            if self._growth == self.amp.growth_interval:
                self.scale, self._growth = self.scale * self.scaler.get_growth_factor(), 0
        else:
            self.scale, self._growth = backoff_scale(self.scaler, self.scale), 0
            collapsed = self.watch.skip(before, self.scale)
        return ScaleStep(before, self.scale, not grads_finite, collapsed)

    def finish_update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The scaler's own update, after the optimizer steps (or the skip)."""
        if self.scaler is not None and optimizers:
            self.scaler.update()
