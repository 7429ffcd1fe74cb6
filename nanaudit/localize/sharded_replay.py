"""The traced replay of a step under FSDP2 (`Sentinel` in the user's loop, `scan`): every rank
replays its own (micro-)batch at once, since each forward and backward all-gathers the weights
and reduce-scatters the gradients with every peer, and each rank walks back from what its own
ops made: its loss, or its own gradients before the reduce-scatter (which the flags of
run/sharded.PreReduceFlags keep while a replay traces). A value that reached a rank from a peer
(the walk ends at an input that no op of this rank made: a collective's output) is not that
rank's: its Localization is not reproduced, and the caller takes the finding of the rank whose
own op made the value (run/rank_checks.origin_entry).

One replay per rank and no sample search: a search replays sub-batches a number of times only
the searching rank knows, and every replay needs every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanaudit.localize.events import kinds_of
from nanaudit.localize.replay import preserved_buffers, traced_replay
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.vocabulary import Check
from nanaudit.run.checks import nonfinite_names
from nanaudit.run.session import Session
from nanaudit.run.sharded import PreReduceFlags
from nanaudit.run.step import StepState, Trip


def rank_localizer(flags: PreReduceFlags) -> Callable[..., Localization]:
    """localize() for one rank of an FSDP2 run (see the module docstring)."""
    def localize_rank(session: Session, state: StepState, trip: Trip,
                      timeline) -> Localization:
        flags.tracing, flags.sinks = True, []
        try:
            with preserved_buffers(session.model):
                trace, loss = traced_replay(session, state)
        finally:
            flags.tracing = False
        sink: torch.Tensor | None = loss
        if trip.check == Check.LOSS:
            phase, names = "forward", None
        else:
            own = [s for s in flags.sinks if kinds_of(s)]
            names = nonfinite_names((n, p.grad) for n, p in session.model.named_parameters())
            sink, phase = (own[0] if own else None), "backward"
        if sink is None or not kinds_of(sink):
            return Localization(False, ops_traced=trace.ops_seen)
        loc = walk_from_sink(trace, sink, phase, timeline, names)
        if loc.event is not None and loc.event.untracked:
            return Localization(False, ops_traced=trace.ops_seen)     # a peer's value
        return loc
    return localize_rank
