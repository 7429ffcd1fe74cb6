"""The traced replay of a step under FSDP2 (`Sentinel` in the user's loop, `scan`): every rank
replays its own (micro-)batch at once, since each forward and backward all-gathers the weights
and reduce-scatters the gradients with every peer, and each rank walks back from what its own
ops made: its loss, or its own gradients before the reduce-scatter (which the flags of
run/sharded.PreReduceFlags keep while a replay traces). A value that reached a rank from a peer
(the walk ends at an input that no op of this rank made: a collective's output) is not that
rank's: its Localization is not reproduced, and the caller takes the finding of the rank whose
own op made the value (run/rank_checks.origin_entry).

One replay per rank and no sample search (a search replays sub-batches a number of times only
the searching rank knows, and every replay needs every rank): the rows are read off the
creating op's output, and so is the global index of its first bad element where that output is
a sharded DTensor (replay_finding.read_off). Each rank also names its own first bad element of
the sharded weight or gradient a weights' or gradient trip names (`tensor_element`), as
`nanaudit run` does.

While a replay traces (`traced_window`, also `nanaudit run`'s in-process replay under FSDP2)
the reduce-scatter flags keep each rank's own gradients (`own_sink`) and, like TP's partial
flags, compute no flag: the next step's exchange sees none of the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanaudit.localize.events import kinds_of
from nanaudit.localize.findings import build_finding, unreplayed_finding
from nanaudit.localize.ops import is_collective
from nanaudit.localize.replay import preserved_buffers, traced_replay
from nanaudit.localize.replay_finding import read_off
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.model import Finding
from nanaudit.report.sections import ShardElement
from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.batch import infer_layout
from nanaudit.run.checks import nonfinite_names
from nanaudit.run.distributed import Coordinator
from nanaudit.run.mesh import MeshView, PartialFlags, name_on_mesh, tensor_element
from nanaudit.run.rank_checks import gather_by_store, origin_entry
from nanaudit.run.session import Session
from nanaudit.run.sharded import PreReduceFlags
from nanaudit.run.step import ScanOutcome, StepState, Trip


def made_here(loc: Localization) -> bool:
    """Under torchrun: did this rank's own op make the value? Not when the walk ends at a
    collective, or at an input no op of this rank made (the tracer saw all of them)."""
    event = loc.event
    return event is not None and not event.untracked and not is_collective(event.op)


@contextlib.contextmanager
def traced_window(flags: PreReduceFlags, partials: PartialFlags | None) -> Iterator[None]:
    """A replay's traced window on this rank (see the module docstring); the gradients kept
    are let go when it ends."""
    flags.sinks = []
    flags.tracing = True
    if partials is not None:
        partials.tracing = True
    try:
        yield
    finally:
        flags.tracing = False
        if partials is not None:
            partials.tracing = False
        flags.sinks = []


def own_sink(flags: PreReduceFlags) -> torch.Tensor | None:
    """In a traced window: the first non-finite input of this rank's reduce-scatters, its own
    gradient (None: its own were finite, a bad one came from a peer)."""
    return next((sink for sink in flags.sinks if kinds_of(sink)), None)


def rank_localizer(flags: PreReduceFlags,
                   partials: PartialFlags | None = None) -> Callable[..., Localization]:
    """localize() for one rank of an FSDP2 run (see the module docstring); `partials`: the
    run's TP flags."""
    def localize_rank(session: Session, state: StepState, trip: Trip,
                      timeline: Any) -> Localization:
        with traced_window(flags, partials):
            with preserved_buffers(session.model):
                tracer, loss = traced_replay(session, state)
            sink = loss if trip.check == Check.LOSS else own_sink(flags)
        trace = tracer.trace
        if trip.check == Check.LOSS:
            phase, names = Where.FORWARD, None
        else:
            names = nonfinite_names((n, p.grad) for n, p in session.model.named_parameters())
            phase = Where.BACKWARD
        if sink is None or not kinds_of(sink):
            return Localization(False, ops_traced=trace.ops_seen)
        loc = walk_from_sink(trace, sink, phase, timeline, names)
        if loc.event is None or not made_here(loc):
            return Localization(False, ops_traced=trace.ops_seen)     # a peer's value
        read_off(tracer, loc, infer_layout(state.batch, session.options.batch_dim).size)
        return loc
    return localize_rank


def rank_finding(coord: Coordinator, flags: PreReduceFlags, session: Session,
                 outcome: ScanOutcome, replayable: bool = True,
                 partials: PartialFlags | None = None) -> Finding:
    """Every rank's finding of the trip, the same on every rank: for a loss or gradient trip
    every rank replays at once and the finding of the rank whose own op made the value is
    taken; for an input or a weights' shard, the finding of the rank the flags named. Called
    by every rank (`replayable`: the loss can be replayed, alike on every rank)."""
    trip = outcome.trip
    assert trip is not None, "a finding is built for a trip"
    element = trip_element(session.model, trip.check)    # before a replay makes them again
    finding, made = None, False
    if trip.check in (Check.LOSS, Check.GRADIENT):
        if replayable:
            finding = build_finding(session, outcome, False, rank_localizer(flags, partials))
            made = finding.reproduced is True and finding.op is not None
        elif trip.rank in (None, coord.rank):
            finding = unreplayed_finding(trip, "pass `loss_fn=` to Sentinel (called as "
                                               "loss_fn(model, batch))")
    elif trip.rank in (None, coord.rank):    # the rank whose batch or shard holds the value
        finding, made = build_finding(session, outcome, False), trip.rank == coord.rank
    if finding is not None:
        finding.rank = coord.rank
        finding.element = finding.element or element
    gathered = gather_by_store(coord, "finding", (finding, made))
    chosen = origin_entry([f for f, _ in gathered], [m for _, m in gathered], trip.rank)
    chosen = chosen if chosen is not None else unreplayed_finding(trip, "no rank reproduced it")
    name_on_mesh(MeshView.of(session.model), chosen)
    return chosen


def trip_element(model: torch.nn.Module, check: Check) -> ShardElement | None:
    """This rank's first bad element of the sharded tensors the trip's finding names: a
    gradient trip's gradients, a weights' trip's weights (a host read per tensor until one
    holds it); none for the others (a loss names the element of its creating op's output)."""
    if check == Check.GRADIENT:
        return tensor_element(model, gradients=True)
    if check in (Check.PARAMETER, Check.OPTIMIZER):
        return tensor_element(model, gradients=False)
    return None
