"""The data of the step loop: the batches it takes from the user's iterator, counted, and under
torchrun the next one taken early so that every rank learns together that one ran out.

A small object of its own so that the step strategies can take what they need of it (the batch
count, the early fetch) without reaching back into the loop that drives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanaudit.errors import USER_FAILURES, ConfigError, UserCodeError

# What `fetch` gives when the data (or, under torchrun, any rank's) ran out.
DATA_END = object()
_NOTHING = object()     # no batch fetched ahead


def next_batch(iterator: Iterator, what: str) -> Any:
    """The next batch, or DATA_END when the data is exhausted (under torchrun every rank must
    know before the step's exchange); the user's iterator raising is their error."""
    try:
        return next(iterator)
    except StopIteration:
        return DATA_END
    except (KeyboardInterrupt, UserCodeError, ConfigError):
        raise
    except USER_FAILURES as exc:
        raise UserCodeError(what, exc) from exc


class DataFeed:
    """The loop's batches: `fetch` the next, `fetch_ahead` under torchrun, and how many were
    taken so far (a batch's data index)."""

    def __init__(self, what: str) -> None:
        self.what = what                        # the data as messages name it
        self.iterator: Iterator = iter(())      # the data's, once the loop starts it
        self.ahead: Any = _NOTHING              # under torchrun: the next batch, fetched early
        self.fetched = 0                        # batches taken from the data so far

    def fetch(self) -> Any:
        """The next raw batch, or DATA_END when the data (or, under torchrun, any rank's) ran
        out."""
        if self.ahead is not _NOTHING:
            batch, self.ahead = self.ahead, _NOTHING
        else:
            batch = next_batch(self.iterator, self.what)
        if batch is not DATA_END:
            self.fetched += 1
        return batch

    def fetch_ahead(self, last: bool) -> bool:
        """Under torchrun, take the next batch now, before the step's exchange, so that every
        rank learns together that one ran out. Returns whether this rank's data is exhausted."""
        self.ahead = DATA_END if last else next_batch(self.iterator, self.what)
        return self.ahead is DATA_END

    def stop_after_this_step(self) -> None:
        """A rank ran out of data: every rank stops after this step."""
        self.ahead = DATA_END

    def window(self, size: int) -> list | None:
        """The raw batches of one optimizer step, or None at the end of the data. A last window
        the data cannot fill is not run: a loop that steps every N micro-batches never applies
        it either."""
        if size == 1:                   # the common case, without the loop
            raw = self.fetch()
            return None if raw is DATA_END else [raw]
        raws = []
        for _ in range(size):
            raw = self.fetch()
            if raw is DATA_END:
                return None
            raws.append(raw)
        return raws
