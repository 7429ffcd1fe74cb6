"""`nanaudit run` past its timeline budget: the report keeps the first and last steps, summarizes
the middle, keeps every warning, and the re-run still checks it followed the first run on the
steps both kept (the budget is shrunk here so that a few hundred steps are a long run)."""

from __future__ import annotations

import textwrap

import pytest

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.report.model import TimelineEntry
from nanaudit.run import timeline as timeline_module
from nanaudit.run.timeline import Timeline
from nanaudit.script.protocol import RerunResult
from nanaudit.script.rerun import compare_losses
from nanaudit.script.target import ScriptOptions, ScriptTarget

LONG_LOOP = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(400):
        x = torch.randn(16, 4)
        gain = torch.zeros(()) if step == 350 else torch.ones(())
        loss = model(x).pow(2).mean() + torch.log(gain)     # log(0) = -inf at step 350
        if step == 200:
            loss = loss * 50.0                 # a spike in the middle of the run
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(timeline_module, "HEAD", 20)
    monkeypatch.setattr(timeline_module, "TAIL", 50)
    monkeypatch.setattr(timeline_module, "BUCKETS", 8)


@pytest.mark.slow
def test_a_long_run_keeps_its_ends_summarizes_the_middle_and_is_still_localized(
        tmp_path, small_budget):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(LONG_LOOP))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(force_rerun=True))
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.op, f.cause) == (350, "aten.log.default",
                                                                   "log-domain")
    # The re-run (with the default budget) matched the first run on the steps it kept.
    assert report.run.rerun.status == "reproduced"
    assert report.steps_run == report.run.first_run.steps == 351
    assert [e.step for e in report.timeline] == list(range(20)) + list(range(301, 351))
    summary = report.timeline_summary
    assert summary.steps == 281 and summary.buckets[0].first_step == 20
    assert summary.buckets[-1].last_step == 300 and len(summary.buckets) <= 8
    spike = next(w for w in report.warnings if w.kind == "loss-spike")
    assert spike.step == 200
    bucket = next(b for b in summary.buckets if b.first_step <= 200 <= b.last_step)
    assert bucket.loss.max == pytest.approx(spike.value)


def test_the_rerun_is_compared_on_the_steps_both_timelines_kept():
    def timeline(changed: int | None) -> Timeline:
        kept = Timeline(head=5, tail=10, buckets=4)
        for step in range(100):
            loss = 2.0 if step == changed else 1.0
            kept.append(TimelineEntry(step, loss, 1.0, 1.0, 0.1, 1.0))
        return kept
    first = timeline(None)
    assert compare_losses(first, RerunResult(timeline=timeline(None), reached=True), 99) is None
    at_the_end = compare_losses(first, RerunResult(timeline=timeline(95), reached=True), 99)
    assert at_the_end is not None and "at step 95" in at_the_end
    at_the_start = compare_losses(first, RerunResult(timeline=timeline(2), reached=True), 99)
    assert at_the_start is not None and "at step 2" in at_the_start
    # The trip's own step is not compared, nor a step neither timeline kept.
    assert compare_losses(first, RerunResult(timeline=timeline(99), reached=True), 99) is None
