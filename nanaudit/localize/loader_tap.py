"""What torch's DataLoader handed out while nanaudit watched, and a worker process's batch made
again in this process, where the tracer can see it.

A DataLoader with `num_workers > 0` runs the Dataset, its transforms and the collate_fn in
worker processes: the tracer sees none of their ops, only the finished batch arriving. While a
`LoaderTap` is installed it wraps three methods of torch's DataLoader iterators, all put back
on removal: `_next_index` (the sampler indices of each batch), `_try_put_index` (which worker
each task of a multi-process iterator went to) and `__next__` (the batch handed out, recorded
as a `LoaderBatch`). Nothing of the user's changes and no value is computed differently.

`remake` does what that worker did (torch/utils/data/_utils/worker.py): seeds Python, torch and
NumPy from the iterator's base seed and the worker id, sets the worker info, one thread, calls
`worker_init_fn`, then fetches every batch that worker made in this epoch, in order, under the
tracer. The result counts only when it equals the batch the worker handed out; otherwise the
finding says so, and never names an op from a batch that was not the one that went bad.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.errors import delegates
from nanaudit.run.batch import same_batch
from nanaudit.run.step import RngState


@dataclass
class WorkerSetup:
    """What a worker of one DataLoader iterator started from, to do its work again here;
    `why_not` says why that cannot be done faithfully (then nothing is re-made)."""

    dataset: Any
    kind: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    init_fn: Callable | None
    workers: int
    why_not: str | None = None


@dataclass
class LoaderBatch:
    """One batch a DataLoader handed out: its sampler indices and, from a worker process, the
    worker and the tasks it ran this epoch up to this one ([(task, sampler indices)])."""

    batch: Any
    index: Any
    in_order: bool                       # the batch's rows are its indices, in order
    worker: int | None = None
    worker_tasks: list = field(default_factory=list)   # all the worker's tasks this epoch ...
    task_count: int = 0                                 # ... of which the first this many
    setup: WorkerSetup | None = None

    @property
    def tasks(self) -> list:
        """The worker's tasks this epoch up to this batch, in the order it ran them."""
        return self.worker_tasks[:self.task_count]


@dataclass
class _Seen:
    """What the tap knows of one iterator: its last sampler indices and its sent tasks."""

    last_index: Any = None
    sent: dict = field(default_factory=dict)     # task -> (worker, sampler indices)
    by_worker: dict = field(default_factory=dict)   # worker -> [(task, sampler indices)]


