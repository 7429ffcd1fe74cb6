"""The checks of `nanaudit run`: at each optimizer step of an unmodified script, ONE host read
of the step's values (its inputs' finiteness, the weights as the previous update left them, the
step's loss and its gradients' norm), classified as the step loop classifies a step; a
non-finite value raises StepHalted before the optimizer applies the update, which unwinds the
script up to the runner. Under --keep-going (`keep`, keep_going.py) the check core may decide
SKIP instead: the step is localized and recorded there, its buffers put back, its update held
back (held_update.py), and the script goes on. The read and the trip are step_checks.py's; this
class hears the hooks and acts on them.

A closure's later evaluations in a step (LBFGS evaluates it up to `max_iter` times) are checked
too: the step's timeline entry is its first evaluation, and any evaluation may trip, named with
its index. A step the GradScaler skips (inf gradients) is a step, marked skipped, and no finding,
as `scan`'s loop, the Trainer's `global_step` and DeepSpeed's `global_steps` count it (so the
steps named are the script's own loop's): its losses and inputs are checked (a NaN loss is still
a finding). So is a step DeepSpeed skips under fp16's dynamic loss scale
(script/zero_steps.py); either is a finding when the scale collapses. A script that builds no
optimizer updates its weights by hand (`p.data.add_(p.grad, alpha=-lr)`): each backward is then
its step, checked when backward returns, before the script's own update.

On a re-run (`rerun_step=N`) the tracer is armed from the outermost module call after step
N-1's update to step N's check (rerun_window.py); for an input trip, over the script's own code
between its model calls instead (data_window.py), which the window is told of. Under torchrun,
once the script joined a process group, each rank reads its own shards (FSDP2) and every rank's
flags join the read, so the ranks stop together and the rank that made the value is named
(run/rank_checks.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.check.decision import StepDecision
from nanaudit.run.check.scaler import backoff_scale
from nanaudit.run.intercept import StepHalted
from nanaudit.run.optimizer_state import creates_state_only
from nanaudit.script.hooks import ScriptHooks
from nanaudit.script.keep_going import KeepGoing
from nanaudit.script.ledger import describe_optimizer
from nanaudit.script.readout import StepInbox, WeightsScope
from nanaudit.script.step_checks import StepChecks
from nanaudit.script.step_values import data_inputs
from nanaudit.script.trip import ScriptTrip


class ScriptAuditor(StepChecks):
    """The checks of one script run (step_checks.py) acted on at the hooks' events; its hooks
    are `hooks` (install() / remove())."""

    def __init__(self, rerun_step: int | None = None, rank: int | None = None,
                 expected_losses: dict[int, float | None] | None = None, tracer: Any = None,
                 rerun_evaluation: int = 0, rerun_skips: int = 0):
        super().__init__(rerun_step, rank, expected_losses, tracer, rerun_evaluation,
                         rerun_skips)
        self.hooks = ScriptHooks(self, record=rerun_step is None)
        self._state_step: int | None = None      # id of an optimizer creating its state
        self.keep: KeepGoing | None = None       # --keep-going: skip bad steps, go on

    def install(self) -> ScriptAuditor:
        self.hooks.install()
        return self

    def remove(self) -> None:
        self.hooks.remove()
        self.window.close()

    # --- what the hooks tell -----------------------------------------------------------------

    def first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The step's outermost call: arm the re-run's window, or take its inputs' finiteness."""
        rerun = self.window.step is not None      # the first run has no window to tell
        if rerun:
            self.window.leave_data_code()
        if self.keep is not None and self.keep.held.active:
            self.keep.held.next_step()     # a skipped step's updates were held back
        self.ledger.called(module)
        self.buffers.add(module)
        if self.rank is not None or self.joins_late:  # torchrun: once it joined a group
            self._see_ranks(module)
        if not self.ledger.stepped and self.ledger.cleared_by_hand():    # until a step
            self._step_by_hand()        # the backward before was a step the script took itself
        if rerun and self.window.armed is None and self.window.arms_at(self.step, self._evaluation):
            # the script's other models named as the in-process replay names them
            self.window.arm(module, args, kwargs, self.hooks.entry,
                            self.ledger.tracer_names(sys._getframe()))
            if self.ranks is not None:
                self.ranks.tracing(True)
        if self.window.armed is not None:
            return
        if inputs := data_inputs(args, kwargs):
            self._inbox.add_inputs(inputs)

    def loss(self, loss: torch.Tensor) -> None:
        if not self.ledger.stepped and self.ledger.cleared_by_hand():
            self._step_by_hand()        # `zero_grad()` after the forward, then backward
        if self.window.armed is None:
            self._inbox.add_loss(loss)
            if self.window.step is not None:       # a re-run (the first run has no window)
                self.window.heard_loss(loss, self.step)
        else:
            self.window.armed.sinks.append(loss)   # no ops of ours inside the traced window

    def clipped(self, total_norm: Any) -> None:
        self.ledger.clips = True          # a divergence's fix says the script clips already
        if self.window.armed is None:
            self._inbox.add_clip(total_norm)

    def backward_started(self) -> None:
        if self.keep is not None and self.keep.held.active:
            # The gradients of another step: without a module call between (a script that
            # calls its layers' `forward` itself) the skipped step's hold ends here.
            self.keep.held.next_step()
        if self.window.armed is not None:
            self.window.armed.tracer.start_backward()

    def backward_ended(self, raised: bool) -> None:
        if self.window.armed is not None:
            self.window.armed.backward_ended()
        self.ledger.backwards += not raised
        if not raised and self.ledger.updates_by_hand:
            self._step_by_hand()
        if self.window.step is not None:
            self.window.enter_data_code(self.step)

    def _step_by_hand(self) -> None:
        """This backward was the script's step: checked before its update, counted as stepped."""
        manual = self.ledger.manual_step()
        self._check(manual, skippable=False)      # no optimizer call to hold back
        self.after_update(manual)

    def update_starting(self) -> None:
        if self.window.step is not None:
            self.window.leave_data_code()
        self._evaluation = 0

    def before_update(self, optimizer: Any, evaluation: int | None) -> None:
        """The check before an update; `evaluation`: the closure's call (None: no closure)."""
        if evaluation is None:
            if creates_state_only(optimizer):
                self._state_step = id(optimizer)     # DCP creating the state: not a step
                return
            self._check(optimizer)
            return
        self._evaluation = evaluation
        self._check(optimizer, evaluation)
        self._evaluation = evaluation + 1

    def after_update(self, optimizer: Any) -> None:
        if self._state_step == id(optimizer):
            self._state_step = None
            return
        if self.ledger.by_hand_anyway and optimizer is not self.ledger.manual:
            self.ledger.by_hand_anyway = False     # it steps after all: those were not steps
            self._number_afresh()
        self.ledger.steps_taken += 1
        # A clean step reads an attribute here, and calls the ledger only (the leave-on price).
        keep = self.keep
        if keep is None or not (keep.held.active and keep.held.release(optimizer)):
            self.scaler_watch.applied()
            self.ledger.updated(optimizer, self.step)
        self.hooks.tap.close()           # a step by hand: the hooks saw no optimizer step
        self._next_step()

    def stepped(self) -> int:
        return self.ledger.steps_taken

    def optimizer_built(self, optimizer: Any) -> None:
        """An optimizer after backward calls already checked as steps: those were not training
        steps of an optimizer (a warm-up, a gradient-based init): number the steps afresh."""
        self.ledger.optimizer_made(optimizer)
        if self.ledger.optimizers_made == 1:
            self._number_afresh()

    def _number_afresh(self) -> None:
        if self.step and self.trip is None and self.window.armed is None:
            self.step = 0
            self.log.clear()
            self.ledger.forget_manual_steps()

    # --- the check ---------------------------------------------------------------------------

    def _check(self, optimizer: Any, evaluation: int = 0, skippable: bool = True) -> None:
        """The step's check, acted on: APPLY lets the script's update run; a trip stops the
        script before the update (StepHalted), or under --keep-going may skip the step: its
        update is held back and the script goes on. A closure's later evaluation comes after
        its optimizer moved the weights: not skippable."""
        if self.keep is not None and self.keep.held.active:
            self.keep.held.hold(optimizer, self.hooks.scaler)   # another optimizer of the step
            return
        if self._decide(optimizer, evaluation) is StepDecision.APPLY:
            return
        if self._skip_or_stop(skippable and evaluation == 0) and self.keep is not None:
            self.keep.held.hold(optimizer, self.hooks.scaler)

    def _skip_or_stop(self, skippable: bool) -> bool:
        """The trip's step skipped (localized, recorded, buffers put back) when keep-going
        decides so, and True when its update is to be held back; otherwise StepHalted. A
        re-run never skips."""
        keep, trip = self.keep, self.trip
        if (keep is None or trip is None or self.window.step is not None
                or keep.decide(trip, skippable) is not StepDecision.SKIP):
            raise StepHalted()
        self.trip = None
        return keep.skip(trip, self.hooks.tap.record)

    def scaler_skipped(self, optimizer: Any, scaler: Any) -> None:
        """The GradScaler skipped this step's update (its gradients held inf or NaN): a step,
        skipped, and not a finding, unless the loss or the inputs were non-finite already (then
        the forward made the value, not the loss scale, and every later step would be skipped
        too). One host read, on skipped steps only; the step's losses and inputs are dropped."""
        self.ledger.stepped[id(optimizer)] = optimizer   # skipped, not an update by hand
        if self.window.armed is not None:
            # The re-run inside step N's window: this try of step N is the bad one if its loss
            # is; a clean skip is traced again from the next forward.
            if self.window.skipped_try_was_bad():
                self.window.reached(optimizer)
                raise StepHalted()
            self.hooks.await_forward()
            return
        inbox, self._inbox = self._inbox, StepInbox()
        read = self._bad_losses(inbox) if inbox else None
        if read is None:            # one read of the scale, on skipped tries only
            scale = float(scaler.get_scale())
            self.scale_skipped(optimizer, scale, backoff_scale(scaler, scale),
                               WeightsScope.params_of(optimizer))
            return
        if self.window.step is not None and self.step == self.window.step:
            self.window.reached(optimizer)     # step N reached, but nothing was armed
            raise StepHalted()
        self.scaler_watch.skip(None, None)
        self.log.append(self._entry(optimizer, read.loss, None, None,
                                 skipped=True, scale=float(scaler.get_scale())))
        trip = self.namer.unread_trip(self.step, inbox.inputs, read)
        trip.skipped = trip.check is not Check.OPTIMIZER   # else the update before it
        trip.optimizer = describe_optimizer(optimizer)
        self.trip = trip
        self._skip_or_stop(skippable=True)      # the scaler already left its update out
        self._next_step()     # a step all the same, as the loop, `global_step` count it

    def _next_step(self) -> None:
        """A step went by, updated or skipped (a re-run numbers them as the first run did)."""
        self.step += 1
        if self.window.step is not None:
            self.window.enter_data_code(self.step)

    def scale_skipped(self, optimizer: Any, scale: float, next_scale: float | None,
                      params: list[torch.Tensor], scaler: str = "the GradScaler") -> None:
        """A skip with finite losses and inputs at loss scale `scale` (a GradScaler's, or
        DeepSpeed fp16's dynamic one: zero_steps.py), which its backoff moves to `next_scale`:
        a step, skipped, and normal, unless the scale collapsed (the check core's rule;
        `params`: whose gradients)."""
        reason = self.scaler_watch.skip(scale, next_scale, scaler)
        self.log.append(self._entry(optimizer, None, None, None, skipped=True, scale=scale))
        if reason is None or self.window.step is not None:
            self._next_step()   # a re-run's armed window decides there (skipped_try_was_bad)
            return
        self.trip = self.namer.collapse_trip(self.step, optimizer, params, reason,
                                             self.scaler_watch.in_row, scaler)
        self._skip_or_stop(skippable=False)     # the scaler skips every step already

    # --- after the script --------------------------------------------------------------------

    def after_error(self, exc: BaseException) -> ScriptTrip | None:
        """The script raised: the non-finite value behind it, if any (step_checks.py)."""
        return self.raised(exc, in_backward=self.hooks.raised_in_backward)
