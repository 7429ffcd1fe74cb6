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
import threading
from typing import Any

import torch

from nanaudit.localize.producer import (
    Arrival,
    attach_arrival,
    attach_made,
    forget_finite,
    origin_of,
)
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.model import Finding
from nanaudit.report.vocabulary import Where
from nanaudit.script.before_window import carriers
from nanaudit.script.rerun_window import RerunWindow


class BeforeWindow(RerunWindow):
    """Traces the script's own code up to step N's first model call, then step N's window."""

    def __init__(self, step: int, evaluation: int, tracer: Any, skips: int = 0):
        super().__init__(step, evaluation, tracer, skips)
        self.data_tracer = tracer(torch.nn.Module())    # no model here: modules named by type
        self._on: int | None = None     # the thread whose mode stack holds the data tracer
        self._since = 0                  # the first forward record of the open stretch
        self._stretch = 0                # the step whose code is traced now

    def start(self) -> None:
        """The script starts: its set-up is the script's own code too."""
        self.enter_data_code(0)

    def enter_data_code(self, step: int) -> None:
        if self._on is not None or self.armed is not None or self.localized is not None \
                or self.step is None or step > self.step:
            return
        self._since, self._stretch = len(self.data_tracer.trace.forward_records), step
        self.data_tracer.__enter__()
        self._on = threading.get_ident()

    def leave_data_code(self) -> None:
        # A mode is pushed on one thread's stack: a script that trains in a thread it started
        # leaves the set-up's stretch from there, and the tracer stays pushed on the main
        # thread (which waits, tracing nothing) until the window closes there.
        if self._on != threading.get_ident():
            return
        self._on = None
        self.data_tracer.__exit__(None, None, None)
        # The model call that ends the stretch was pushed before the window saw it.
        self.data_tracer.modules.stack.clear()
        if self.step is not None and self._stretch < self.step:
            forget_finite(self.data_tracer.trace, self._since)

    def arm(self, module: torch.nn.Module, args: tuple, kwargs: dict, entry: Any = None) -> None:
        self.leave_data_code()          # never two tracers at once
        super().arm(module, args, kwargs, entry)

    def close(self) -> None:
        self.leave_data_code()
        super().close()

    def traced(self) -> str:
        return (f"the script's own code from its start to step {self.step}'s first model call "
                f"(outside its models' forward and backward passes and its optimizer steps)")

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
