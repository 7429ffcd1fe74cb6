"""The parts of the sample search one by one: the budget, the test of a group, finding every
row that reproduces alone, minimizing rows that reproduce only together, and the conclusion."""

import pytest

from nanaudit.errors import UserCodeError
from nanaudit.localize.samples import (
    OutOfReplays,
    ReplayBudget,
    RowIsolation,
    SearchInterrupted,
    Verdict,
    halves,
)


def _oracle(bad, need_all=False):
    calls = []

    def reproduces(rows):
        calls.append(list(rows))
        hit = set(rows) & set(bad)
        return hit == set(bad) if need_all else bool(hit)
    return reproduces, calls


# --- the budget ---------------------------------------------------------------------------------

def test_the_budget_grows_with_every_row_found_up_to_sixteen_times():
    budget = ReplayBudget(64, 4096)
    per_row = 2 * 12 + 2                      # 2 log2(4096) + 2
    assert budget.limit(0) == 64
    assert budget.limit(3) == 64 + 3 * per_row
    assert budget.limit(1000) == 16 * 64
    assert ReplayBudget(4, 1).limit(1) == 4 + 2 * 1 + 2   # a batch of one counts as two


def test_the_budget_refuses_the_replay_past_its_limit_but_not_a_retry():
    budget = ReplayBudget(2, 8)
    budget.spend(0)
    budget.spend(0)
    with pytest.raises(OutOfReplays):
        budget.spend(0)
    assert budget.spent == 2
    budget.spend(1)                           # a row found: the limit grew
    assert budget.spent == 3
    budget.spend_again()                      # the same group at full size: never refused
    assert budget.spent == 4


# --- the test of a group ------------------------------------------------------------------------

def test_a_group_test_counts_a_replay_and_feeds_the_group():
    reproduces, calls = _oracle({3})
    search = RowIsolation(reproduces, 8)
    assert search.test([2, 3]) is True and search.test([4]) is False
    assert calls == [[2, 3], [4]] and search.budget.spent == 2
    assert search.feeding.known_good == []    # not cleared: `clears` was not asked


def test_a_clean_group_tested_with_clears_becomes_padding_for_small_groups():
    reproduces, calls = _oracle({5})
    search = RowIsolation(reproduces, 8, min_rows=3)
    assert search.test([0, 1, 2, 3], clears=True) is False
    assert search.feeding.known_good == [0, 1, 2, 3]
    assert search.test([5], clears=True) is True
    assert calls[-1] == [5, 0, 1]             # padded with known-good rows, not copies
    assert search.feeding.known_good == [0, 1, 2, 3]


def test_a_group_that_raises_is_replayed_at_the_full_batch_size_from_then_on():
    fed = []

    def reproduces(rows):
        fed.append(len(rows))
        if len(rows) < 8:
            raise UserCodeError("loss `case:loss`", RuntimeError("shape '[8, -1]' is invalid"))
        return 5 in rows
    search = RowIsolation(reproduces, 8)
    assert search.test([4, 5, 6, 7]) is True
    assert fed == [4, 8] and search.budget.spent == 2
    assert search.feeding.min_rows == 8 and "RuntimeError" in search.feeding.why
    search.test([0, 1])
    assert fed[-1] == 8


def test_an_error_at_the_full_batch_size_is_the_users_naming_the_rows():
    def reproduces(rows):
        raise UserCodeError("loss `case:loss`", AssertionError("no positives"))
    search = RowIsolation(reproduces, 4)
    with pytest.raises(UserCodeError, match=r"replaying batch rows \[0, 1\] \(fed as "
                                            r"\[0, 1, 0, 1\], 4 rows\) for the sample search"):
        search.test([0, 1])


# --- finding every row that reproduces alone ----------------------------------------------------

def test_find_all_halves_depth_first_and_finds_every_bad_row():
    reproduces, calls = _oracle({1, 6})
    search = RowIsolation(reproduces, 8)
    assert search.find_all() == Verdict("alone", [1, 6])
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7],      # the batch's halves
                     [0],                             # both bad: the batch-level probe, no
                     [0, 1], [2, 3], [0], [1],        # the left half, to its bad row
                     [4, 5], [6, 7], [6], [7]]        # then the right half
    assert search.found == [1, 6]


def test_find_all_names_rows_that_reproduce_only_together():
    reproduces, _ = _oracle({2, 13}, need_all=True)
    search = RowIsolation(reproduces, 16)
    verdict = search.find_all()
    assert verdict.how == "together" and sorted(verdict.rows) == [2, 13]
    assert search.found == []


def test_find_all_says_batch_level_when_rows_spread_over_the_batch_each_reproduce():
    reproduces, calls = _oracle(set(range(16)))
    verdict = RowIsolation(reproduces, 16).find_all()
    assert verdict.how == "batch" and "rows [0, 8, 15] each reproduce it alone" in verdict.note
    assert calls[2:] == [[0], [8], [15]]


def test_halves_split_at_the_middle():
    assert halves([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    assert halves([7]) == ([], [7])


# --- minimizing ---------------------------------------------------------------------------------

def test_minimize_keeps_only_the_rows_needed_with_the_context():
    reproduces, calls = _oracle({1, 6, 9}, need_all=True)
    search = RowIsolation(reproduces, 16)
    assert sorted(search.minimize([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10])) == [1, 6]
    assert all(set(c) >= {8, 9, 10} for c in calls)   # the context is in every replay
    assert len(calls) <= 2 * 2 * 3                    # ~2 log2(8) replays per row kept


def test_minimize_of_a_single_row_replays_nothing():
    reproduces, calls = _oracle({0})
    assert RowIsolation(reproduces, 4).minimize([3], [0]) == [3] and calls == []


# --- the conclusion ------------------------------------------------------------------------------

def test_conclusions_of_each_verdict():
    search = RowIsolation(lambda rows: True, 16)
    assert search.conclude(Verdict("alone", [9, 2])).samples == [2, 9]
    many = search.conclude(Verdict("alone", list(range(9))))
    assert many.samples is None and "9 of 16 rows reproduce it alone" in many.note
    together = search.conclude(Verdict("together", [5, 1]))
    assert together.samples == [1, 5] and together.coupled
    coupled = search.conclude(Verdict("together", list(range(5))))   # more than 16 // 4
    assert coupled.samples is None and coupled.coupled and "coupled" in coupled.note
    batch = search.conclude(Verdict("batch", [], "rows [0, 8, 15] each reproduce it alone"))
    assert batch.samples is None and batch.note == "rows [0, 8, 15] each reproduce it alone"


def test_run_out_of_replays_keeps_the_rows_found():
    reproduces, _ = _oracle({0, 1, 2, 3, 60})
    search = RowIsolation(reproduces, 64, max_replays=8)
    search.budget.limit = lambda rows_found: 14   # a flat limit, reached after the first rows
    result = search.run()
    assert result.replays == 14 and result.samples == search.found == [0, 1]
    assert result.note.startswith(f"gave up after {result.replays} replays (localize."
                                  f"max_replays 8, grown with the {len(result.samples)} row(s)")
    assert result.note.endswith("; more rows may be bad")


def test_ctrl_c_carries_the_rows_found_so_far():
    def reproduces(rows):
        if len(rows) == 1 and rows[0] > 3:
            raise KeyboardInterrupt
        return bool({1, 6} & set(rows))
    with pytest.raises(SearchInterrupted) as stopped:
        RowIsolation(reproduces, 8).run()
    search = stopped.value.search
    assert search.samples == [1] and search.replays == 10    # the interrupted one counts
    assert search.note == "interrupted after 10 replays: more rows may be bad"
