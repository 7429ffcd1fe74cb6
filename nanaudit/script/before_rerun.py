"""The re-run's window for a loss (or gradient) trip whose value the in-process replay saw enter
the step already non-finite from the script's own code before the step's first model call
(before_window.py): a distillation target a frozen teacher made under `no_grad`, a weight an
EMA changed in place between steps.

The script's own code is traced as an input trip's is (data_window.py): from its start, and from
each update (or backward) to the next model call, the finite records of earlier stretches
forgotten. At step N's first model call that tracer stops and the model window is armed as an
ordinary re-run's (rerun_window.py): two tracers are never active at once. At step N's check
the walk back from the loss runs as usual; when it ends at a value that entered the model's
trace from outside, the walk goes on in the data code's trace from that value, and the finding
names the op there, its line and its cause (localize/producer.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nanaudit.localize.producer import (
    Arrival,
    attach_arrival,
    attach_made,
    origin_of,
)
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.model import Finding
from nanaudit.report.vocabulary import Where
from nanaudit.script.before_window import carriers
from nanaudit.script.data_window import DataWindow
from nanaudit.script.rerun_window import Armed, RerunWindow


class BeforeWindow(DataWindow):
    """Traces the script's own code as an input trip's window does up to step N's first model
    call, then arms step N's window as an ordinary re-run does."""

    def __init__(self, step: int, evaluation: int, tracer: Any, skips: int = 0):
        super().__init__(step, tracer)
        self.evaluation, self.skips = evaluation, skips

    def enter_data_code(self, step: int) -> None:
        if self.armed is None:          # inside step N's window the model tracer is on
            super().enter_data_code(step)

    def heard_loss(self, loss: torch.Tensor, step: int) -> None:
        """A loss reached `backward` in step `step` with nothing armed: at step N no module
        made it, so the stretch of the script's own code being traced is the step's window
        (its backward traced as a backward), with that loss to walk back from."""
        if step != self.step or self.armed is not None or self._on is None \
                or not self._traces(step):
            return
        self.armed = Armed(self.data_tracer, torch.nn.Module(), None, sinks=[loss], closed=True)

    def arms_at(self, step: int, evaluation: int) -> bool:
        return RerunWindow.arms_at(self, step, evaluation)

    def arm(self, module: torch.nn.Module, args: tuple, kwargs: dict, entry: Any = None,
            names: dict[int, str] | None = None) -> None:
        self.leave_data_code()          # never two tracers at once
        RerunWindow.arm(self, module, args, kwargs, entry, names)

    def made_before(self, model_tracer: Any, loc: Localization, finding: Finding) -> None:
        """Name in `finding` what made the value `loc`'s walk found entering the model's trace
        from outside, from the data code's trace; a walk that ended inside the model's trace
        keeps its finding."""
        found = carriers(model_tracer, loc)
        traced = [t for t in found if self.data_tracer.trace.producer_of(t) is not None]
        if not traced:
            if found:
                finding.explain(f"no op of {self.traced()} computed it either")
            return
        carrier = traced[0]
        origin = origin_of(self.data_tracer, carrier)
        passed = loc.event
        at = (f" at {os.path.basename(passed.source.file)}:{passed.source.line}"
              if passed is not None and passed.source is not None else "")
        op = str(passed.op).split(".")[1] if passed is not None else "an op"
        made = origin.made or self._written(origin.arrival, carrier)
        how = ("made in", " (not in the model, not outside torch)") if made is not None else \
            ("handed to the model by", "")
        finding.explanation = ""
        finding.explain(f"the value was {how[0]} the script's own code before step {self.step}'s "
                        f"first model call{how[1]}, and {op}{at} received it already non-finite")
        if made is not None:
            attach_made(finding, made, self.traced())
        else:
            assert origin.arrival is not None
            attach_arrival(finding, origin.arrival, self.traced())

    def _written(self, arrival: Arrival | None, carrier: torch.Tensor) -> Localization | None:
        """A Python infinity a traced op of the script's own code took (`pe.mul_(inf)`): that
        op made the tensor non-finite, and the walk names it (an input finding says instead
        that the value entered torch there)."""
        if arrival is None or not arrival.number or arrival.event is None:
            return None
        loc = walk_from_sink(self.data_tracer.trace, carrier, Where.FORWARD, [], None)
        return loc if loc.reproduced and loc.event is not None else None