class LoaderTap:
    """Records the batches DataLoader iterators hand out while installed (`with LoaderTap() as
    tap:` ... `tap.batches`); the owner clears `batches` where its window starts."""

    def __init__(self) -> None:
        self.batches: list[LoaderBatch] = []
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._restore: list = []

    def __enter__(self) -> LoaderTap:
        from torch.utils.data import dataloader
        base, multi = dataloader._BaseDataLoaderIter, dataloader._MultiProcessingDataLoaderIter
        self._wrap(base, "_next_index", self._after_next_index)
        self._wrap(multi, "_try_put_index", None)
        self._wrap(base, "__next__", self._after_next)
        return self

    def __exit__(self, *exc: object) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []

    def _wrap(self, cls: type, name: str, after: Callable | None) -> None:
        original = cls.__dict__.get(name)
        if original is None:          # another torch: nothing recorded, nothing re-made
            return
        tap = self

        if name == "_try_put_index":
            @delegates
            def wrapper(it: Any, *args: Any, **kwargs: Any) -> Any:
                task = getattr(it, "_send_idx", None)
                result = original(it, *args, **kwargs)
                tap._after_put(it, task)
                return result
        else:
            @delegates
            def wrapper(it: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(it, *args, **kwargs)
                assert after is not None
                after(it, result)
                return result
        setattr(cls, name, wrapper)
        self._restore.append(lambda: setattr(cls, name, original))

    def _state(self, it: Any) -> _Seen:
        seen = self._seen.get(it)
        if seen is None:
            seen = self._seen[it] = _Seen()
        return seen

    def _after_next_index(self, it: Any, index: Any) -> None:
        self._state(it).last_index = index

    def _after_put(self, it: Any, task: int | None) -> None:
        """A task sent to a worker: which one, and the indices it holds (a new epoch starts
        again at task 0)."""
        info = getattr(it, "_task_info", {})
        if task is None or getattr(it, "_send_idx", task) != task + 1 or task not in info:
            return
        seen = self._state(it)
        if task == 0:                  # new lists: the batches recorded keep the old ones
            seen.sent, seen.by_worker = {}, {}
        worker = info[task][0]
        seen.sent[task] = (worker, seen.last_index)
        seen.by_worker.setdefault(worker, []).append((task, seen.last_index))

    def _after_next(self, it: Any, batch: Any) -> None:
        seen = self._state(it)
        in_order = _default_collate(it)
        workers = getattr(it, "_num_workers", 0)
        if not workers:
            self.batches.append(LoaderBatch(batch, seen.last_index, in_order))
            return
        # In order, the batch handed out is the task before the next one to receive.
        ordered = getattr(it, "_in_order", True)
        task = getattr(it, "_rcvd_idx", 0) - 1 if ordered else -1
        worker, index = seen.sent.pop(task, (None, None))
        tasks = seen.by_worker.get(worker, [])
        # Round robin: worker w ran tasks w, w + W, ... of this epoch; all must have been seen.
        place = task // workers
        complete = worker is not None and place < len(tasks) and tasks[place][0] == task \
            and [t for t, _ in tasks[:1]] == [worker]
        count = place + 1 if complete else 0
        self.batches.append(LoaderBatch(batch, index, in_order, worker, tasks, count,
                                        _setup(it, ordered, complete)))


def _default_collate(it: Any) -> bool:
    """Are the batch's rows its sampler indices, in order (automatic batching with the default
    collate_fn)? A collate_fn of the user's may sort or drop rows."""
    from torch.utils.data import default_collate
    return bool(getattr(it, "_auto_collation", False)) and \
        getattr(it, "_collate_fn", None) is default_collate


# WorkerSetup's fields, read off the iterator's attributes of the same name with a `_` (and
# `kind`, `init_fn`, `workers`: `_dataset_kind`, `_worker_init_fn`, `_num_workers`).
SETUP = {"dataset": "_dataset", "kind": "_dataset_kind", "auto_collation": "_auto_collation",
         "collate_fn": "_collate_fn", "drop_last": "_drop_last", "base_seed": "_base_seed",
         "init_fn": "_worker_init_fn", "workers": "_num_workers"}


def _setup(it: Any, ordered: bool, complete: bool) -> WorkerSetup:
    """How the iterator's workers started, and why a worker's batch cannot be made again."""
    from torch.utils.data.dataloader import _DatasetKind
    values: dict[str, Any] = {field: getattr(it, name, None) for field, name in SETUP.items()}
    why_not = None
    if any(values[k] is None for k in ("dataset", "kind", "auto_collation", "collate_fn",
                                       "drop_last", "base_seed")):
        why_not = "this torch's DataLoader keeps its workers' settings where nanaudit cannot read"
    elif values["kind"] != _DatasetKind.Map:
        why_not = ("an IterableDataset runs as its own copy in each worker, which this process "
                   "cannot rebuild")
    elif not ordered:
        why_not = "the DataLoader hands batches out of order (in_order=False)"
    elif not complete:
        why_not = ("not every task of that worker in this epoch was seen (persistent workers "
                   "past their first epoch, or an iterator made before nanaudit watched)")
    return WorkerSetup(**values, why_not=why_not)


def remake(record: LoaderBatch, tracer: Any) -> tuple[Any, str | None]:
    """The worker's batch made again in this process under `tracer` (entered here): (the batch,
    None), or (None, why it cannot be, or why it does not count)."""
    setup, worker = record.setup, record.worker
    if setup is not None and setup.why_not is not None:
        return None, setup.why_not
    if setup is None or worker is None:
        return None, "the worker that made it is not known"
    from torch.utils.data._utils import worker as worker_module
    from torch.utils.data.dataloader import _DatasetKind
    saved, threads = RngState.capture(), torch.get_num_threads()
    info = worker_module._worker_info
    seed = setup.base_seed + worker
    try:
        random.seed(seed)
        torch.manual_seed(seed)
        if worker_module.HAS_NUMPY:
            import numpy
            numpy.random.seed(worker_module._generate_state(setup.base_seed, worker))
        worker_module._worker_info = worker_module.WorkerInfo(
            id=worker, num_workers=setup.workers, seed=seed, dataset=setup.dataset)
        torch.set_num_threads(1)          # as in the worker: reductions sum in its order
        with tracer:
            if setup.init_fn is not None:
                setup.init_fn(worker)
            fetcher = _DatasetKind.create_fetcher(setup.kind, setup.dataset,
                                                  setup.auto_collation, setup.collate_fn,
                                                  setup.drop_last)
            batch = None
            for _, index in record.tasks:
                batch = fetcher.fetch(index)
    except Exception as exc:
        return None, f"making it again in this process raised {type(exc).__name__}: {exc}"
    finally:
        worker_module._worker_info = info
        torch.set_num_threads(threads)
        saved.restore()
    if not same_batch(batch, record.batch):
        return None, ("made again in this process with the worker's seeds, worker_init_fn and "
                      "sampler indices, the batch differs from the one the worker handed out")
    return batch, None
