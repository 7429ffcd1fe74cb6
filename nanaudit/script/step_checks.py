"""The step checks of `nanaudit run`'s auditor (script/auditor.py hears the hooks and acts on
what these decide): at each optimizer step ONE host read of the step's values (readout.py: its
inputs' finiteness, the weights as the previous update left them, the window's losses, the
gradients' norm, the floating buffers' peaks) and the trip it makes, named by the one rule every
checker uses (run/check/verdict.py; under torchrun from every rank's flags); and, after the
script, the losses no check read and the weights the last updates left, or, when it raised, the
non-finite value behind its exception (`raised`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nanaudit.config.schema import AmpOptions
from nanaudit.report.model import TimelineEntry
from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.check.decision import StepDecision
from nanaudit.run.check.scaler import ScalerWatch
from nanaudit.run.check.scope import BufferScope
from nanaudit.run.checks import confirm_nonfinite, exact_norm
from nanaudit.run.deepspeed_zero import loss_scale_of
from nanaudit.run.distributed import is_collective_failure
from nanaudit.run.rank_checks import RankChecks
from nanaudit.script.held_modules import innermost_frame
from nanaudit.script.ledger import Ledger
from nanaudit.script.readout import (
    OptimizerScopes,
    StepInbox,
    StepRead,
    WeightsScope,
    read_step,
)
from nanaudit.script.rerun_window import RerunWindow
from nanaudit.script.step_log import StepLog
from nanaudit.script.step_values import same_value
from nanaudit.script.trip import ScriptTrip, nonfinite_locals
from nanaudit.script.trip_namer import TripNamer


class StepChecks:
    """What one script run's checks read and found (the timeline, the trip); the auditor
    subclasses it with the hooks' event handlers."""

    def __init__(self, rerun_step: int | None = None, rank: int | None = None,
                 expected_losses: dict[int, float | None] | None = None, tracer: Any = None,
                 rerun_evaluation: int = 0, rerun_skips: int = 0):
        self.step = 0                    # optimizer steps completed
        self.log = StepLog()             # the timeline, and the early warnings read off it
        self.timeline = self.log.timeline
        self.trip: ScriptTrip | None = None
        self.rank = rank
        self._reads = 0                  # the checks' host reads (the namer counts its own)
        self.device = ""
        # A GradScaler's skipped tries (not steps), and when they collapse: the check core's
        # rule, as scan's and Sentinel's, at their defaults (a script has no amp: options).
        amp = AmpOptions()
        self.scaler_watch = ScalerWatch(amp.scale_floor, amp.max_skipped, options="")
        self.buffers = BufferScope()     # the floating buffers of the modules it called
        # The re-run's traced window (the tracer class handed in: the cheap path never imports
        # the expensive one) and the first run's losses, to stop a re-run that left it.
        self.window = RerunWindow(rerun_step, rerun_evaluation, tracer, rerun_skips)
        self.expected_losses = expected_losses      # the first run's, by step
        self._inbox = StepInbox()
        self._evaluation = 0             # closure calls checked in the current step
        self._scopes = OptimizerScopes()         # each optimizer's tensors, as read
        self._let_go_trip: ScriptTrip | None = None    # what an optimizer let go last left
        self.ledger = Ledger(forgotten=[self._scopes.forget, self.log.forget],
                             last_look=self._last_look)
        self.namer = TripNamer(self.ledger, rank)
        self.ranks: RankChecks | None = None     # torchrun: the script's process group
        # An error trip: the non-finite tensors the script's frames held (error_replay.py).
        self.error_values: list[torch.Tensor] = []
        self.joins_late = False     # a process the script started: its rank is its group's

    def _decide(self, optimizer: Any, evaluation: int) -> StepDecision:
        """One host read (readout.py): the inputs' finiteness, the parameter norm, the window's
        loss, the gradient norm and the buffers' peaks, and what it decides. A closure's later
        evaluations in the same step add no timeline entry. Under DeepSpeed fp16's dynamic loss
        scale, gradients alone non-finite are its calibration, no trip (zero_steps.py)."""
        self.ledger.stepped[id(optimizer)] = optimizer     # may let others go (_last_look)
        if self._let_go_trip is not None:
            self.trip, self._let_go_trip = self._let_go_trip, None
            return StepDecision.STOP
        window = self.window
        if window.step is not None:            # a re-run (the first run asks nothing here)
            if window.arms_at(self.step, self._evaluation):
                window.reached(optimizer)
                return StepDecision.STOP
            if window.unchecked(self.step):
                self._inbox = StepInbox()          # nothing of such a step is compared
                return StepDecision.APPLY
        scope = self._scopes.of(optimizer)
        if scope is None:
            return StepDecision.APPLY
        self.device = scope.device_name
        grads = scope.grads()
        inbox, self._inbox = self._inbox, StepInbox()
        # Under torchrun every rank's flags (its buffers' among them) join the read.
        buffers = self.buffers.tensors() if self.buffers else None
        read = read_step(inbox, scope, grads,
                         self.ranks.table if self.ranks is not None else None, buffers)
        if not read.buffers_ok and not confirm_nonfinite(buffers or []):
            read = dataclasses.replace(read, buffers_ok=True)   # an L2 norm overflowed
        self._reads += 1
        loss, norm, grad_norm = read.loss, read.norm, read.grad_norm
        assert norm is not None and grad_norm is not None
        norm, grad_norm = _confirmed(norm, grad_norm, scope, grads)
        scale = loss_scale_of(optimizer)     # DeepSpeed fp16's dynamic scale, else None
        entry = self._entry(optimizer, loss, _shown_norm(read, grad_norm, scale), norm,
                            scale=scale or read.scale, checked=grad_norm)
        trip = None
        if self.ranks is not None or not _all_finite(read, norm, grad_norm):
            trip = self.namer.classify(self.step, optimizer, read, (norm, grad_norm),
                                       loss if loss is not None else 0.0, scope.params,
                                       inbox.inputs, self.ranks, self.buffers)
        if trip is not None and scale and trip.check is Check.GRADIENT:
            return StepDecision.APPLY      # fp16 calibration: DeepSpeed skips it (zero_steps.py)
        if evaluation == 0:
            self.log.append(entry)
            if self.expected_losses is not None and self._left_first_run(loss):
                return StepDecision.STOP       # a re-run that already differs: no use going on
        if trip is not None:
            trip.evaluation = evaluation
            if evaluation:
                # The step shows the evaluation that went bad.
                self.log.replace_last(entry)
            self.trip = trip
        return StepDecision.of(trip)

    def _see_ranks(self, module: torch.nn.Module) -> None:
        """The ranks, once the script joined a process group, told of the step's `module`; a
        process the script started (processes.py) then takes its group's rank."""
        self.ranks = RankChecks.saw(self.ranks, module)
        if self.joins_late and self.ranks is not None:
            self.rank = self.namer.rank = self.ranks.rank
            self.joins_late = False

    def _last_look(self, optimizer: Any) -> bool:
        """An optimizer the script let go: the weights its last update left, read once (a
        fold's last update to NaN weights, which the script saved); non-finite, that is the
        trip, and it is kept for its account. Not in a re-run, nor under torchrun (one rank's
        trip alone would leave the others in the step's exchange)."""
        if self.trip or self._let_go_trip or self.window.step is not None or self.ranks:
            return False             # the first one let go with bad weights is the trip
        self._let_go_trip = self.namer.left_by([optimizer], self.step)
        return self._let_go_trip is not None

    def _entry(self, optimizer: Any, loss: float | None, grad_norm: float | None,
               norm: float | None, **fields: Any) -> TimelineEntry:
        return self.log.entry(self.step, optimizer, loss, grad_norm, norm, **fields)

    def early_warnings(self) -> list:
        """The early warnings of the run so far (all of it: call at its end)."""
        return self.log.early_warnings()

    def warnings_so_far(self, step: int) -> list:
        """The early warnings of the steps up to the bad step `step` (mid-run)."""
        return self.log.warnings_so_far(step)

    def _left_first_run(self, loss: float | None) -> bool:
        expected = self.expected_losses
        if expected is None or self.step not in expected:
            return False
        return not same_value(expected[self.step], loss)

    def scaling(self, scaler: Any) -> None:
        """A GradScaler's `step` begins: its loss scale rides with the step's one read."""
        self._inbox.scale = getattr(scaler, "_scale", None)

    def parameter_name(self, p: torch.Tensor) -> str:
        return self.ledger.name(p)

    def finish(self) -> None:
        """After the script returned: a loss that reached backward with no step after it (a
        script that skips its update or exits on seeing a NaN loss), then the parameters the
        last updates left (one read each)."""
        self._unstepped_losses()
        if self.trip is None:
            self.trip = self.namer.last_updates(self.step)

    def raised(self, exc: BaseException, in_backward: bool) -> ScriptTrip | None:
        """The script raised: was a non-finite value behind it? First the parameters the last
        updates left (an update to NaN a later op refused), the step's unread inputs, then the
        tensors in the exception's frames (BCELoss refusing a NaN input, `if loss.isnan():
        raise`), never a collective's a dead peer failed (unfilled buffers). Once: a read per
        tensor is fine."""
        if self.trip is not None or self.window.armed is not None:
            return self.trip
        self.ledger.learn_held(innermost_frame(exc))
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.trip = self.namer.last_updates(self.step)
        if self.trip is None and self.ranks is None:
            self._bad_inputs()          # a batch already bad: the model only passed it on
        if self.trip is not None:
            self.trip.error = f"{type(exc).__name__}: {first}"
            return self.trip
        bad = [] if is_collective_failure(exc) else nonfinite_locals(exc, held=self.error_values)
        if not bad:
            return None
        self.trip = self.namer.trip(
            self.step, Check.ERROR, bad[0][1], [name for name, _ in bad],
            error=f"{type(exc).__name__}: {first}",
            where=Where.BACKWARD if in_backward else Where.FORWARD)
        return self.trip

    def _unstepped_losses(self) -> None:
        """The losses and inputs no check read: non-finite, they are this step's finding (a
        loss nanaudit saw non-finite is never part of a clean run)."""
        inbox, self._inbox = self._inbox, StepInbox()
        if not inbox.losses or self.window.armed is not None:
            return
        if (read := self._bad_losses(inbox)) is None:
            return
        self._log_unread(read)
        self.trip = self.namer.unread_trip(self.step, inbox.inputs, read)

    def _bad_losses(self, inbox: StepInbox) -> StepRead | None:
        """One host read of the losses and inputs no optimizer check read; None: all finite."""
        read = read_step(inbox)
        self._reads += 1
        if read.inputs_ok and (read.loss is None or math.isfinite(read.loss)):
            return None
        return read

    def _bad_inputs(self) -> ScriptTrip | None:
        """The step's model inputs, unread when the script raised (no check came): non-finite,
        the batch is the finding, as at a check: the model only passed on what it was given
        (an `inf` in the batch made a NaN gradient that `clip_grad_norm_(...,
        error_if_nonfinite=True)` refused). One host read, after an error only. Not under
        torchrun, whose error trips replay on the raising rank alone (error_ranks.py)."""
        inbox = self._inbox
        if not inbox.input_peaks:
            return None
        read = self._bad_losses(inbox)
        if read is None or read.inputs_ok:
            return None
        self._inbox = StepInbox()
        self._log_unread(read)
        loss = read.loss if read.loss is not None else 0.0
        self.trip = self.namer.input_trip(self.step, inbox.inputs, loss, None)
        return self.trip

    def _log_unread(self, read: StepRead) -> None:
        """The timeline's entry of a read outside an optimizer check (the last optimizer's)."""
        last = next(reversed(self.ledger.stepped.values()), self.ledger.manual)
        self.log.append(self._entry(last, read.loss, None, None))

    @property
    def host_reads(self) -> int:
        """The run's host reads: one a check, and the namer's of the weights updates left."""
        return self._reads + self.namer.reads

    @property
    def optimizer_count(self) -> int:   # the optimizers it stepped (its own update is one)
        return len(self.ledger.stepped)

    @property
    def skipped(self) -> int:       # the tries a GradScaler skipped (not steps)
        return self.scaler_watch.skipped


