"""Which samples of the data set a bad step's batch held, for `nanaudit run --keep-going`: a
skipped step is never re-run, so no trace of the script's data code names them. While the run
keeps going, the DataLoader iterators are watched (localize/loader_tap.LoaderTap: each batch's
sampler indices, no value computed), keeping the batches of the current step and the one
before; at an input trip the bad rows' data set indices (and ids, where the batch carries an id
leaf) are read off the batch the model's input was, the same tensor or its copy on the model's
device, by the rule the re-run reads them with (localize/producer.dataset_rows)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nanaudit.localize.loader_tap import LoaderBatch, LoaderTap
from nanaudit.localize.producer import dataset_rows, rows_text
from nanaudit.report.model import Finding, InputProducer
from nanaudit.report.vocabulary import Check, ProducerKind
from nanaudit.run.batch import tensor_leaves
from nanaudit.script.step_values import data_inputs
from nanaudit.script.trip import ScriptTrip

# Batches kept a step at most: a longer accumulation window's first ones are let go (their
# rows then go unnamed), so no more than twice this many of the data's batches stay alive.
MAX_BATCHES = 16


class StepBatches(LoaderTap):
    """The batches DataLoader iterators handed out during the script's current step and the
    one before (`step()` tells which step that is): a loader that reads one batch ahead
    (accelerate's) fetched a step's first batch during the step before."""

    def __init__(self, step: Callable[[], int]) -> None:
        super().__init__()
        self._step, self._at = step, -1
        self._before: list[LoaderBatch] = []

    @property
    def recent(self) -> list[LoaderBatch]:
        return self._before + self.batches

    def _after_next(self, it: Any, batch: Any) -> None:
        step = self._step()
        if step != self._at:            # a new step: the batches of the one before it stay
            self._before = self.batches[-MAX_BATCHES:] if step == self._at + 1 else []
            self.batches = []
            self._at = step
        super()._after_next(it, batch)
        del self.batches[:-MAX_BATCHES]


def name_samples(finding: Finding, trip: ScriptTrip, calls: list, batches: list) -> None:
    """An input finding of the first run, with its rows' data set indices and ids as a
    `producer` that traced nothing, when the bad input is a DataLoader batch's tensor."""
    if trip.check != Check.INPUT or finding.producer is not None or not finding.samples:
        return
    index = trip.micro_batch or 0
    if index >= len(calls):
        return
    bad = dict(data_inputs(calls[index].args, calls[index].kwargs)).get(finding.tensor or "")
    if bad is None or bool(torch.isfinite(bad).all()):
        return          # under torchrun, a peer's bad batch: this rank's rows are not its
    found = _batch_of(batches, bad)
    if found is None:
        return
    indices, ids = dataset_rows([found[0]], (found[1],))     # the re-run's rule, on that batch
    if indices or ids:
        finding.explain(rows_text(indices, ids).removeprefix("; "))
        finding.producer = InputProducer(ProducerKind.NOT_LOCALIZED, sample_indices=indices,
                                         sample_ids=ids,
                                         note="a skipped step's data code is not traced")


def _batch_of(batches: list[LoaderBatch],
              tensor: torch.Tensor) -> tuple[LoaderBatch, torch.Tensor] | None:
    """The batch (and its leaf) the model's input was: the leaf itself, or a copy of it."""
    for record in reversed(batches):
        for _path, leaf in tensor_leaves(record.batch):
            if leaf is tensor or _copy_of(leaf, tensor):
                return record, leaf
    return None


def _copy_of(leaf: torch.Tensor, tensor: torch.Tensor) -> bool:
    """The same values (NaN where NaN is), shape and dtype: `.to(device)` of the leaf."""
    if leaf.shape != tensor.shape or leaf.dtype != tensor.dtype or not leaf.dim():
        return False
    return torch.allclose(leaf.to(tensor.device), tensor.detach(), rtol=0, atol=0,
                          equal_nan=True)
