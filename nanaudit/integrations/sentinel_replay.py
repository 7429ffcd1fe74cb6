"""Replaying a step `Sentinel` stopped: what it records of each micro-batch (`RecordedBatch`),
the session over the user's own loop objects, and the search of an accumulation window for the
micro-batch whose gradients went bad, and the localization of a tripped step
(`localize_step`). Told what it needs (a `ReplayTarget`, a callback for the micro-batch being
replayed), it reads nothing of the Sentinel.

The user's loop has no config, so the replay builds its Session from what the Sentinel holds,
with the precision of a loop nanaudit does not drive: autocast is the user's (inside `loss_fn`
or the model), and the loss is scaled by the step's recorded scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.checks import confirm_nonfinite
from nanaudit.run.step import RngState, ScanOutcome, StepState, Trip

if TYPE_CHECKING:
    from nanaudit.report.model import Finding
    from nanaudit.run.session import Session

LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclass
class RecordedBatch:
    """One forward/backward of an accumulation window, as Sentinel records it for the check
    and the replay."""

    index: int                  # the batch index the caller gave (default: a running count)
    batch: Any
    rng: RngState               # the RNG state before its forward
    finite: torch.Tensor        # 0-dim float64 on the device: 1.0 when the batch is finite
    loss: torch.Tensor          # 0-dim float64 on the device


class ReplayPrecision:
    """The Session's precision for a Sentinel replay: autocast is the user's, and a replay
    backpropagates the loss times the step's recorded scale."""

    def __init__(self, scaler: Any) -> None:
        self.name = "fp32"
        self.scaler = scaler
        self.scale = 1.0

    @staticmethod
    def autocast() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def scaled(self, loss: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return loss * scale if scale is not None else loss


def named_optimizers(optimizers: Sequence[Any]) -> dict[str, Any]:
    """A Sentinel's optimizers by the names its report gives them: `optimizer`, `optimizer[1]`,
    ... (every one: a GAN's overflow may be the other optimizer's update)."""
    return {("optimizer" if i == 0 else f"optimizer[{i}]"): o for i, o in enumerate(optimizers)}


def replay_session(model: torch.nn.Module, optimizers: dict[str, Any], loss_fn: LossFn | None,
                   device: torch.device, scaler: Any) -> Session:
    """The Session a replay of a Sentinel's step runs in, holding every optimizer the
    Sentinel was given (who updated which weights: localize/weight_growth.py)."""
    from nanaudit.run.session import Session
    first = next(iter(optimizers.values()), None)
    return Session.for_loop(model, first, loss_fn or (lambda model, batch: None), device,
                            label="<Sentinel>", precision=ReplayPrecision(scaler),
                            optimizers=optimizers)


def search_window(model: torch.nn.Module, loss_fn: LossFn, session: Session, trip: Trip,
                  window: list[RecordedBatch], scale: float | None,
                  on_replay: Callable[[RecordedBatch], None]) -> tuple[int | None, str | None]:
    """The first micro-batch whose own gradients reproduce the non-finite accumulated ones
    (untraced replays, one per micro-batch until found). Returns (index, note); `on_replay` is
    told each micro-batch as it is replayed, for the integrations."""
    from nanaudit.localize.replay import preserved_buffers, replay_reproduces
    with preserved_buffers(model):
        for i, micro in enumerate(window):
            on_replay(micro)
            state = StepState(trip.step, micro.batch, micro.rng, scale)
            if replay_reproduces(session, state, micro.batch, Check.GRADIENT):
                return i, None
        if len(window) > 1 and _accumulated_reproduces(model, loss_fn, window, scale,
                                                       on_replay):
            return None, (f"each of the {len(window)} micro-batches alone gives finite "
                          f"gradients, their accumulated sum does not: it overflowed")
    return None, None


def _accumulated_reproduces(model: torch.nn.Module, loss_fn: LossFn,
                            window: list[RecordedBatch], scale: float | None,
                            on_replay: Callable[[RecordedBatch], None]) -> bool:
    """Do the window's gradients, accumulated again, come out non-finite?"""
    from nanaudit.errors import call_user
    from nanaudit.run.step import scalar_loss
    model.zero_grad(set_to_none=True)
    for micro in window:        # the user's loss raising here is their error, not a verdict
        on_replay(micro)
        micro.rng.restore()
        loss = scalar_loss(call_user("loss_fn (replaying the accumulation window)",
                                     loss_fn, model, micro.batch))
        call_user("backward of the loss", (loss * scale if scale is not None else loss)
                  .backward)
    return confirm_nonfinite([p.grad.detach() for p in model.parameters() if p.grad is not None])


@dataclass(frozen=True)
class ReplayTarget:
    """What the replays of a Sentinel's steps run on, fixed for its life."""

    model: torch.nn.Module
    optimizers: dict[str, Any]  # every optimizer, by its report name (Sentinel.named_optimizers)
    loss_fn: LossFn | None
    device: torch.device
    scaler: Any
    isolate_samples: bool
    ranks: Any                  # sentinel_ranks.Ranks under FSDP2 and torchrun, else None


def localize_step(target: ReplayTarget, outcome: ScanOutcome, window: list[RecordedBatch],
                  where: int | None, scale: float | None, rng: RngState,
                  on_replay: Callable[[RecordedBatch | None], None]) -> tuple[Finding, StepState]:
    """The finding of `outcome.trip` and the state its replay started from. The replay runs on
    a forked RNG, so the loop's random streams stay its own. `where`: the micro-batch the read
    named (None: search the window); `rng`: the state to start from without a micro-batch."""
    cuda = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        return _localize(target, outcome, window, where, scale, rng, on_replay)


def _localize(target: ReplayTarget, outcome: ScanOutcome, window: list[RecordedBatch],
              where: int | None, scale: float | None, rng: RngState,
              on_replay: Callable[[RecordedBatch | None], None]) -> tuple[Finding, StepState]:
    from nanaudit.localize.findings import build_finding, unreplayed_finding
    from nanaudit.localize.producer import not_reached
    trip = outcome.trip
    assert trip is not None, "a finding is built for a trip"
    session = replay_session(target.model, target.optimizers, target.loss_fn, target.device,
                             target.scaler)
    note = None
    if where is None and trip.check == Check.GRADIENT and window and \
            target.loss_fn is not None and target.ranks is None:
        where, note = search_window(target.model, target.loss_fn, session, trip, window, scale,
                                    on_replay=on_replay)
    if where is None:
        where = len(window) - 1 if window else None
    micro = window[where] if where is not None else None
    on_replay(micro)
    state = StepState(trip.step, micro.batch if micro else None, micro.rng if micro else rng,
                      scale)
    outcome.state = state
    if target.ranks is not None:
        from nanaudit.localize.sharded_replay import rank_finding
        finding = rank_finding(target.ranks.coord, target.ranks.flags, session, outcome,
                               target.loss_fn is not None, target.ranks.partials)
    elif trip.check in (Check.LOSS, Check.GRADIENT) and (target.loss_fn is None or micro is None):
        finding = unreplayed_finding(trip, "pass `loss_fn=` to Sentinel (called as "
                                           "loss_fn(model, batch))")
    else:
        finding = build_finding(session, outcome, target.isolate_samples)
    if trip.check == Check.INPUT:
        not_reached(finding)
    if micro is not None and trip.check in (Check.INPUT, Check.LOSS, Check.GRADIENT):
        finding.batch_index = micro.index
        if len(window) > 1:
            finding.micro_batch = where
            finding.explain(f"micro-batch {where} of the {len(window)} accumulated for "
                            f"optimizer step {trip.step} (batch index {micro.index})")
    if note:
        finding.explain(note)
    return finding, state
