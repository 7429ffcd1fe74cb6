"""The bounded timeline (run/timeline.py): the first and last steps whole, the middle as buckets
of min, max and last, nothing silently dropped, bounded at any step count. Pure Python."""

from __future__ import annotations

import json
import math

import pytest

from nanaudit.report.model import Report, TimelineEntry, report_to_dict
from nanaudit.report.vocabulary import Status
from nanaudit.run.timeline import SERIES, Timeline, report_timeline
from nanaudit.run.watch import TimelineWarnings, timeline_warnings


def entry(step: int, loss: float | None = None, **fields) -> TimelineEntry:
    values = dict(loss=1.0 / (step + 1) if loss is None else loss, grad_norm=0.5,
                  param_norm=4.0, lr=0.1, time_ms=1.0)
    return TimelineEntry(step=step, **{**values, **fields})


def filled(steps: int, head: int = 10, tail: int = 20, buckets: int = 8, **special) -> Timeline:
    timeline = Timeline(head=head, tail=tail, buckets=buckets)
    for step in range(steps):
        timeline.append(special.get(f"s{step}") or entry(step))
    return timeline


def test_a_short_run_is_kept_whole_and_reads_as_a_list():
    timeline = filled(25, head=10, tail=20)
    assert timeline.steps == 25 and len(timeline) == 25 and timeline.summary() is None
    assert [e.step for e in timeline] == list(range(25))
    assert timeline[0].step == 0 and timeline[-1].step == 24 and timeline[12].step == 12
    assert [e.step for e in timeline[-2:]] == [23, 24] and timeline[3:5] == [timeline[3], timeline[4]]
    assert report_timeline(timeline) == (timeline.entries(), None)
    with pytest.raises(IndexError):
        timeline[25]


def test_the_start_and_the_last_steps_stay_whole_and_the_middle_is_summarized():
    timeline = filled(1000, head=10, tail=20, buckets=8)
    kept = [e.step for e in timeline]
    assert kept == list(range(10)) + list(range(980, 1000))
    assert timeline.steps == 1000 and timeline.summarized == 970
    summary = timeline.summary()
    assert (summary.steps, summary.head, summary.tail) == (970, 10, 20)
    buckets = summary.buckets
    assert 4 <= len(buckets) <= 8
    # The buckets tile the middle: consecutive, in order, every step in exactly one.
    assert buckets[0].first_step == 10 and buckets[-1].last_step == 979
    assert all(a.last_step + 1 == b.first_step for a, b in zip(buckets, buckets[1:]))
    assert sum(b.count for b in buckets) == 970
    assert all(b.count == b.last_step - b.first_step + 1 for b in buckets)
    # All of one width but the last.
    assert len({b.count for b in buckets[:-1]}) == 1 and buckets[-1].count <= buckets[0].count


def test_a_bucket_carries_the_min_max_and_last_of_each_series():
    timeline = filled(200, head=0, tail=10, buckets=64)   # 190 steps in buckets of 4
    first = timeline.summary().buckets[0]
    assert (first.first_step, first.last_step, first.count) == (0, 3, 4)
    assert first.loss.min == 1.0 / 4 and first.loss.max == 1.0 and first.loss.last == 1.0 / 4
    assert first.grad_norm.min == first.grad_norm.max == first.grad_norm.last == 0.5
    assert first.scale is None and first.act_max is None and first.skipped == 0
    assert set(SERIES) <= set(vars(first))


def test_a_spike_and_a_dip_in_the_middle_survive_any_number_of_merges():
    timeline = filled(100_000, s53211=entry(53_211, loss=1e6), s71003=entry(71_003, loss=-3.0))
    buckets = timeline.summary().buckets
    spike = next(b for b in buckets if b.first_step <= 53_211 <= b.last_step)
    dip = next(b for b in buckets if b.first_step <= 71_003 <= b.last_step)
    assert spike.loss.max == 1e6 and dip.loss.min == -3.0
    assert max(b.loss.max for b in buckets) == 1e6


def test_nan_stays_out_of_min_and_max_but_shows_as_last_and_inf_is_kept():
    timeline = Timeline(head=0, tail=1, buckets=4)
    for step, value in enumerate([2.0, float("nan"), math.inf, 1.0, float("nan"), 0.0]):
        timeline.append(entry(step, grad_norm=None, loss=value, skipped=step == 4))
    # Steps 0..4 left the one-step ring: five buckets of one merged into [0-1] [2-3] [4].
    first, second, third = timeline.summary().buckets
    assert [(b.first_step, b.count) for b in (first, second, third)] == [(0, 2), (2, 2), (4, 1)]
    assert first.loss.min == first.loss.max == 2.0 and math.isnan(first.loss.last)
    assert second.loss.min == 1.0 and second.loss.max == math.inf and second.loss.last == 1.0
    assert third.loss.min is None and third.loss.max is None and math.isnan(third.loss.last)
    assert third.skipped == 1 and first.skipped == 0 and first.grad_norm is None


def test_memory_stays_bounded_at_a_hundred_thousand_steps():
    timeline = Timeline()             # the default budget
    sizes = {}
    for step in range(100_000):
        timeline.append(entry(step))
        if step + 1 in (5_000, 100_000):
            report = Report(tool_version="0", config={}, torch_version="", device="cpu",
                            status=Status.CLEAN, steps_run=timeline.steps)
            report.timeline, report.timeline_summary = report_timeline(timeline)
            sizes[step + 1] = len(json.dumps(report_to_dict(report)))
    assert len(timeline) == timeline.head + timeline.tail
    assert len(timeline.summary().buckets) <= timeline.max_buckets
    assert timeline.summarized + len(timeline) == 100_000
    assert sizes[100_000] < 1.5 * sizes[5_000] and sizes[100_000] < 1_000_000


def test_bucket_edges_depend_only_on_the_count_of_steps():
    one, two = filled(5_000), filled(5_000)
    assert [(b.first_step, b.last_step) for b in one.summary().buckets] == \
        [(b.first_step, b.last_step) for b in two.summary().buckets]


def test_replace_last_and_clear():
    timeline = filled(40)
    timeline.replace_last(entry(39, loss=float("nan")))
    assert math.isnan(timeline[-1].loss) and timeline.steps == 40
    timeline.clear()
    assert timeline.steps == 0 and len(timeline) == 0 and timeline.summary() is None
    timeline.append(entry(0))
    assert [e.step for e in timeline] == [0]


def test_the_early_warnings_of_a_long_run_are_kept_with_their_steps():
    # Read online (`nanaudit run` keeps no whole timeline to read them off at the end): the
    # same warnings as from the whole list, a mid-run spike with its step.
    entries = [entry(step, loss=2.0 - 1e-5 * step + (40.0 if step == 20_000 else 0.0))
               for step in range(30_000)]
    online, timeline = TimelineWarnings(), filled(0)
    for e in entries:
        online.observe(e)
        timeline.append(e)
    assert [(w.kind, w.step) for w in online.warnings] == [("loss-spike", 20_000)]
    assert online.warnings == timeline_warnings(entries)
    assert max(b.loss.max for b in timeline.summary().buckets) == pytest.approx(41.8, abs=0.01)


def test_the_budget_is_checked():
    with pytest.raises(ValueError, match="tail >= 1"):
        Timeline(tail=0)
