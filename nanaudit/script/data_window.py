"""The re-run's window for an input trip of `nanaudit run`: the batch was already non-finite
when the model was first called at step N, so the op that made it ran in the script's own data
code (its loop body, a collate_fn, a Dataset's __getitem__ and transforms in this process).

The op tracer is armed over that code: from the script's start to its first model call (the
set-up: a data set loaded and transformed before training), then from each update (or backward)
to the next model call, up to step N's. Models' forwards and backwards and the optimizers'
updates run untraced, as in the first run; DataLoaders are watched (localize/loader_tap.py),
so that a batch a worker process made can be made again here. At step N's first model call
with a non-finite data input the re-run stops, and the walk back from that input names the op
that made it, or says it was already non-finite when it reached torch (localize/producer.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.loader_tap import LoaderTap
from nanaudit.localize.producer import DataCode, forget_finite, name_producer
from nanaudit.report.vocabulary import Check
from nanaudit.run.intercept import StepHalted
from nanaudit.script.findings import first_run_finding
from nanaudit.script.model_skip import ModelSkip
from nanaudit.script.protocol import RerunResult
from nanaudit.script.rerun_window import Armed, RerunWindow
from nanaudit.script.step_values import data_inputs, leading_size
from nanaudit.script.trip import ScriptTrip, input_fields


class DataWindow(RerunWindow):
    """Where the re-run of an input trip traces the script's data code (see the module
    docstring); `inputs` are step N's non-finite data inputs once reached."""

    def __init__(self, step: int, tracer: Any, trace_from: int = 0):
        super().__init__(step, 0, tracer)
        # The data code of steps 1 to trace_from - 1 runs untraced (the cheap re-run's first
        # try: an op found there names the producer; a gap sends it to a traced re-run).
        self.trace_from = trace_from
        self.data_tracer = tracer(torch.nn.Module())    # no model yet: modules named by type
        self.tap = LoaderTap()
        self.inputs: list | None = None
        self.calls = 0                   # step N's micro-batches reached, the bad one last
        self.loader_batches: list = []
        self._tapped = False
        self._on: int | None = None     # the thread in the script's own code (its mode stack)
        self._since = 0                  # the first forward record of the open stretch
        self._stretch = 0                # the step whose data code is traced now
        # The cheap re-run (model_skip.py): told of each stretch, to see the data's RNG draws.
        self.skip: ModelSkip | None = None

    def start(self) -> None:
        """The script starts: its set-up is data code too."""
        self.tap.__enter__()
        self._tapped = True
        self.enter_data_code(0)

    def enter_data_code(self, step: int) -> None:
        if self._on is not None or self.localized is not None or self.step is None \
                or step > self.step:
            return
        self.tap.batches.clear()
        self._since, self._stretch = len(self.data_tracer.trace.forward_records), step
        if self.skip is not None:
            self.skip.stretch_started()
        if self._traces(step):
            self.data_tracer.__enter__()
        self._on = threading.get_ident()

    def _traces(self, step: int) -> bool:
        return step == 0 or step >= self.trace_from

    def leave_data_code(self) -> None:
        # A mode is pushed on one thread's stack: a script that trains in a thread it started
        # leaves the set-up's stretch from there, and the tracer stays pushed on the main
        # thread (which waits, tracing nothing) until the window closes there.
        if self._on != threading.get_ident():
            return
        self._on = None
        if self._traces(self._stretch):
            self.data_tracer.__exit__(None, None, None)
            # The model call that ends the stretch was pushed before the window saw it; its
            # pop comes after the tracer stopped listening.
            self.data_tracer.modules.stack.clear()
            if self.step is not None and self._stretch < self.step:
                forget_finite(self.data_tracer.trace, self._since)
        if self.skip is not None and not self.skip.stretch_ended():
            raise StepHalted()       # the data drew from a stream the model's skip shifted

    def unchecked(self, step: int) -> bool:
        """Without the model (model_skip.py) the steps before N are not the first run's: their
        checks would compare nothing (step N's batch is compared by its fingerprint)."""
        return self.skip is not None and self.step is not None and step < self.step

    def arms_at(self, step: int, evaluation: int) -> bool:
        return self.step is not None and step == self.step and self.localized is None

    def arm(self, module: torch.nn.Module, args: tuple, kwargs: dict, entry: Any = None,
            names: dict[int, str] | None = None) -> None:
        """Step N's first model call (of each micro-batch): stop at the one whose data is bad
        (`entry`, the compiled wrapper the script called, and `names` play no part: no model
        op is traced here)."""
        inputs = data_inputs(args, kwargs)
        self.calls += 1
        if all(bool(torch.isfinite(t).all()) for _, t in inputs):
            return                     # a micro-batch before the bad one: go on
        self.inputs, self.loader_batches = inputs, list(self.tap.batches)
        self.localized = module
        self.armed = Armed(self.data_tracer, module, leading_size(args, kwargs), closed=True)
        raise StepHalted()

    def close(self) -> None:
        self.skip = None                 # the run is over: nothing left to abandon
        self.leave_data_code()
        if self._tapped:
            self._tapped = False
            self.tap.__exit__(None, None, None)
        super().close()

    def traced(self) -> str:
        span = (f"from its start to its first model call and from step {self.trace_from}'s "
                f"data on" if self.trace_from > 1 else "from its start")
        call = (f"step {self.step}'s model call of micro-batch {self.calls - 1}"
                if self.calls > 1 else f"step {self.step}'s first model call")
        return (f"the script's own code {span} to {call} "
                f"(outside its models' forward and backward passes and its optimizer steps)")

    def localize(self, result: RerunResult) -> None:
        """The re-run's finding: the first run's input finding, with what made the value."""
        if self.inputs is None or self.step is None:
            return
        fields = input_fields(self.inputs)
        # a later micro-batch's (the first's is named by the first run, which saw the window)
        fields["micro_batch"] = self.calls - 1 or None
        result.fingerprint = fields["fingerprint"]
        finding = first_run_finding(ScriptTrip(step=self.step, check=Check.INPUT, **fields))
        result.ops_traced = self.data_tracer.trace.ops_seen
        leaf = dict(self.inputs)[fields["tensors"][0]]
        code = DataCode(self.traced(), self.loader_batches,
                        lambda: self.tracer(torch.nn.Module()))
        name_producer(finding, self.data_tracer, leaf, code)
        result.finding = finding


