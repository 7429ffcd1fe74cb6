"""The first run's step record of `nanaudit run`: its timeline entries (the time since the last
check, read once a step) and the early warnings read off each entry once it is final (the next
step began): the bounded timeline does not keep every step to read them off at the end."""

from __future__ import annotations

import math
import time
from typing import Any

from nanaudit.report.model import BadStepEntry, TimelineEntry
from nanaudit.run.timeline import Timeline
from nanaudit.run.watch import TimelineWarnings, clip_overflow_warning, zero_skip_warning


def _lr(optimizer: Any) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class StepLog:
    """The timeline of the steps checked so far and the warnings read off it."""

    def __init__(self) -> None:
        self.timeline = Timeline()   # bounded: a run's first and last steps, summarized between
        self._warnings = TimelineWarnings()
        self._unwatched: TimelineEntry | None = None
        self._last_check = time.perf_counter()
        # id(optimizer) -> its weights' norm at its first check, before any update of its own:
        # no weight's |value| was larger then (weight_growth.py weighs an overflow against it)
        self.first_norms: dict[int, float] = {}

    def forget(self, key: int) -> None:
        """The optimizer `key` named was let go: the next one at its id has its own history."""
        self.first_norms.pop(key, None)

    def entry(self, step: int, optimizer: Any, loss: float | None, grad_norm: float | None,
              norm: float | None, checked: float | None = None, **fields: Any) -> TimelineEntry:
        """The step's entry; `grad_norm` as shown (the total `clip_grad_norm_` returned, if the
        script clipped), `checked` the norm of the gradients the check read."""
        now = time.perf_counter()      # one clock read a step: the time since the last check
        took, self._last_check = now - self._last_check, now
        if norm is not None:
            self.first_norms.setdefault(id(optimizer), norm)
        if _finite(checked) and grad_norm is not None and not math.isfinite(grad_norm):
            self._warnings.once("clip", clip_overflow_warning(step))    # the clip's total
        return TimelineEntry(step=step, loss=loss, grad_norm=grad_norm, param_norm=norm,
                             lr=_lr(optimizer), time_ms=round(took * 1000, 3), **fields)

    def append(self, entry: TimelineEntry) -> None:
        if self._unwatched is not None:
            self._warnings.observe(self._unwatched)     # final now: the next step began
        self._unwatched = entry
        self.timeline.append(entry)

    def update_dropped(self) -> None:
        """DeepSpeed skipped the update of the step last checked: when its values were finite
        (its own overflow check overflowed on them), its entry says skipped, with a warning."""
        entry = self._unwatched
        if entry is None or isinstance(entry, BadStepEntry) or entry.loss is None \
                or not (_finite(entry.loss) and _finite(entry.grad_norm)):
            return
        entry.skipped = True
        assert entry.grad_norm is not None
        self._warnings.once("zero-skip", zero_skip_warning(entry.step, entry.grad_norm))

    def replace_last(self, entry: TimelineEntry) -> None:
        """The step shows a later evaluation of its closure (the one that went bad)."""
        self.timeline.replace_last(entry)
        self._unwatched = entry

    def clear(self) -> None:
        """Steps numbered afresh: those logged were not an optimizer's training steps."""
        self.timeline.clear()
        self._warnings, self._unwatched = TimelineWarnings(), None

    def warnings_so_far(self, step: int) -> list:
        """The warnings read off the steps up to `step`, the bad step a run that keeps going
        has just met: its entry is final too (the trip ends its evaluations), and it holds what
        the step before it did (the update ratio of that step's update is read off it)."""
        if self._unwatched is not None and self._unwatched.step <= step:
            self._warnings.observe(self._unwatched)
            self._unwatched = None
        return list(self._warnings.warnings)

    def early_warnings(self) -> list:
        """The early warnings of the run so far (all of it: call at its end)."""
        if self._unwatched is not None:
            self._warnings.observe(self._unwatched)
            self._unwatched = None
        return self._warnings.warnings