def _all_finite(read: StepRead, norm: float, grad_norm: float) -> bool:
    """Every value of the step's read finite: no check can trip (without ranks)."""
    return (read.inputs_ok and read.buffers_ok and math.isfinite(norm)
            and math.isfinite(grad_norm) and (read.loss is None or math.isfinite(read.loss)))


def _confirmed(norm: float, grad_norm: float, scope: WeightsScope,
               grads: list[torch.Tensor]) -> tuple[float, float]:
    """The weights' and gradients' norms, each non-finite one confirmed element-wise (a
    float32 sum of squares may overflow where every value is finite: then the exact norm)."""
    if not math.isfinite(grad_norm) and not confirm_nonfinite(scope.local(grads)):
        grad_norm = exact_norm(scope.local(grads))
    if not math.isfinite(norm) and not confirm_nonfinite(scope.local(scope.params)):
        norm = exact_norm(scope.local(scope.params))
    return norm, grad_norm


def _shown_norm(read: StepRead, grad_norm: float, scale: float | None) -> float:
    """The timeline's gradient norm: the total norm the script's `clip_grad_norm_` returned
    (before clipping: what its log prints, as the Trainer's and llm.c's do), else the norm of
    the gradients the check read (DeepSpeed fp16's unscaled)."""
    if read.clip_norm is not None:
        return read.clip_norm
    return grad_norm / scale if scale else grad_norm
