"""The early-warning detectors of one step-loop run, riding on the step's one readout.

The watches (watch.py) sample values on the device; rather than read them on their own (a sync
each), the loop appends them to the step's readout. What was appended, and in which order, is
recorded at the step (`ReadoutExtras`) because the deferred read reads it one step later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.run.watch import (
    MAX_WARNINGS,
    ActivationWatch,
    GrowthWatch,
    UpdateWatch,
    clip_overflow_warning,
)


@dataclass
class ReadoutExtras:
    """Which early-warning values a readout carries after its fixed part, in order."""

    update_step: int | None = None
    update_base: float | None = None    # None: the base norm rides in the readout too
    labels: list | None = None          # the activation watch's labels (None: not sampled)


_NO_EXTRAS = ReadoutExtras()            # shared, never written: a step with nothing sampled


class WatchReadout:
    """The early-warning detectors of one run, and where their readout values go."""

    def __init__(self, session: Any, params: list[torch.Tensor], updating: bool) -> None:
        options = session.options.watch
        every = options.activation_every(session.precision.name)
        self.activations = ActivationWatch(session.local_model, every, options.near_overflow)
        update_every = options.update_every if (updating and options.update_ratio) else 0
        self.updates = UpdateWatch(params, update_every, session.device)
        self.growth = GrowthWatch(options)
        self.warnings: list = []
        self._clip_told = False

    def extra_readout(self) -> tuple[list[torch.Tensor], ReadoutExtras]:
        """The values this step adds to the readout ([update norm (, its base)], [activation
        maxima]) and what they are, for `observe` (which may run a step later)."""
        if self.updates.pending_norm is None and not self.activations.maxima:
            self.activations.active = False
            return [], _NO_EXTRAS           # most steps: nothing sampled
        step, norm, base = self.updates.take()
        act = self.activations.pending()
        extras, parts = ReadoutExtras(), []
        if norm is not None:
            extras.update_step = step
            parts.append(norm.reshape(1))
            if isinstance(base, torch.Tensor):       # deferred read: the base is on the device
                parts.append(base.reshape(1))
            else:
                extras.update_base = base
        if act is not None:
            extras.labels = list(self.activations.labels)
            parts.append(act.to(torch.float64))
        return parts, extras

    def observe(self, step: int, extra: list[float], timeline: Sequence, loss: Any, gnorm: Any,
                extras: ReadoutExtras) -> dict:
        """Turn the readout's extra values into timeline fields and warnings."""
        fields: dict = {}
        if extras.update_step is not None:
            value = extra.pop(0)
            base = extras.update_base if extras.update_base is not None else extra.pop(0)
            ratio = value / max(base, 1e-30)
            if extras.update_step == step:
                fields["update_ratio"] = ratio
            else:
                self._set_update_ratio(timeline, extras.update_step, ratio)
            self._add(self.growth.observe_update(extras.update_step, ratio))
        if extras.labels is not None:
            self.activations.labels = extras.labels
            act_max, act_ratio, found = self.activations.observe(step, extra)
            fields.update(act_max=act_max, act_ratio=act_ratio)
            self._add(found)
        self._add(self.growth.observe(step, loss, gnorm))
        return fields

    def finish(self, timeline: Sequence) -> None:
        """Read the last sampled update norm (at the end of the run, with the final check)."""
        step, norm, base = self.updates.take()
        if step is not None and norm is not None:
            ratio = float(norm) / max(float(base), 1e-30)
            self._set_update_ratio(timeline, step, ratio)
            self._add(self.growth.observe_update(step, ratio))

    @staticmethod
    def _set_update_ratio(timeline: Sequence, step: int, ratio: float) -> None:
        for entry in reversed(timeline[-2:]):
            if entry.step == step:
                entry.update_ratio = ratio

    def clip_overflowed(self, step: int) -> None:
        """`grad_clip` scaled finite gradients by max_norm / inf = 0 (their float32 norm
        overflowed), as `clip_grad_norm_` does: the update learned nothing. Told once a run."""
        if not self._clip_told:
            self._clip_told = True
            self._add([clip_overflow_warning(step, "`grad_clip`'s `clip_grad_norm_`")])

    def _add(self, found: list) -> None:
        if not found:
            return
        room = MAX_WARNINGS - len(self.warnings)
        self.warnings.extend(found[:max(room, 0)])

    def close(self) -> None:
        self.activations.close()
