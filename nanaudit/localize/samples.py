"""Sample isolation: which rows of a batch reproduce a finding alone, by group testing over
replays in O(k log B), with a budget that grows with the bad rows found, feeding each replay a
group the model can take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nanaudit.errors import UserCodeError


@dataclass
class SampleSearch:
    samples: list | None
    replays: int
    coupled: bool
    note: str


class _Budget(Exception):
    pass


@dataclass
class Feeding:
    """How a group of rows becomes the rows a replay is fed, so that the model can take it.

    A group smaller than `min_rows` (2 for BatchNorm in train mode, the whole batch for a model
    that fixes its batch size) is padded with rows known to be good: rows of a tested group
    that did not reproduce. Before any is known it is padded with copies of its own rows. Either
    way the padding adds no row that could be blamed: a padded group reproduces because of its
    own rows.
    """

    size: int
    min_rows: int = 1
    why: str = ""                 # why groups need min_rows rows
    known_good: list = field(default_factory=list)
    with_good: int = 0            # replays padded with known-good rows
    with_copies: int = 0          # ... with copies of the group's own rows

    def rows(self, group: list[int]) -> list[int]:
        need = self.min_rows - len(group)
        if need <= 0:
            return list(group)
        members = set(group)
        good = [r for r in self.known_good if r not in members][:need]
        copies = [group[i % len(group)] for i in range(need - len(good))]
        self.with_good += bool(good)
        self.with_copies += bool(copies)
        return list(group) + good + copies

    def cleared(self, group: list[int]) -> None:
        """A group tested alone (with known-good padding) did not reproduce: its rows are good."""
        known = set(self.known_good)
        self.known_good += [r for r in group if r not in known]

    def whole_batch(self, error: UserCodeError, fed: int) -> None:
        """A sub-batch raised: from now on feed every replay the full batch size."""
        self.min_rows = self.size
        self.why = (f"a sub-batch of {fed} row(s) raised {type(error.exception).__name__} "
                    f"({_first_line(error.exception)}) where the full batch of {self.size} ran: "
                    f"the model takes only its batch size")

    def note(self) -> str:
        if not (self.with_good or self.with_copies):
            return ""
        how = []
        if self.with_good:
            how.append(f"rows known to be good (rows of a tested group that did not reproduce) "
                       f"in {self.with_good} replay(s)")
        if self.with_copies:
            how.append(f"copies of the group's own rows in {self.with_copies} (too few rows "
                       f"known to be good yet)")
        return (f"groups were padded to {self.min_rows} rows ({self.why}) with "
                f"{', '.join(how)}; padding adds no row that could be blamed")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def replay_budget(max_replays: int, size: int, rows_found: int) -> int:
    """Replays allowed once `rows_found` bad rows are known: group testing needs about
    2 log2(B) replays per bad row, so the budget grows by that much with every row found
    (3 bad rows in 4096 need ~75 replays, past a flat 64), up to 16x `max_replays`."""
    per_row = 2 * max(1, math.ceil(math.log2(max(size, 2)))) + 2
    return min(max_replays + per_row * rows_found, 16 * max_replays)


def isolate_rows(reproduces: Callable[[list[int]], bool], size: int,
                 max_replays: int = 64, min_rows: int = 1, min_reason: str = "") -> SampleSearch:
    """Group testing over the batch rows: O(k log B) replays for k bad rows in a batch of B.

    Every half that reproduces alone is searched further, so all independently bad rows are
    found. When the whole batch reproduces but neither half does, the rows interact: a minimal
    interacting set is searched (ddmin-style), and reported only when it is small.

    `reproduces(rows)` replays the batch restricted to `rows` (rows may repeat). Groups smaller
    than `min_rows` are padded (see `Feeding`). A replay that raises (UserCodeError) is run
    again at the full batch size: if that runs, the model fixes its batch size and every replay
    is fed the full size from then on; if it raises too, the error is the user's and propagates,
    naming the rows it was replaying: it is never taken for a verdict on the rows.
    """
    replays = 0
    found_so_far: list[int] = []
    feeding = Feeding(size, min(max(min_rows, 1), size), min_reason)

    def test(rows: list[int], clears: bool = False) -> bool:
        nonlocal replays
        if replays >= replay_budget(max_replays, size, len(found_so_far)):
            raise _Budget
        replays += 1
        fed = feeding.rows(rows)
        try:
            bad = reproduces(fed)
        except UserCodeError as error:
            if feeding.min_rows >= size:
                raise _during_search(error, rows, fed) from error.exception
            feeding.whole_batch(error, len(fed))
            replays += 1
            fed = feeding.rows(rows)
            try:
                bad = reproduces(fed)
            except UserCodeError as again:
                raise _during_search(again, rows, fed) from again.exception
        if clears and not bad:
            feeding.cleared(rows)
        return bad

    def find_all(rows: list[int]) -> list[int]:
        """All rows that reproduce alone, given that `rows` together do."""
        if len(rows) == 1:
            found_so_far.extend(rows)
            return rows
        left, right = rows[: len(rows) // 2], rows[len(rows) // 2:]
        found = []
        left_bad, right_bad = test(left, clears=True), test(right, clears=True)
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
            # Rows that only fail together are not good rows to pad with: from here on a
            # group is padded with copies of its own rows only.
            feeding.known_good.clear()
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

    def noted(text: str) -> str:
        return "; ".join(t for t in (text, feeding.note()) if t)

    rows = list(range(size))
    try:
        found = find_all(rows)
    except KeyboardInterrupt as stop:
        partial = sorted(found_so_far) or None
        raise SearchInterrupted(SampleSearch(
            partial, replays, False, noted(f"interrupted after {replays} replays"
                                           + (": more rows may be bad" if partial else ""))
        )) from stop
    except _Budget:
        partial = sorted(found_so_far)
        note = (f"gave up after {replays} replays (localize.max_replays {max_replays}, grown "
                f"with the {len(partial)} row(s) found)")
        return SampleSearch(partial or None, replays, False,
                            noted(note + ("; more rows may be bad" if partial else "")))
    except _BatchLevel as batch_level:
        return SampleSearch(None, replays, False, noted(str(batch_level)))
    except _Interacting as interacting:
        small = len(interacting.rows) <= max(2, size // 4)
        if small:
            return SampleSearch(sorted(interacting.rows), replays, True,
                                noted("no single row reproduces alone; these rows do together"))
        return SampleSearch(None, replays, True, noted(
            "the rows are coupled: the value needs most of the batch together (a batch "
            "statistic: BatchNorm in train mode, a loss normalised over the batch)"))
    if size > 1 and len(found) > size // 2:
        return SampleSearch(None, replays, False, noted(
            f"{len(found)} of {size} rows reproduce it alone: the cause is not in particular "
            f"samples but in the model or the batch as a whole"))
    return SampleSearch(sorted(found), replays, False, noted(""))


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


def _during_search(error: UserCodeError, group: list[int], fed: list[int]) -> UserCodeError:
    """The user's error, saying it was raised replaying rows for the sample search."""
    def shown(rows):
        return "[" + ", ".join(str(r) for r in rows[:12]) + (", ...]" if len(rows) > 12 else "]")
    padded = f" (fed as {shown(fed)}, {len(fed)} rows)" if fed != group else ""
    return UserCodeError(f"{error.what}, replaying batch rows {shown(group)}{padded} for the "
                         f"sample search", error.exception)


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
