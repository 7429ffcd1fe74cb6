"""A long run's report: the kept timeline entries plus the summary of the steps between them,
in the JSON (new keys only) and in every renderer (the plot draws the buckets as bands)."""

from __future__ import annotations

import importlib.util
import json
import math
import xml.etree.ElementTree as ET
from dataclasses import fields

import pytest
from rich.console import Console

from nanaudit.report.console import print_report
from nanaudit.report.formats import renderer_for
from nanaudit.report.model import (
    EarlyWarning,
    Finding,
    Report,
    TimelineBucket,
    TimelineEntry,
    report_to_dict,
)
from nanaudit.report.vocabulary import Status
from nanaudit.run.timeline import Timeline, report_timeline

SPIKE = 1234


def long_report(steps: int = 3000) -> Report:
    timeline = Timeline(head=20, tail=40, buckets=16)
    for step in range(steps):
        loss = 5.0 if step == SPIKE else 1.0 / (step + 1) ** 0.5
        grad_norm = math.nan if step == 2000 else 0.5 + step * 1e-3
        timeline.append(TimelineEntry(step, loss, grad_norm, 4.0, 0.1, 0.3,
                                      update_ratio=1e-3 if step % 10 == 0 else None,
                                      skipped=step == 2000))
    finding = Finding(step=steps - 1, where="backward", value="nan", cause="divergence",
                      explanation="the gradient norm grew", fix="lower the learning rate")
    report = Report(tool_version="0.1.0", config={"path": "train.py"}, torch_version="2.13",
                    device="cpu", status=Status.NONFINITE, steps_run=timeline.steps,
                    command="run", finding=finding,
                    warnings=[EarlyWarning("loss-spike", SPIKE, SPIKE, "the loss jumped")])
    report.timeline, report.timeline_summary = report_timeline(timeline)
    return report


def test_the_json_adds_the_summary_and_keeps_the_old_keys():
    body = json.loads(renderer_for("json").render(long_report()))
    assert body["steps_run"] == 3000 and body["status"] == "nonfinite"
    entry_keys = [f.name for f in fields(TimelineEntry)]
    assert all(list(e) == entry_keys for e in body["timeline"])
    steps = [e["step"] for e in body["timeline"]]
    assert steps == list(range(20)) + list(range(2960, 3000))
    summary = body["timeline_summary"]
    assert list(summary) == ["steps", "head", "tail", "buckets"]
    assert (summary["steps"], summary["head"], summary["tail"]) == (2940, 20, 40)
    assert len(body["timeline"]) + summary["steps"] == body["steps_run"]
    bucket = summary["buckets"][0]
    assert list(bucket) == [f.name for f in fields(TimelineBucket)]
    assert list(bucket["loss"]) == ["min", "max", "last"] and bucket["scale"] is None
    spiked = next(b for b in summary["buckets"] if b["first_step"] <= SPIKE <= b["last_step"])
    assert spiked["loss"]["max"] == 5.0
    skipped = next(b for b in summary["buckets"] if b["first_step"] <= 2000 <= b["last_step"])
    assert skipped["skipped"] == 1
    assert [w["step"] for w in body["warnings"]] == [SPIKE]


def test_a_short_run_has_no_summary_key():
    report = long_report(steps=50)
    assert report.timeline_summary is None
    assert "timeline_summary" not in report_to_dict(report)


def test_console_markdown_and_junit_say_what_was_summarized():
    report = long_report()
    console = Console(record=True, width=160, color_system=None)
    print_report(report, console)
    text = console.export_text()
    assert "earlier   steps 20..2959 summarized (2940 steps in" in text
    assert "loss 0.01838..5" in text and "1 skipped by the GradScaler" in text
    markdown = renderer_for("markdown").render(report)
    assert "- earlier: steps 20..2959 summarized" in markdown
    junit = ET.fromstring(renderer_for("junit").render(report))
    props = {p.get("name"): p.get("value") for p in junit.iter("property")}
    assert props["timeline_summarized_steps"] == "2940" and props["steps_run"] == "3000"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_plot_draws_the_summary_as_bands(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from nanaudit.report.plot import render_png
    tops = []
    original = Axes.fill_between

    def fill_between(ax, x, low, high, *args, **kwargs):
        tops.append(max(high))
        return original(ax, x, low, high, *args, **kwargs)
    monkeypatch.setattr(Axes, "fill_between", fill_between)
    assert render_png(long_report()).startswith(b"\x89PNG")
    # One band a panel with values (loss, gradient norm, update ratio; no activations), the
    # loss spike, in no kept entry, at the top of the first.
    assert len(tops) == 3 and tops[0] == 5.0 and tops[2] == 1e-3


def test_the_html_page_draws_the_summarized_middle_as_bands_with_the_spike_in_them():
    import re

    from nanaudit.report.html import render_html
    page = render_html(long_report())
    # The summary line under the timeline's heading, and one band per bucket and series.
    assert "steps 20..2959 summarized (2940 steps in" in page
    bands = re.findall(r'<rect class="summary"[^>]*><title>steps (\d+)\.\.(\d+) '
                       r'\((\d+) summarized\): min ([^,]+), max ([^,<]+)', page)
    assert bands
    spiked = [b for b in bands if int(b[0]) <= SPIKE <= int(b[1]) and b[4] == "5"]
    assert len(spiked) == 1, "the loss spike at step 1234 is its bucket's max"
    # The line does not cross the summarized middle: two polylines in the loss chart.
    loss_chart = page.split("<figcaption>loss")[1].split("</figure>")[0]
    assert loss_chart.count('<polyline class="series"') == 2
