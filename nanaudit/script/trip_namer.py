"""What a tripped step of `nanaudit run` names: once the verdict says which check tripped, the
tensors behind it (this rank's non-finite shards, by the parameters' user names), the optimizer
and its state, the losses. A read per tensor, after a trip only; the step check itself stays
one read (auditor.py)."""

from __future__ import annotations

import math
import sys
from typing import Any

from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.check.scope import BufferScope
from nanaudit.run.check.verdict import Tripped, tripped_check
from nanaudit.run.checks import confirm_nonfinite, finite_norms, value_kind
from nanaudit.run.mesh import first_element
from nanaudit.run.optimizer_state import nonfinite_state
from nanaudit.run.sharded import local_shards, nonfinite_shards
from nanaudit.script.ledger import Ledger, describe_optimizer
from nanaudit.script.readout import StepRead
from nanaudit.script.trip import ScriptTrip, float_kind, window_input_fields


class TripNamer:
    """Builds the ScriptTrip of a step from the ledger of the script's optimizers."""

    def __init__(self, ledger: Ledger, rank: int | None):
        self.ledger, self.rank = ledger, rank
        self.reads = 0      # host reads of the weights the last updates left (at a trip, the end)

    def trip(self, step: int, check: Check, value: str, tensors: list,
             **fields: Any) -> ScriptTrip:
        self.ledger.learn_held(sys._getframe())   # inside a hook: the script's frames are there
        return ScriptTrip(step=step, check=check, value=value, tensors=tensors,
                          rank=self.rank, optimizers=len(self.ledger.stepped),
                          manual=not self.ledger.optimizers_made or self.ledger.by_hand_anyway,
                          **fields)

    def classify(self, step: int, optimizer: Any, read: StepRead, norms: tuple[float, float],
                 loss: float, params: list, inputs: list, ranks: Any,
                 buffers: BufferScope) -> ScriptTrip | None:
        """The step's trip, by the one rule every checker names what tripped with, from the
        step's read and its (weights', gradients') `norms`; under torchrun (`ranks`) from every
        rank's flags: the same trip on every rank, naming the rank whose own value went bad
        (the details are that rank's)."""
        norm, grad_norm = norms
        updated_at = self.ledger.updated_at.get(id(optimizer))
        if ranks is not None:
            verdict = ranks.verdict(step, read.table, updated_at, norms)
        else:
            verdict = tripped_check(step, inputs_ok=read.inputs_ok,
                                    weights_finite=math.isfinite(norm), updated_at=updated_at,
                                    loss_finite=math.isfinite(loss),
                                    grads_finite=math.isfinite(grad_norm),
                                    buffers_finite=read.buffers_ok)
        if verdict is None:
            return None
        trip = self.from_verdict(step, verdict, optimizer, loss, grad_norm, params, inputs,
                                 buffers)
        if ranks is not None:
            trip.rank = verdict.part
        return trip

    def input_trip(self, step: int, inputs: list, loss: float,
                   grad_norm: float | None) -> ScriptTrip:
        """The trip of a window whose batch was non-finite: `inputs`, each call's."""
        fields = window_input_fields(inputs)
        return self.trip(step, Check.INPUT, fields.pop("value"), fields.pop("tensors"),
                         loss=loss, grad_norm=grad_norm, **fields)

    def unread_trip(self, step: int, inputs: list, read: StepRead) -> ScriptTrip:
        """The trip of a non-finite read outside an optimizer check (the losses after the
        script, a GradScaler's skipped try): the inputs; else the update that left the weights
        non-finite, whose loss this is (no check read the weights since: under a GradScaler
        the next step's NaN loss makes it skip that step); else the loss."""
        loss = read.loss if read.loss is not None else 0.0
        if not read.inputs_ok:
            return self.input_trip(step, inputs, loss, None)
        return self.last_updates(step) or self.trip(step, Check.LOSS, float_kind(loss), [],
                                                    loss=loss)

    def buffer_trip(self, step: int, optimizer: Any, loss: float | None,
                    grad_norm: float | None, buffers: BufferScope) -> ScriptTrip:
        """The step's forward made floating buffers non-finite: which (by their user names)."""
        bad = buffers.nonfinite()
        trip = self.trip(step, Check.PARAMETER, value_kind(bad[0][1]) if bad else "nan",
                         [name for name, _ in bad], loss=loss, grad_norm=grad_norm,
                         where=Where.FORWARD)
        trip.optimizer = describe_optimizer(optimizer)
        return trip

    def collapse_trip(self, step: int, optimizer: Any, params: list, reason: str,
                      skips: int, scaler: str = "the GradScaler") -> ScriptTrip:
        """`scaler`'s loss scale collapsed at this skipped try: the gradients it skipped."""
        with_grad = [p for p in params if p.grad is not None]
        bad = nonfinite_shards([p.grad for p in with_grad], with_grad)
        trip = self.trip(step, Check.GRADIENT, value_kind(bad[0][1]) if bad else "inf",
                         [self.ledger.name(p) for p, _ in bad], collapsed=reason, skips=skips,
                         scaler=scaler)
        trip.optimizer = describe_optimizer(optimizer)
        return trip

    def from_verdict(self, step: int, verdict: Tripped, optimizer: Any, loss: float,
                     grad_norm: float, params: list, inputs: list,
                     buffers: BufferScope) -> ScriptTrip:
        """The trip of a step the verdict tripped, naming what it found non-finite."""
        name = self.ledger.name
        if verdict.check == Check.INPUT:
            return self.input_trip(step, inputs, loss, grad_norm)
        if verdict.in_forward:
            return self.buffer_trip(step, optimizer, loss, grad_norm, buffers)
        if verdict.check in (Check.LOSS, Check.GRADIENT) and self.rank is None \
                and len(self.ledger.stepped) > 1:
            # Another optimizer's update (a GAN's generator's) left its weights non-finite,
            # and this step read them: that update made the value (one read, at a trip only;
            # this step's own weights were read finite). Not under torchrun: the ranks' one
            # exchange decided the trip's kind for all of them.
            earlier = self.last_updates(step)
            if earlier is not None:
                return earlier
        if verdict.check in (Check.OPTIMIZER, Check.PARAMETER):
            bad = nonfinite_shards(params)
            trip = self.trip(step, verdict.check, value_kind(bad[0][1]) if bad else "nan",
                             [name(p) for p, _ in bad])
            trip.step = verdict.step
            trip.state = nonfinite_state(optimizer, [p for p, _ in bad], name, self.rank)
            trip.element = first_element((name(p), p) for p, _ in bad)
            if verdict.check == Check.OPTIMIZER:     # the update ran at its own rates
                trip.optimizer = describe_optimizer(
                    optimizer, self.ledger.update_rates.get(id(optimizer)))
                return trip
        else:
            with_grad = [p for p in params if p.grad is not None]
            bad = nonfinite_shards([p.grad for p in with_grad], with_grad)
            kind = (float_kind(loss) if verdict.check == Check.LOSS
                    else value_kind(bad[0][1]) if bad else "nan")
            trip = self.trip(step, verdict.check, kind, [name(p) for p, _ in bad],
                             loss=loss, grad_norm=grad_norm)
            trip.element = first_element((f"{name(p)}.grad", p.grad) for p, _ in bad)
        trip.optimizer = describe_optimizer(optimizer)
        return trip

    def last_updates(self, step: int) -> ScriptTrip | None:
        """The parameters the script's last updates left, non-finite: the update that made
        them (one read, then one per tensor only when one is bad)."""
        return self.left_by(self.ledger.stepped.values(), step)

    def left_by(self, optimizers: list, step: int) -> ScriptTrip | None:
        """What the last updates of `optimizers` left, as `last_updates`."""
        tensors = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        if not tensors:
            return None
        shards = local_shards(tensors)
        norm = finite_norms([[p.detach() for p in shards]], tensors[0].device)[0]
        self.reads += 1
        if math.isfinite(norm.item()) or not confirm_nonfinite(shards):
            return None
        for opt in optimizers:
            bad = nonfinite_shards([p for group in opt.param_groups for p in group["params"]])
            if bad:
                trip = self.trip(step, Check.OPTIMIZER, value_kind(bad[0][1]),
                                 [self.ledger.name(p) for p, _ in bad])
                trip.step = self.ledger.updated_at.get(id(opt), step - 1)
                trip.optimizer = describe_optimizer(opt, self.ledger.update_rates.get(id(opt)))
                return trip
        return None
