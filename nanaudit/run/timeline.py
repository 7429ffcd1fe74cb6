"""The timeline of a run of any length, in bounded memory: what every checker records a step in.

A NaN at step 800,000 of a week-long run is the case nanaudit exists for, and a timeline that
keeps every step grows without bound in memory and in the report. `Timeline` keeps the first
`head` steps and the last `tail` steps (a ring buffer: the steps before the finding) at full
resolution, and folds each step that leaves the ring into summary buckets, as a downsampling
histogram does: a bucket holds `width` consecutive steps as each series' min, max and last
value; when there are more than `buckets` of them, neighbours merge in pairs and `width`
doubles. Memory and the report's size stay bounded whatever the step count, and a spike is
never dropped in silence: it is its bucket's max. Bucket edges depend only on the count of
steps, so two runs of the same steps summarize them alike.

A Timeline reads as the sequence of its kept entries (`len`, indexing, slices, iteration, in
step order); `steps` counts every step appended; `summary()` is the report's section.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from nanaudit.report.model import SeriesRange, TimelineBucket, TimelineEntry, TimelineSummary

HEAD = 100          # steps kept from the start of a run
TAIL = 1000         # steps kept before its end (the finding)
BUCKETS = 256       # summary buckets at most between them

# TimelineEntry's number series, in TimelineBucket's order; read in one C call per step.
SERIES = ("loss", "grad_norm", "param_norm", "lr", "time_ms", "scale", "update_ratio",
          "act_max", "act_ratio")
_VALUES = operator.attrgetter(*SERIES)


class _Bucket:
    """The running summary of consecutive steps (see TimelineBucket)."""

    __slots__ = ("count", "first", "high", "last", "latest", "low", "skipped")

    def __init__(self, entry: TimelineEntry, values: tuple) -> None:
        self.first = self.last = entry.step
        self.count, self.skipped = 1, int(entry.skipped)
        # NaN (v != v) has no place in min and max; `latest` keeps it as the last value.
        self.low = [None if v is None or v != v else v for v in values]
        self.high = list(self.low)
        self.latest = list(values)

    def add(self, entry: TimelineEntry, values: tuple) -> None:
        self.last = entry.step
        self.count += 1
        if entry.skipped:
            self.skipped += 1
        low, high, latest = self.low, self.high, self.latest
        for i, v in enumerate(values):
            if v is None:
                continue
            latest[i] = v
            if v != v:
                continue
            if low[i] is None or v < low[i]:
                low[i] = v
            if high[i] is None or v > high[i]:
                high[i] = v

    def merge(self, later: _Bucket) -> None:
        """Take in the bucket of the steps that follow this one's."""
        self.last = later.last
        self.count += later.count
        self.skipped += later.skipped
        for i in range(len(SERIES)):
            self.low[i] = _pick(min, self.low[i], later.low[i])
            self.high[i] = _pick(max, self.high[i], later.high[i])
            if later.latest[i] is not None:
                self.latest[i] = later.latest[i]

    def record(self) -> TimelineBucket:
        series = [None if latest is None else SeriesRange(low, high, latest)
                  for low, high, latest in zip(self.low, self.high, self.latest)]
        return TimelineBucket(self.first, self.last, self.count, self.skipped, *series)


def _pick(choose: Any, a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else choose(a, b)


class Timeline(Sequence):
    """A run's timeline in bounded memory (see the module docstring): `append` each step's
    entry; read the kept entries as a sequence; `summary()` for the steps between them."""

    def __init__(self, head: int | None = None, tail: int | None = None,
                 buckets: int | None = None, entries: Iterable[TimelineEntry] = ()):
        # The module's budget, read now (not when this was defined): one place sets it.
        head = HEAD if head is None else head
        tail = TAIL if tail is None else tail
        buckets = BUCKETS if buckets is None else buckets
        if head < 0 or tail < 1 or buckets < 2:
            raise ValueError(f"a timeline keeps head >= 0, tail >= 1 and buckets >= 2 "
                             f"(got {head}, {tail}, {buckets})")
        self.head, self.tail, self.max_buckets = head, tail, buckets
        self.steps = 0                   # every entry appended since the start (or clear)
        self._head: list[TimelineEntry] = []
        self._tail: deque[TimelineEntry] = deque()
        self._buckets: list[_Bucket] = []
        self._width = 1                  # steps per bucket
        for entry in entries:
            self.append(entry)

    def append(self, entry: TimelineEntry) -> None:
        self.steps += 1
        if len(self._head) < self.head:
            self._head.append(entry)
            return
        tail = self._tail
        if len(tail) == self.tail:
            self._fold(tail.popleft())
        tail.append(entry)

    def replace_last(self, entry: TimelineEntry) -> None:
        """Put `entry` in place of the last one (a later evaluation of the same step)."""
        if self._tail:
            self._tail[-1] = entry
        elif self._head:
            self._head[-1] = entry
        else:
            raise IndexError("replace_last on an empty timeline")

    def clear(self) -> None:
        self.steps, self._width = 0, 1
        self._head.clear()
        self._tail.clear()
        self._buckets.clear()

    def _fold(self, entry: TimelineEntry) -> None:
        values = _VALUES(entry)
        buckets = self._buckets
        if buckets and buckets[-1].count < self._width:
            buckets[-1].add(entry, values)
            return
        buckets.append(_Bucket(entry, values))
        if len(buckets) > self.max_buckets:
            merged = buckets[::2]
            for first, second in zip(merged, buckets[1::2]):
                first.merge(second)
            self._buckets = merged
            self._width *= 2

    # --- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __iter__(self) -> Iterator[TimelineEntry]:
        return itertools.chain(self._head, self._tail)

    @overload
    def __getitem__(self, index: int) -> TimelineEntry: ...

    @overload
    def __getitem__(self, index: slice) -> list[TimelineEntry]: ...

    def __getitem__(self, index: int | slice) -> TimelineEntry | list[TimelineEntry]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        kept = len(self)
        if index < 0:
            index += kept
        if not 0 <= index < kept:
            raise IndexError("timeline index out of range")
        head = len(self._head)
        return self._head[index] if index < head else self._tail[index - head]

    def entries(self) -> list[TimelineEntry]:
        """The kept entries, in step order (the report's `timeline`)."""
        return [*self._head, *self._tail]

    @property
    def summarized(self) -> int:
        """The steps in the summary buckets (in no kept entry)."""
        return sum(b.count for b in self._buckets)

    def summary(self) -> TimelineSummary | None:
        """The report's `timeline_summary`: None while every step is kept."""
        if not self._buckets:
            return None
        return TimelineSummary(steps=self.summarized, head=len(self._head),
                               tail=len(self._tail), buckets=[b.record() for b in self._buckets])


def report_timeline(timeline: Sequence[TimelineEntry]) -> tuple[list, TimelineSummary | None]:
    """(the report's `timeline`, its `timeline_summary`) of a Timeline, or of a plain list."""
    if isinstance(timeline, Timeline):
        return timeline.entries(), timeline.summary()
    return list(timeline), None
