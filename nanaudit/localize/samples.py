"""Sample isolation: which rows of a batch reproduce a finding alone, by group testing over
replays in O(k log B), with a budget that grows with the bad rows found, feeding each replay a
group the model can take.

Every half that reproduces alone is searched further, so all independently bad rows are found.
When a group reproduces but neither of its halves does, the rows interact: a minimal interacting
set is searched (ddmin-style), and reported only when it is small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from nanaudit.errors import UserCodeError


@dataclass
class IsolatedRows:
    """What the search concluded: the rows to blame (None: no particular rows), the replays it
    spent, whether the rows reproduce only together, and why (the report's sample_search note)."""

    samples: list | None
    replays: int
    coupled: bool
    note: str


class OutOfReplays(Exception):
    """The budget refused another replay: the search ends with the rows found so far."""


class ReplayBudget:
    """The replays a search may spend. Group testing needs about 2 log2(B) replays per bad row,
    so the budget grows by that much with every row found (3 bad rows in 4096 need ~75 replays,
    past a flat 64), up to 16x `max_replays`."""

    def __init__(self, max_replays: int, size: int):
        self.max_replays, self.size = max_replays, size
        self.spent = 0

    def limit(self, rows_found: int) -> int:
        """Replays allowed once `rows_found` bad rows are known."""
        per_row = 2 * max(1, math.ceil(math.log2(max(self.size, 2)))) + 2
        return min(self.max_replays + per_row * rows_found, 16 * self.max_replays)

    def spend(self, rows_found: int) -> None:
        """One more replay, or OutOfReplays when the limit is reached."""
        if self.spent >= self.limit(rows_found):
            raise OutOfReplays
        self.spent += 1

    def spend_again(self) -> None:
        """The same group replayed again at the full batch size: counted, never refused."""
        self.spent += 1


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


class Verdict(NamedTuple):
    """How the group testing ended: `alone` (rows that each reproduce alone), `together` (a
    small set that reproduces only together) or `batch` (the cause is the batch as a whole)."""

    how: str
    rows: list[int]
    note: str = ""


def halves(rows: list[int]) -> tuple[list[int], list[int]]:
    return rows[: len(rows) // 2], rows[len(rows) // 2:]


class RowIsolation:
    """Group testing over the batch rows: O(k log B) replays for k bad rows in a batch of B.

    `reproduces(rows)` replays the batch restricted to `rows` (rows may repeat). Groups smaller
    than `min_rows` are padded (see `Feeding`). A replay that raises (UserCodeError) is run
    again at the full batch size: if that runs, the model fixes its batch size and every replay
    is fed the full size from then on; if it raises too, the error is the user's and propagates,
    naming the rows it was replaying: it is never taken for a verdict on the rows.
    """

    def __init__(self, reproduces: Callable[[list[int]], bool], size: int,
                 max_replays: int = 64, min_rows: int = 1, min_reason: str = ""):
        self.reproduces, self.size = reproduces, size
        self.budget = ReplayBudget(max_replays, size)
        self.feeding = Feeding(size, min(max(min_rows, 1), size), min_reason)
        self.found: list[int] = []          # rows found to reproduce alone, so far

    def test(self, rows: list[int], clears: bool = False) -> bool:
        """Does the group `rows` reproduce? With `clears`, a group that does not is known good
        (padding for later groups)."""
        self.budget.spend(len(self.found))
        fed = self.feeding.rows(rows)
        try:
            bad = self.reproduces(fed)
        except UserCodeError as error:
            if self.feeding.min_rows >= self.size:
                raise _during_search(error, rows, fed) from error.exception
            self.feeding.whole_batch(error, len(fed))
            self.budget.spend_again()
            fed = self.feeding.rows(rows)
            try:
                bad = self.reproduces(fed)
            except UserCodeError as again:
                raise _during_search(again, rows, fed) from again.exception
        if clears and not bad:
            self.feeding.cleared(rows)
        return bad

    def find_all(self) -> Verdict:
        """All rows that reproduce alone, given that the whole batch does: each group that
        reproduces is halved, depth first, left half first."""
        groups = [list(range(self.size))]
        while groups:
            rows = groups.pop()
            if len(rows) == 1:
                self.found.extend(rows)
                continue
            left, right = halves(rows)
            left_bad, right_bad = self.test(left, clears=True), self.test(right, clears=True)
            if left_bad and right_bad and len(rows) == self.size:
                # Both halves reproduce: perhaps every row does. Probe before searching them all.
                probe = batch_level_probe(self.test, self.size)
                if probe is not None:
                    return Verdict("batch", [], probe)
            if not (left_bad or right_bad):
                # Rows that only fail together are not good rows to pad with: from here on a
                # group is padded with copies of its own rows only.
                self.feeding.known_good.clear()
                small_left = self.minimize(left, right)
                return Verdict("together", small_left + self.minimize(right, small_left))
            groups += [half for half, bad in ((right, right_bad), (left, left_bad)) if bad]
        return Verdict("alone", list(self.found))

    def minimize(self, part: list[int], context: list[int]) -> list[int]:
        """A small subset of `part` that, with `context`, still reproduces."""
        if len(part) <= 1:
            return part
        left, right = halves(part)
        if self.test(sorted(left + context)):
            return self.minimize(left, context)
        if self.test(sorted(right + context)):
            return self.minimize(right, context)
        small_left = self.minimize(left, sorted(context + right))
        return small_left + self.minimize(right, sorted(context + small_left))

    def run(self) -> IsolatedRows:
        """The search, ended by its verdict, the budget, or Ctrl-C (SearchInterrupted, carrying
        the rows found so far)."""
        try:
            verdict = self.find_all()
        except KeyboardInterrupt as stop:
            partial = sorted(self.found) or None
            raise SearchInterrupted(self.result(
                partial, False, f"interrupted after {self.budget.spent} replays"
                                + (": more rows may be bad" if partial else ""))) from stop
        except OutOfReplays:
            partial = sorted(self.found)
            note = (f"gave up after {self.budget.spent} replays (localize.max_replays "
                    f"{self.budget.max_replays}, grown with the {len(partial)} row(s) found)")
            return self.result(partial or None, False,
                               note + ("; more rows may be bad" if partial else ""))
        return self.conclude(verdict)

    def conclude(self, verdict: Verdict) -> IsolatedRows:
        """The rows to blame for a verdict: none when they are most of the batch."""
        if verdict.how == "batch":
            return self.result(None, False, verdict.note)
        if verdict.how == "together":
            if len(verdict.rows) <= max(2, self.size // 4):
                return self.result(sorted(verdict.rows), True,
                                   "no single row reproduces alone; these rows do together")
            return self.result(None, True, (
                "the rows are coupled: the value needs most of the batch together (a batch "
                "statistic: BatchNorm in train mode, a loss normalised over the batch)"))
        found = verdict.rows
        if self.size > 1 and len(found) > self.size // 2:
            return self.result(None, False, (
                f"{len(found)} of {self.size} rows reproduce it alone: the cause is not in "
                f"particular samples but in the model or the batch as a whole"))
        return self.result(sorted(found), False, "")

    def result(self, samples: list | None, coupled: bool, text: str) -> IsolatedRows:
        """The conclusion, its note followed by how groups were padded."""
        note = "; ".join(t for t in (text, self.feeding.note()) if t)
        return IsolatedRows(samples, self.budget.spent, coupled, note)


def isolate_rows(reproduces: Callable[[list[int]], bool], size: int,
                 max_replays: int = 64, min_rows: int = 1, min_reason: str = "") -> IsolatedRows:
    """The rows of a batch of `size` that reproduce a finding (see RowIsolation)."""
    return RowIsolation(reproduces, size, max_replays, min_rows, min_reason).run()


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
    def shown(rows: list[int]) -> str:
        return "[" + ", ".join(str(r) for r in rows[:12]) + (", ...]" if len(rows) > 12 else "]")
    padded = f" (fed as {shown(fed)}, {len(fed)} rows)" if fed != group else ""
    return UserCodeError(f"{error.what}, replaying batch rows {shown(group)}{padded} for the "
                         f"sample search", error.exception)


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during the search, carrying what it found so far."""

    def __init__(self, search: IsolatedRows):
        super().__init__(search.note)
        self.search = search
