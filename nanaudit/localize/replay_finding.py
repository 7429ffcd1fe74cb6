"""The finding of a traced replay of one step, as every replay that traces a step names it
(`nanaudit run`'s in-process replay, its error replay and its re-run; FSDP2's replay on every
rank): what the creating op's output says, read off the tensors the tracer kept (no replay of
sub-batches), and the value a raise is walked back from.

Read off the creating op's output: the batch rows whose slice of it went bad (`created_rows`,
and how they were found, `rows_search`) and, where the output is a sharded DTensor (a
tensor-parallel layer's own op), the global index of its first bad element (`created_element`).
A DTensor is read through this rank's shard: a reduction on the DTensor itself needs a sharding
strategy that not every op has."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanaudit.localize.events import OpEvent, kinds_of
from nanaudit.localize.findings import made_by, traced_finding
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.model import Finding, SampleSearch
from nanaudit.report.sections import ShardElement
from nanaudit.report.vocabulary import Where
from nanaudit.run.batch import nonfinite_rows
from nanaudit.run.mesh import first_element, global_rows
from nanaudit.run.sharded import local_shard


def finding_at(tracer: OpTracer, loc: Localization, step: int, names: list[str] | None,
               batch_size: int | None) -> Finding:
    """The finding of the reproduced `loc` (its event set) of step `step`: the creating op's
    (findings.traced_finding), with what its output says (`read_off`). `names`: the parameters
    whose gradients are bad, for a gradient sink (the finding's tensor: the first, else the
    loss); `batch_size`: the rows of the replayed (micro-)batch."""
    read_off(tracer, loc, batch_size)
    finding = traced_finding(loc, step, tensor=names[0] if names else "loss",
                             tensors=list(names or []))
    finding.sample_search = loc.sample_search
    if loc.rows and batch_size is not None and len(loc.rows) < batch_size:
        finding.samples = loc.rows
    return finding


def read_off(tracer: OpTracer, loc: Localization, batch_size: int | None) -> None:
    """Give `loc` what its creating op's output says: the sharded output's bad element, the
    rows whose slice went bad and how they were found."""
    event = loc.event
    assert event is not None, "a localization that names its creating op"
    loc.element = created_element(tracer, event)
    loc.rows = created_rows(tracer, event, batch_size)
    loc.sample_search = rows_search(event.op, loc.rows, batch_size)


def created_element(tracer: OpTracer, event: OpEvent) -> ShardElement | None:
    """The first bad element of the creating op's output where that output is a sharded
    DTensor, by its index in this rank's shard and in the whole tensor, named `OP output`;
    None for an op on plain (or local) tensors."""
    return first_element((f"{event.op} output", t) for t in made_by(tracer, {event.index}))


def created_rows(tracer: OpTracer, event: OpEvent, batch_size: int | None) -> list[int] | None:
    """The batch rows whose slice of the creating op's output is bad: for a forward op, or a
    backward op whose forward op read no weight (its gradients are per row, as sqrt's of a
    per-row norm; one of a matmul with a weight sums over the rows)."""
    if not batch_size or (event.phase != Where.FORWARD and (
            event.forward is None or event.forward.reads_weights)):
        return None
    rows: set[int] = set()
    for t in made_by(tracer, {event.index}):
        if t.dim() >= 1 and t.shape[0] == batch_size:
            rows.update(global_rows(t, nonfinite_rows(local_shard(t.detach()), 0)))
    return sorted(rows) or None


def rows_search(op: str, rows: list[int] | None, batch_size: int | None) -> SampleSearch | None:
    """How the rows of a traced step were found: from the creating op's output, no replays."""
    if not rows or batch_size is None:
        return None
    if len(rows) < batch_size:
        return SampleSearch(batch_size, 0, False,
                            f"the rows whose slice of {op}'s output went non-finite")
    # Every row: the weights or the op, not particular samples (no row to inspect).
    return SampleSearch(batch_size, 0, False,
                        f"every row's slice of {op}'s output went non-finite: a batch-level "
                        f"value, not particular samples")


def raised_sink(tracer: OpTracer, first: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
    """The value a raise is walked back from: the first of `first` (what the script's frames
    held), else the last non-finite value the tracer saw, that an op of the trace made
    non-finite (None: no op did)."""
    trace = tracer.trace
    candidates = [*first, *reversed(tracer.kept_tensors())]
    return next((t for t in candidates if trace.producer_of(t) is not None and kinds_of(t)),
                None)


def walk_raised(tracer: OpTracer, sink: torch.Tensor, timeline: Any) -> Localization:
    """The walk back from `raised_sink`'s value, in the phase of the op that made it."""
    trace = tracer.trace
    producer = trace.producer_of(sink)
    assert producer is not None, "a sink an op of the trace made"
    return walk_from_sink(trace, sink, trace.events[producer].phase, timeline, None)
