"""The deferred read: a step's sentinel values reach the host one step later, never idling the GPU.

With one synchronous read per step the host waits for the step to finish before it queues the
next one, and the GPU idles while the next step's first kernels are launched. In the deferred
mode the step's readout is copied to pinned host memory without blocking and read after the next
step has been queued. Meanwhile the device itself keeps a bad update from landing: a sticky flag,
set on the device when any of the step's values is non-finite, is passed to the optimizer as
`found_inf` (the way a GradScaler does for fused optimizers), so that step's update and every
later one are skipped until the host has read the flag. What a replay needs is then still the
pre-step state: parameters and optimizer state (skipped updates), the buffers a step changes
(copied before each step, two steps kept), the RNG state and the batch (kept one step longer).

An optimizer that cannot skip on the device (only fused ones take `found_inf`), a GradScaler
(whose skipped steps are normal AMP behaviour the host must count) and torchrun (every rank
decides together each step) keep the synchronous read; `choose_read` says which mode and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from nanaudit.report.sections import SentinelRead
from nanaudit.report.vocabulary import SentinelReadMode


@dataclass(frozen=True)
class ReadMode:
    """How a run reads its sentinels: "sync" (each step) or "deferred" (one step later)."""

    mode: str
    reason: str
    sync_from: int | None = None   # deferred until a value was non-finite at this step

    @property
    def defers(self) -> bool:
        return self.mode == "deferred" and self.sync_from is None

    def section(self, steps_run_again: int = 0) -> SentinelRead:
        """The report's `sentinel_read` section; `steps_run_again`: keep-going's wasted
        steps under the deferred read (deferred_step.py)."""
        return SentinelRead(SentinelReadMode(self.mode), self.reason, self.sync_from,
                            steps_run_again or None)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Can this optimizer skip its update on the device given a `found_inf` tensor?"""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def choose_read(requested: str, device: torch.device, optimizer: torch.optim.Optimizer | None,
                grad_scaler: torch.amp.GradScaler | None,
                distributed: bool, single_step: bool = True) -> ReadMode:
    """The read mode of a run: `requested` is the config's `sentinel_read` (auto | sync |
    deferred); auto defers on CUDA only, where there is a device queue to keep busy.
    `single_step`: one batch, one optimizer and no scheduler per step (the deferred read
    skips one fused update on the device and rewinds one batch)."""
    if requested == "sync":
        return ReadMode("sync", "sentinel_read: sync")
    why_not = None
    if not single_step:
        why_not = ("accumulation, several optimizers, a scheduler or the user's own step: "
                   "each update is checked before it runs")
    elif optimizer is None:
        why_not = "no optimizer update to skip (the weights never change)"
    elif grad_scaler is not None:
        why_not = "a GradScaler drives the update: its skipped steps are read each step"
    elif distributed:
        why_not = "under torchrun the ranks decide together at each step"
    elif not skips_on_device(optimizer):
        why_not = (f"{type(optimizer).__name__} cannot skip its update on the device (only "
                   f"fused optimizers take found_inf: pass fused=True)")
    if why_not is not None:
        return ReadMode("sync", why_not)
    if requested == "auto" and device.type != "cuda":
        return ReadMode("sync", f"on {device.type} there is no device queue to keep busy")
    return ReadMode("deferred", f"{type(optimizer).__name__} skips a bad update on the device "
                                f"until the host reads the step one step later")


class DeviceSkip:
    """The sticky device flag: 1.0 once any step's readout held a non-finite value."""

    def __init__(self, device: torch.device) -> None:
        self.halt = torch.zeros((), dtype=torch.float32, device=device)

    def note(self, readout: torch.Tensor) -> None:
        """Raise the flag when a value of the readout is non-finite (on the device, no sync).
        The sum is non-finite exactly when an element is: the values are norms and a loss,
        far from float64's range."""
        torch.maximum(self.halt, (~torch.isfinite(readout.sum())).to(torch.float32),
                      out=self.halt)

    def step(self, optimizer: Any, step_fn: Callable[[], object]) -> None:
        """Run the optimizer's step with the flag as its `found_inf`, as GradScaler.step does
        for an optimizer with `_step_supports_amp_scaling` (an Optimizer, typed Any: the two
        attributes are the fused kernels' protocol, not the class's)."""
        optimizer.grad_scale, optimizer.found_inf = None, self.halt
        try:
            step_fn()
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def clear(self) -> None:
        self.halt.zero_()


class BufferKeeper:
    """The buffers as they were before each of the last `slots` forwards: BatchNorm's running
    statistics change in every forward (inside the kernel, which moves no version counter, so
    every buffer is copied: one device-side copy per slot, reused, no sync). The deferred read
    keeps two steps; the sync loop one per micro-batch of its window."""

    def __init__(self, model: torch.nn.Module, slots: int = 2) -> None:
        self.buffers = [b.detach() for b in model.buffers()]
        self._slots: list[list | None] = [None] * slots
        self._turn = 0

    def save(self) -> list:
        """Copy the buffers into the oldest slot; returns it for `restore`."""
        slot = self._slots[self._turn]
        if slot is None:
            slot = self._slots[self._turn] = [b.clone() for b in self.buffers]
        elif slot:
            torch._foreach_copy_(slot, self.buffers)
        self._turn = (self._turn + 1) % len(self._slots)
        return slot

    def pairs(self, saved: list) -> list:
        """(live buffer, its saved value) pairs, copied: a StepState keeps them past the
        slot's reuse."""
        return [(b, v.clone()) for b, v in zip(self.buffers, saved)]

    def restore(self, saved: list) -> None:
        """Put every buffer back as it was when `saved` was taken."""
        if saved:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, saved)


# What HostReader.send gives: the values themselves (CPU), or a pinned copy and its event.
PendingRead = torch.Tensor | tuple[torch.Tensor, torch.cuda.Event]


class HostReader:
    """Readouts copied to pinned host memory without blocking, read when they are needed."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def send(self, values: torch.Tensor) -> PendingRead:
        if not self.cuda:
            return values            # CPU ops are done when they return: nothing in flight
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def receive(self, handle: PendingRead) -> list[float]:
        if not self.cuda:
            return cast(torch.Tensor, handle).tolist()
        host, done = cast(tuple[torch.Tensor, torch.cuda.Event], handle)
        done.synchronize()           # the one wait: long done unless the device is behind
        return host.tolist()
