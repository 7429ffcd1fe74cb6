"""Sample isolation: which rows of a batch reproduce a finding alone, by group testing over
replays in O(k log B), with a budget that grows with the bad rows found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass
class SampleSearch:
    samples: list | None
    replays: int
    coupled: bool
    note: str


class _Budget(Exception):
    pass


def replay_budget(max_replays: int, size: int, rows_found: int) -> int:
    """Replays allowed once `rows_found` bad rows are known: group testing needs about
    2 log2(B) replays per bad row, so the budget grows by that much with every row found
    (3 bad rows in 4096 need ~75 replays, past a flat 64), up to 16x `max_replays`."""
    per_row = 2 * max(1, math.ceil(math.log2(max(size, 2)))) + 2
    return min(max_replays + per_row * rows_found, 16 * max_replays)


def isolate_rows(reproduces: Callable[[list[int]], bool], size: int,
                 max_replays: int = 64) -> SampleSearch:
    """Group testing over the batch rows: O(k log B) replays for k bad rows in a batch of B.

    Every half that reproduces alone is searched further, so all independently bad rows are
    found. When the whole batch reproduces but neither half does, the rows interact: a minimal
    interacting set is searched (ddmin-style), and reported only when it is small.
    """
    replays = 0
    found_so_far: list[int] = []

    def test(rows: list[int]) -> bool:
        nonlocal replays
        if replays >= replay_budget(max_replays, size, len(found_so_far)):
            raise _Budget
        replays += 1
        return reproduces(rows)

    def find_all(rows: list[int]) -> list[int]:
        """All rows that reproduce alone, given that `rows` together do."""
        if len(rows) == 1:
            found_so_far.extend(rows)
            return rows
        left, right = rows[: len(rows) // 2], rows[len(rows) // 2:]
        found = []
        left_bad, right_bad = test(left), test(right)
        if left_bad and right_bad and len(rows) == size:
            # Both halves reproduce: perhaps every row does. Probe before searching them all.
            probe = batch_level_probe(test, size)
            if probe is not None:
                raise _BatchLevel(probe)
        if left_bad:
            found += find_all(left)
        if right_bad:
            found += find_all(right)
        if not found:
            small_left = minimize(left, right)
            raise _Interacting(small_left + minimize(right, small_left))
        return found

    def minimize(part: list[int], context: list[int]) -> list[int]:
        """A small subset of part that, with context, still reproduces."""
        if len(part) <= 1:
            return part
        left, right = part[: len(part) // 2], part[len(part) // 2:]
        if test(sorted(left + context)):
            return minimize(left, context)
        if test(sorted(right + context)):
            return minimize(right, context)
        small_left = minimize(left, sorted(context + right))
        return small_left + minimize(right, sorted(context + small_left))

    rows = list(range(size))
    try:
        found = find_all(rows)
    except KeyboardInterrupt as stop:
        partial = sorted(found_so_far) or None
        raise SearchInterrupted(SampleSearch(
            partial, replays, False, f"interrupted after {replays} replays"
            + (": more rows may be bad" if partial else ""))) from stop
    except _Budget:
        partial = sorted(found_so_far)
        note = (f"gave up after {replays} replays (localize.max_replays {max_replays}, grown "
                f"with the {len(partial)} row(s) found)")
        return SampleSearch(partial or None, replays, False,
                            note + ("; more rows may be bad" if partial else ""))
    except _BatchLevel as batch_level:
        return SampleSearch(None, replays, False, str(batch_level))
    except _Interacting as interacting:
        small = len(interacting.rows) <= max(2, size // 4)
        if small:
            return SampleSearch(sorted(interacting.rows), replays, True,
                                "no single row reproduces alone; these rows do together")
        return SampleSearch(None, replays, True, "the rows are coupled: the value needs most "
                            "of the batch together (a batch statistic: BatchNorm in train mode, "
                            "a loss normalised over the batch)")
    if size > 1 and len(found) > size // 2:
        return SampleSearch(None, replays, False, f"{len(found)} of {size} rows reproduce it "
                            f"alone: the cause is not in particular samples but in the model "
                            f"or the batch as a whole")
    return SampleSearch(sorted(found), replays, False, "")


def batch_level_probe(test: Callable[[list[int]], bool], size: int) -> str | None:
    """When rows spread over the batch (first, middle, last) each reproduce alone, the cause is
    the model or the batch as a whole: say so in 3 replays instead of searching every row."""
    if size < 8:
        return None
    probes = [0, size // 2, size - 1]
    if all(test([row]) for row in probes):
        return (f"rows {probes} each reproduce it alone: the cause is not in particular samples "
                f"but in the model or the batch as a whole")
    return None


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during the search, carrying what it found so far."""

    def __init__(self, search: SampleSearch):
        super().__init__(search.note)
        self.search = search


class _BatchLevel(Exception):
    pass


class _Interacting(Exception):
    def __init__(self, rows):
        super().__init__(rows)
        self.rows = rows
