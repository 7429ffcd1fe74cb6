"""The data read a second time, from its start, to name what made a non-finite batch (`scan`
and `bisect`): the data entrypoint is called and iterated again to the bad batch with the op
tracer armed the whole way (the entrypoint's call, its generator, a DataLoader's Dataset,
transforms and collate_fn in this process), and with the DataLoader watched (loader_tap.py),
so that a batch made in a worker process can be made again here. A batch is walked only when
it equals the one the run saw (bisect's confirmation of rows, read the same way); otherwise
the finding says the data did not give it again.

`scan` starts the second read from the RNG state its first read started from (a shuffling
DataLoader draws its order there); `bisect` reads as it always confirmed rows, from the state
it is in. The RNGs are put back afterwards: the run goes on as if nothing had been read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from nanaudit.errors import UserCodeError, call_user
from nanaudit.localize.loader_tap import LoaderTap
from nanaudit.localize.producer import (
    DataCode,
    attach_unlocalized,
    forget_finite,
    name_producer,
)
from nanaudit.localize.tracer import OpTracer
from nanaudit.report.model import Finding
from nanaudit.run.batch import batch_fingerprint, float_leaves, sample_ids, to_device
from nanaudit.run.session import Session
from nanaudit.run.step import RngState, ScanOutcome

# on_batch(index, the batch as read again, the tracer, the DataLoader batches of that read)
OnBatch = Callable[[int, Any, Any, list], None]


@contextlib.contextmanager
def _rng_from(start: RngState | None) -> Iterator[None]:
    """Run from `start` (None: from where the RNGs are), and put them back afterwards."""
    saved = RngState.capture()
    if start is not None:
        start.restore()
    try:
        yield
    finally:
        saved.restore()


def reread(session: Session, seen: dict, traced: dict | None = None,
           start: RngState | None = None) -> list[int]:
    """Read the data again to the last batch of `seen` (data index -> batch_fingerprint): the
    indices whose batch differs. For each index of `traced` (-> OnBatch) whose batch is the
    same, the callback gets it, read under the tracer armed from the data's start."""
    traced = traced or {}
    if not seen:
        return []
    what = f"the data from `{session.options.data_label}` (read again to confirm the rows)"
    last, last_traced = max(seen), max(traced, default=-1)
    tracer = OpTracer(session.model) if traced else None

    def under(index: int, fn: Callable, *args: Any) -> Any:
        if tracer is None or index > last_traced:
            return call_user(what, fn, *args)
        with tracer:
            return call_user(what, fn, *args)
    changed: list[int] = []
    with LoaderTap() as tap, _rng_from(start):
        iterator = under(0, iter, under(0, session.make_data))
        for index in range(last + 1):
            tap.batches.clear()
            since = len(tracer.trace.forward_records) if tracer is not None else 0
            raw = under(index, next, iterator, None)
            if raw is None:
                return changed + [i for i in seen if i >= index]
            if index in seen and batch_fingerprint(to_device(raw, session.device)) != seen[index]:
                changed.append(index)
            elif index in traced and tracer is not None:
                traced[index](index, raw, tracer, list(tap.batches))
            if tracer is not None:
                forget_finite(tracer.trace, since)
    return changed


def data_code(session: Session, index: int, batches: list, ids: list | None) -> DataCode:
    return DataCode(f"`{session.options.data_label}` read again from its start to batch "
                    f"{index} (the same batch the run saw)", batches,
                    lambda: OpTracer(session.model), ids)


def walk_input(session: Session, finding: Finding) -> OnBatch:
    """The callback naming what made the finding's bad batch leaf, in the batch read again."""
    def on_batch(index: int, raw: Any, tracer: Any, batches: list) -> None:
        path = (finding.tensor or "batch")[len("batch"):]
        leaves = dict(float_leaves(raw))
        if path not in leaves:
            attach_unlocalized(finding, f"read again, batch {index} has no leaf batch{path}")
            return
        ids = sample_ids(raw, finding.samples)
        name_producer(finding, tracer, leaves[path], data_code(session, index, batches, ids))
    return on_batch


def trace_input(session: Session, outcome: ScanOutcome, finding: Finding) -> None:
    """`scan`: name what made the input finding's value, in the data read again."""
    state = outcome.state
    if state is None or state.batch_index is None:
        return
    trace_input_findings(session, outcome,
                         {state.batch_index: (batch_fingerprint(state.batch), finding)})


def trace_input_findings(session: Session, outcome: ScanOutcome,
                         inputs: dict[int, tuple[list, Finding]]) -> None:
    """`scan`: name what made each input finding's value (data index -> the batch's
    fingerprint and its finding), in one read of the data again from the run's start."""
    try:
        changed = reread(session, {i: fingerprint for i, (fingerprint, _) in inputs.items()},
                         {i: walk_input(session, f) for i, (_, f) in inputs.items()},
                         outcome.data_rng)
    except UserCodeError as error:
        for _, finding in inputs.values():
            attach_unlocalized(finding, f"reading the data again raised: {error}")
        return
    for index, (_, finding) in inputs.items():
        _unnamed(finding, index, changed)


def _unnamed(finding: Finding, index: int, changed: list[int]) -> None:
    """Why the read again named nothing for the finding of batch `index`, when it did not."""
    if finding.producer is not None:
        return
    attach_unlocalized(finding, unrepeated(index) if index in changed else
                       f"the data ended before batch {index} when read again")


def unrepeated(index: int) -> str:
    return (f"read again from its start, the data gave a different batch {index} (shuffling "
            f"or random augmentation outside the seeded RNG), so its making cannot be traced")


def trace_inputs(session: Session, seen: dict, findings: dict) -> list[int]:
    """`bisect`: confirm the batches (`seen`) by reading the data again, naming on the way what
    made each input finding's value (`findings`: data index -> its input finding)."""
    try:
        changed = reread(session, seen, {i: walk_input(session, f) for i, f in findings.items()})
    except UserCodeError as error:
        if not findings:
            raise
        # Read under the tracer the data failed: confirm the rows as before, untraced.
        changed = reread(session, seen)
        for finding in findings.values():
            if finding.producer is None:
                attach_unlocalized(finding, f"reading the data again traced raised: {error}")
    for index, finding in findings.items():
        _unnamed(finding, index, changed)
    return changed
