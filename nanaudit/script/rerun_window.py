"""The re-run's traced window: from the outermost module call after step N-1's update to step
N's check, the op tracer is armed (and nothing of the cheap checks runs inside it, so the trace
holds the script's ops only); the losses that reached backward in it are the sinks to walk
back from."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nanaudit.script.step_values import leading_size

if TYPE_CHECKING:
    from nanaudit.script.compiled_rerun import CompiledStep


@dataclass
class Armed:
    """The tracer of an armed window and what the localizer needs from it."""

    tracer: Any
    model: torch.nn.Module
    batch_size: int | None
    sinks: list = field(default_factory=list)       # the loss tensors that reached backward
    closed: bool = False
    compiled: CompiledStep | None = None            # a compiled model's call, kept to replay
    ends: list = field(default_factory=list)        # the trace's events as each backward ended

    def backward_ended(self) -> None:
        self.tracer.end_backward()
        self.ends.append(len(self.tracer.trace.events))

    def micro_batch(self, event: int, raised: bool = False) -> int | None:
        """The accumulation window's micro-batch whose ops made tracer event `event`: how many
        backward calls had ended before it. None: the window ran one backward (`raised`: it
        ended raising before its last one, which counts)."""
        return bisect_right(self.ends, event) if len(self.ends) + raised >= 2 else None


class RerunWindow:
    """Where the re-run arms the tracer (step N, closure evaluation E), and what it saw there.
    Unused (`step` None) on the first run."""

    def __init__(self, step: int | None, evaluation: int, tracer: Any, skips: int = 0):
        self.step, self.evaluation, self.tracer = step, evaluation, tracer
        # A scale collapse: the skipped try of step N that collapsed it (its count of tries).
        self.skips, self.tries = skips, 0
        self.armed: Armed | None = None
        self.localized: Any = None       # the optimizer whose step N was reached

    def enter_data_code(self, step: int) -> None:
        """An update or a backward of step `step` ended: the script's own code runs until the
        next module call (traced only by the window of an input trip, data_window.py)."""

    def leave_data_code(self) -> None:
        """A module call or an update starts: the script's own code is left."""

    def heard_loss(self, loss: torch.Tensor, step: int) -> None:
        """A loss reached `backward` in step `step` with no window armed (a step whose loss no
        module call made arms the window of before_rerun.py)."""

    def unchecked(self, step: int) -> bool:
        """Whether step `step` goes unchecked: a re-run's steps are checked, to compare them
        with the first run's (except a cheap re-run's, data_window.py)."""
        return False

    def arms_at(self, step: int, evaluation: int) -> bool:
        return self.step is not None and step == self.step and evaluation == self.evaluation

    def arm(self, module: torch.nn.Module, args: tuple, kwargs: dict, entry: Any = None,
            names: dict[int, str] | None = None) -> None:
        """Arm the tracer at step N's first call of `module` (`entry`: what the script
        called, a torch.compile wrapper of it), after keeping a compiled model's state;
        `names`: the other models' modules by the script's names (Ledger.tracer_names)."""
        # The expensive path's modules, imported on the re-run only (as the tracer is).
        from nanaudit.script.compiled_rerun import compiled_step
        compiled = compiled_step(module, entry if entry is not None else module, args, kwargs)
        tracer = self.tracer(module, names)
        self.armed = Armed(tracer, module, leading_size(args, kwargs), compiled=compiled)
        tracer.__enter__()

    def reached(self, optimizer: Any) -> None:
        """Step N's check: the traced window ends here, before the update."""
        self.close()
        self.localized = optimizer

    def skipped_try_was_bad(self) -> bool:
        """A GradScaler skipped step N's update: this try is the bad one if its loss is, or if
        it is the try whose skip collapsed the scale; otherwise the window starts again at the
        next forward."""
        armed = self.armed
        self.close()
        self.tries += 1
        if armed is not None and self.skips and self.tries >= self.skips:
            return True
        if armed is not None and any(not bool(torch.isfinite(s.detach()).all())
                                     for s in armed.sinks):
            return True
        self.armed = None
        return False

    def close(self) -> None:
        if self.armed is not None and not self.armed.closed:
            self.armed.closed = True
            self.armed.tracer.__exit__(None, None, None)
