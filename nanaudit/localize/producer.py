"""Producer, not propagator, upstream of the model: when the first non-finite value is already
in the batch, the walk back from the bad batch leaf through the ops of the user's data code
(traced while that batch was made: a loop body, a collate_fn, a Dataset's __getitem__, a data
entrypoint) to the op that created it, or to where it reached torch already non-finite.

The walk, the blame and the diagnosis are the model's (walk.py, blame.py, the rules): an op has
the same causes upstream of the model as inside it, and the fix names the user's line. What is
particular here is the answer when no traced op computed the value: it reached torch already
non-finite (read from a file, made by NumPy or pandas, a NaN in the data set, a Python number
written into a tensor), and the input finding says so rather than name an op that only held
it. A batch a DataLoader worker made is made again in this process first (loader_tap.py).
The input finding keeps its facts (step, rows, leaves, ids); `producer` says what made it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.localize.events import OpEvent, Trace, carries, kinds_of
from nanaudit.localize.findings import made_by, traced_finding
from nanaudit.localize.loader_tap import LoaderBatch, remake
from nanaudit.localize.ops import named_tensors, op_base
from nanaudit.localize.walk import Localization, walk_from_sink
from nanaudit.report.model import Finding, InputProducer, SourceLine
from nanaudit.report.vocabulary import Cause, ProducerKind, Where
from nanaudit.run.batch import nonfinite_rows, sample_ids, tensor_leaves

# Ops that adopt memory filled elsewhere (a worker's shared memory, a mapped file): the values
# were not computed by the op.
ADOPTS_STORAGE = frozenset({"set"})

# Ops that turn a Python or NumPy value into a tensor (`torch.tensor(...)`, `x[i] = nan`).
ENTRIES = frozenset({"lift_fresh", "lift", "scalar_tensor"})

OUTSIDE_WORDS = ("read from a file, made by NumPy or pandas, or already non-finite in the data "
                 "set")


@dataclass
class Arrival:
    """How a value no traced op computed reached torch: the first traced op that held it (None:
    no op did), the tensors that carried it in, and whether it came as a Python number."""

    event: OpEvent | None
    carriers: list
    number: bool = False


@dataclass
class LeafOrigin:
    """What made a bad batch leaf: an op of the traced code (`made`) or its `arrival`."""

    made: Localization | None = None
    arrival: Arrival | None = None
    chain_tensors: tuple = ()        # the bad tensors on the way from it to the leaf


def origin_of(tracer: Any, leaf: torch.Tensor, timeline: list | None = None) -> LeafOrigin:
    """Walk back from `leaf` (a bad batch tensor) through what `tracer` saw."""
    trace: Trace = tracer.trace
    start = trace.producer_of(leaf)
    if start is None:
        return LeafOrigin(arrival=Arrival(None, [leaf]), chain_tensors=(leaf,))
    kind = "nan" if "nan" in kinds_of(leaf) else "inf"
    creator, chain = trace.walk_back(start, kind)
    on_the_way = (leaf, *made_by(tracer, {e.index for e in chain}))
    arrival = arrival_at(tracer, creator, kind)
    if arrival is not None:
        return LeafOrigin(arrival=arrival, chain_tensors=on_the_way + tuple(arrival.carriers))
    loc = walk_from_sink(trace, leaf, Where.FORWARD, timeline or [], None, "the batch")
    outside = [e for e in loc.chain or [] if e.untracked]
    if loc.diagnosis is not None and loc.diagnosis.cause == Cause.UNKNOWN and outside:
        # an infinity that came from outside torch, turned into NaN on the way
        arrival = arrival_at(tracer, outside[0], "any") or Arrival(outside[0], [])
        return LeafOrigin(arrival=arrival, chain_tensors=on_the_way + tuple(arrival.carriers))
    return LeafOrigin(made=loc, chain_tensors=on_the_way)


def arrival_at(tracer: Any, event: OpEvent, kind: str) -> Arrival | None:
    """The arrival, when `event` (the first op to hold the value) did not compute it."""
    carrying = [i for i, (k, p) in enumerate(zip(event.in_kinds, event.in_producers))
                if p is None and k and (kind == "any" or carries(k, kind))]
    if carrying:
        tensors = named_tensors(event.arg_names, event.args, event.kwargs)
        return Arrival(event, [tensors[i][1] for i in carrying if i < len(tensors)])
    if op_base(event.op) in ADOPTS_STORAGE:
        return Arrival(event, list(made_by(tracer, {event.index})))
    if not any(event.in_kinds) and event.scalar_infinities():
        return Arrival(event, [], number=True)
    return None


def forget_finite(trace: Trace, since: int) -> None:
    """Drop what no walk will read from the ops traced since record `since` (inputs kept for
    rules, makers of tensors that died), so that tracing a long stretch of data code does
    not keep every batch alive."""
    for record in trace.forward_records[since:]:
        if not record.out_kinds:
            record.args = record.kwargs = None
    trace.makers = {k: v for k, v in trace.makers.items() if v[0]() is not None}


@dataclass
class DataCode:
    """What was traced to name the producer: `traced` in words, and the batches DataLoaders
    handed out there (a worker's is made again in this process)."""

    traced: str
    loader_batches: list
    make_tracer: Callable[[], Any]
    ids: list | None = None          # the bad rows' ids in the batch, when it carries them


def name_producer(finding: Finding, tracer: Any, leaf: torch.Tensor, code: DataCode) -> None:
    """Add to an input finding what made its bad `leaf`: the op of the user's data code, or that
    it reached torch already non-finite, or why neither can be said."""
    origin = origin_of(tracer, leaf)
    worker = None
    if origin.arrival is not None:
        record, path = _worker_batch(code.loader_batches, origin.arrival.carriers)
        if record is not None:
            worker, tracer = record.worker, code.make_tracer()
            again, why = remake(record, tracer)
            if again is None:
                attach_unlocalized(finding, f"the batch was made in DataLoader worker "
                                   f"{worker}, where nothing is traced; {why}", code.traced,
                                   worker)
                return
            made_again = dict(tensor_leaves(again))[path]
            origin = origin_of(tracer, made_again)
            code = DataCode(f"worker {worker}'s Dataset and collate_fn, run again in this "
                            f"process with its seeds, worker_init_fn and sampler indices (the "
                            f"batch they made equals the one the worker handed out)", [record],
                            code.make_tracer, code.ids)
            origin.chain_tensors += (made_again, dict(tensor_leaves(record.batch))[path])
    indices, ids = dataset_rows(code.loader_batches, origin.chain_tensors)
    ids = ids or code.ids
    if origin.made is not None:
        attach_made(finding, origin.made, code.traced, worker, indices, ids)
    else:
        assert origin.arrival is not None
        attach_arrival(finding, origin.arrival, code.traced, worker, indices, ids)


def _worker_batch(batches: list, carriers: list) -> tuple[LoaderBatch | None, str]:
    """The worker's batch (and the leaf's path in it) that carried the value in, if any."""
    for record in batches:
        if record.worker is None and record.setup is None:
            continue
        for path, t in tensor_leaves(record.batch):
            if any(t is c for c in carriers):
                return record, path
    return None, ""


def dataset_rows(batches: list, tensors: tuple) -> tuple[list | None, list | None]:
    """The data set's indices (and ids) of the bad rows, read off the DataLoader batch the value
    passed through, when its rows are its sampler indices in order."""
    for record in batches:
        for _, t in tensor_leaves(record.batch):
            if not any(t is c for c in tensors) or not t.dim():
                continue
            rows = nonfinite_rows(t, 0)
            ids = sample_ids(record.batch, rows)
            if record.in_order and isinstance(record.index, list) \
                    and t.shape[0] == len(record.index):
                return [record.index[r] for r in rows], ids
            return None, ids
    return None, None


def _at(source: SourceLine | None) -> str:
    return f"{os.path.basename(source.file)}:{source.line}" if source is not None else ""


def rows_text(indices: list | None, ids: list | None) -> str:
    """The clause an input finding adds: "; the data set's indices of those rows: [...]"."""
    if indices:
        return f"; the data set's indices of those rows: {indices}" + \
            (f" (ids {ids})" if ids else "")
    return f"; the ids of those rows: {ids}" if ids else ""


def attach_made(finding: Finding, loc: Localization, traced: str, worker: int | None = None,
                indices: list | None = None, ids: list | None = None) -> None:
    """The value was made by an op of the traced data code: the finding names that op, its
    line, its inputs and its cause, and the fix that line."""
    op = traced_finding(loc, finding.step, tensor=finding.tensor, tensors=finding.tensors)
    finding.op, finding.module, finding.source = op.op, op.module, op.source
    finding.inputs, finding.chain, finding.reproduced = op.inputs, op.chain, True
    finding.cause = op.cause
    at = _at(op.source)
    finding.fix = f"at {at}: {op.fix}" if at else op.fix
    place = f"in DataLoader worker {worker}" if worker is not None else "by the data code"
    finding.explain(f"it was made {place} before the model, by {op_base(str(op.op))}"
                    f"{f' at {at}' if at else ''}: {op.explanation}{rows_text(indices, ids)}")
    finding.producer = InputProducer(ProducerKind.TORCH_OP, traced, worker, indices, ids)


def attach_arrival(finding: Finding, arrival: Arrival, traced: str, worker: int | None = None,
                   indices: list | None = None, ids: list | None = None) -> None:
    """No traced op computed the value: it was already non-finite when it reached torch."""
    event = arrival.event
    how = f"it was {OUTSIDE_WORDS}"
    if event is not None:
        source = event.source
        at = f" at {_at(source)} (`{source.code}`)" if source is not None else ""
        if arrival.number or (op_base(event.op) in ENTRIES and source is not None):
            how = f"it entered torch{at}, as a Python number or a NumPy value"
        elif op_base(event.op) in ADOPTS_STORAGE:
            how = (f"it came in with memory no torch op filled{at} (a file `torch.load` read, "
                   f"a worker's shared memory)")
        else:
            how = f"the first op to hold it was {op_base(event.op)}{at}; {how}"
    finding.explain(f"it was already non-finite when it reached torch: no torch op computed it "
                    f"in {traced}; {how}{rows_text(indices, ids)}")
    finding.producer = InputProducer(ProducerKind.OUTSIDE_TORCH, traced, worker, indices, ids)


def attach_unlocalized(finding: Finding, why: str, traced: str = "",
                       worker: int | None = None) -> None:
    """The data code could not be traced faithfully: say why, name no op."""
    finding.explain(f"the op that made it is not named: {why}")
    finding.producer = InputProducer(ProducerKind.NOT_LOCALIZED, traced, worker, note=why)


def not_reached(finding: Finding) -> None:
    """`Sentinel` and the callbacks: the batch was made by the loop's code before they saw it,
    code they do not run again, so what made its value cannot be traced faithfully."""
    attach_unlocalized(finding, "the batch was made by the training loop's own code before "
                       "Sentinel (or the callback) received it, and that code is not run again "
                       "here; `nanaudit run` re-runs the script with its data code traced, and "
                       "`nanaudit scan` reads a config's data entrypoint again traced")