def same_inputs(trip: ScriptTrip, result: RerunResult) -> str | None:
    """For an input trip: None when the re-run's non-finite inputs at the trip's step are the
    first run's (the same tensors, the same rows); else what differed."""
    if trip.check != Check.INPUT or not result.reached:
        return None
    found = result.finding
    if found is None:
        return f"the re-run's data inputs of step {trip.step} were finite"
    if found.tensors != trip.tensors or (found.samples or None) != (trip.rows or None):
        return (f"the re-run's non-finite inputs of step {trip.step} were {found.tensors} in "
                f"rows {found.samples}, the first run's {trip.tensors} in rows {trip.rows}")
    return None


def unusable(trip: ScriptTrip, result: RerunResult | None) -> str | None:
    """Why the re-run of an input trip without the model (model_skip.py) cannot name its
    producer; None when it can: it reached step N with the first run's bad batch, bit for bit
    (so the data code made the same batch without the model)."""
    if result is None or result.error is not None:
        message = result.error.message if result is not None and result.error else \
            "it wrote no result"
        return f"the re-run without the model failed: {message}"
    if result.abandoned is not None:
        return result.abandoned
    if result.trip is not None:
        return (f"on the model's stand-in a check tripped at step {result.trip.step}, before "
                f"the bad step")
    if not result.reached or result.finding is None:
        return (f"without the model the data code gave no non-finite batch at step "
                f"{trip.step}: it depends on the model (its outputs, losses or weights)")
    if trip.fingerprint is None or result.fingerprint != trip.fingerprint:
        return (f"without the model the data code gave another batch at step {trip.step} than "
                f"the first run: it depends on the model (its outputs, losses or weights)")
    return None


@dataclass(frozen=True)
class ModelRun:
    """Whether the re-run of an input trip computed the model before the bad step: `skipped`
    (the model's calls stood in for, `computed` the first of each form), or computed after a
    try without it that could not be used (`note` says why; it took `tried_s`)."""

    skipped: bool = False
    stood_in: int | None = None
    computed: int | None = None
    note: str | None = None
    tried_s: float | None = None

    def fields(self) -> dict[str, Any]:
        """The report's Rerun fields (none for a re-run that never tried without it)."""
        if not self.skipped and self.note is None:
            return {}
        return {"model_skipped": self.skipped, "stood_in": self.stood_in,
                "model_note": self.note, "model_try_s": self.tried_s}

    def said(self, steps: int, took: float) -> str | None:
        """The finding's clause on what the re-run cost and how it ran."""
        if self.skipped:
            return (f"named by a re-run of {steps} step(s) in {took:.1f} s that did not compute "
                    f"the model before the bad step ({self.stood_in} call(s) stood in for, "
                    f"{self.computed} computed): the data code does not depend on it")
        if self.note is not None:
            return (f"named by a re-run of {steps} step(s) that computed the model ({took:.1f} s, "
                    f"{self.tried_s or 0.0:.1f} s of them a first try without it): {self.note}")
        return None
