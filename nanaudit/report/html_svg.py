"""The HTML report's timeline: loss, gradient norm, loss scale, update ratio and activation
maxima against steps, as inline SVG (no plotting library, nothing to load).

One small chart per measured series; a series that was never measured (no value at any step)
gets no chart, rather than an empty one, and one measured at a single step a sentence.
Non-finite values are red crosses along the top edge, the finding a red line, each early
warning a dashed line over a band from where it began, GradScaler skips ticks along the
bottom. A long run's summarized middle is a min-max band per bucket (a spike there is its
bucket's max), and the line does not cross it. Each point and mark carries an SVG <title>, so
values show on hover without script; the page's script adds a cursor and a readout across
charts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from nanaudit.report.html_text import esc, number
from nanaudit.report.model import BadStepEntry, Report
from nanaudit.report.sections import DataBisect
from nanaudit.report.text import warning_line
from nanaudit.report.vocabulary import BadStepAction

WIDTH, HEIGHT = 760.0, 120.0
LEFT, RIGHT, TOP, BOTTOM = 64.0, 12.0, 8.0, 22.0
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
MAX_DOTS = 150          # beyond this, points have no marker of their own (the line and script)
MAX_POINTS = 2 * int(PLOT_W)   # beyond this, each pixel column keeps its lowest and highest


@dataclass(frozen=True)
class Series:
    title: str
    field: str
    scale: str            # "linear", "log", or "auto" (log when positive over 3 decades)
    limit: float | None = None    # a reference line (the dtype's largest value)


SERIES = (
    Series("loss", "loss", "auto"),
    Series("gradient norm", "grad_norm", "log"),
    Series("loss scale (GradScaler)", "scale", "log"),
    Series("|update| / |weights|", "update_ratio", "log"),
    Series("largest |activation| / dtype max", "act_ratio", "log", limit=1.0),
    Series("largest |activation|", "act_max", "log"),
)


def timeline_svgs(report: Report) -> list[str]:
    """One <figure> per series measured at several steps, in SERIES order (activation
    maxima once); a series measured at one step only is a sentence."""
    entries = report.timeline
    if not entries:
        return []
    steps = [e.step for e in entries]
    span = (min(steps), max(steps))
    figures = []
    for series in SERIES:
        if series.field == "act_max" and any(e.act_ratio is not None for e in entries):
            continue
        points = [(e.step, getattr(e, series.field)) for e in entries]
        measured = [(s, v) for s, v in points if v is not None]
        if len(measured) == 1 and len(entries) > 1:
            # One sample (a ratio measured every N steps) is a fact, not a chart.
            s, v = measured[0]
            figures.append(f'<p class="single">{esc(series.title)}: <b>{number(v)}</b> at '
                           f"step {s}, the one step it was measured</p>")
        elif measured:
            figures.append(_figure(series, points, span, report, entries))
    return figures


def _figure(series: Series, points: list, span: tuple[int, int], report: Report,
            entries: list) -> str:
    finite = [(s, float(v)) for s, v in points if isinstance(v, (int, float))
              and math.isfinite(v)]
    summary = report.timeline_summary
    ranges = summary.ranges(series.field) if summary is not None else []
    log = _use_log(series, [v for _, v in finite])
    if log:
        finite = [(s, v) for s, v in finite if v > 0]
        ranges = [r for r in ranges if r[1] > 0]
    values = ([v for _, v in finite] + [v for r in ranges for v in r[1:3]]
              + ([series.limit] if series.limit is not None else []))
    y = _YScale(values, log)
    x = _XScale(*span)
    parts = [f'<line class="axis" x1="{LEFT}" y1="{TOP + PLOT_H}" x2="{LEFT + PLOT_W}" '
             f'y2="{TOP + PLOT_H}"/>']
    parts += _grid(y) + _x_ticks(x) + _marks(report, x, series.field, entries)
    if series.limit is not None and y.contains(series.limit):
        at = y(series.limit)
        parts.append(f'<line class="limit" x1="{LEFT}" y1="{at:.1f}" x2="{LEFT + PLOT_W}" '
                     f'y2="{at:.1f}"><title>the dtype\'s largest value</title></line>')
    parts += _summary_bands(ranges, x, y)
    gap = summary.buckets[0].first_step if summary is not None and summary.buckets else None
    for run in ([finite] if gap is None else [[p for p in finite if p[0] < gap],
                                              [p for p in finite if p[0] > gap]]):
        parts += _line(run, x, y)
    parts += _nonfinite(points, x, series.title)
    parts.append(f'<line class="cursor" x1="0" y1="{TOP}" x2="0" y2="{TOP + PLOT_H}"/>')
    caption = f"{esc(series.title)}{' (log scale)' if log else ''}"
    return (f'<figure><figcaption>{caption}</figcaption>'
            f'<svg class="chart" viewBox="0 0 {WIDTH:g} {HEIGHT:g}" role="img" '
            f'aria-label="{esc(series.title)} against steps" data-s0="{span[0]}" '
            f'data-s1="{span[1]}" data-left="{LEFT:g}" data-width="{PLOT_W:g}">'
            + "".join(parts) + "</svg></figure>")


def _use_log(series: Series, values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    if series.scale == "linear" or not positive:
        return False
    if series.scale == "log":
        return True
    return len(positive) == len(values) and max(positive) / min(positive) > 1e3


class _XScale:
    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last

    def __call__(self, step: float) -> float:
        if self.last == self.first:
            return LEFT + PLOT_W / 2
        return LEFT + (step - self.first) / (self.last - self.first) * PLOT_W


class _YScale:
    def __init__(self, values: list[float], log: bool) -> None:
        self.log = log
        ys = [self._t(v) for v in values] or [0.0]
        lo, hi = min(ys), max(ys)
        pad = (hi - lo) * 0.06 or (abs(hi) * 0.1 or 1.0)
        self.lo, self.hi = lo - pad, hi + pad

    def _t(self, value: float) -> float:
        return math.log10(value) if self.log else value

    def contains(self, value: float) -> bool:
        return (value > 0 or not self.log) and self.lo <= self._t(value) <= self.hi

    def value(self, t: float) -> float:
        return 10 ** t if self.log else t

    def __call__(self, value: float) -> float:
        return TOP + (self.hi - self._t(value)) / (self.hi - self.lo) * PLOT_H


def _grid(y: _YScale) -> list[str]:
    out = []
    for frac in (0.0, 0.5, 1.0):
        t = y.lo + (y.hi - y.lo) * (1 - frac)
        at = TOP + frac * PLOT_H
        out.append(f'<line class="axis" x1="{LEFT}" y1="{at:.1f}" x2="{LEFT + PLOT_W}" '
                   f'y2="{at:.1f}" stroke-dasharray="2 4"/>')
        out.append(f'<text x="{LEFT - 6}" y="{at + 4:.1f}" text-anchor="end">'
                   f'{number(y.value(t), 3)}</text>')
    return out


def _x_ticks(x: _XScale) -> list[str]:
    out = []
    for step in _ticks(x.first, x.last):
        at = x(step)
        out.append(f'<line class="axis" x1="{at:.1f}" y1="{TOP + PLOT_H}" x2="{at:.1f}" '
                   f'y2="{TOP + PLOT_H + 4}"/><text x="{at:.1f}" y="{HEIGHT - 4}" '
                   f'text-anchor="middle">{step}</text>')
    return out


def _ticks(first: int, last: int, count: int = 6) -> Iterator[int]:
    if last <= first:
        yield first
        return
    raw = (last - first) / count
    magnitude = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    yield from range(math.ceil(first / step) * step, last + 1, int(step))


def _marks(report: Report, x: _XScale, field: str, entries: list) -> list[str]:
    """The early warnings (a band from where each began), the finding (bisect: each bad
    batch), GradScaler skips."""
    out = []
    bottom = TOP + PLOT_H
    for w in report.warnings:
        title = f"<title>{esc(warning_line(w))}</title>"
        began, at = x(min(w.began, w.step)), x(w.step)
        if at - began > 1:
            out.append(f'<rect class="band" x="{began:.1f}" y="{TOP}" width="{at - began:.1f}" '
                       f'height="{PLOT_H}">{title}</rect>')
        out.append(f'<g><line class="mark-warning" x1="{at:.1f}" y1="{TOP}" x2="{at:.1f}" '
                   f'y2="{bottom}"/><line class="hit-area" x1="{at:.1f}" y1="{TOP}" '
                   f'x2="{at:.1f}" y2="{bottom}"/>{title}</g>')
    findings = [report.finding] if report.finding is not None else []
    if isinstance(report.bisect, DataBisect):      # bisect: every bad batch is a finding
        findings += [f for f in report.bisect.bad_batches if f is not report.finding]
    findings += [f for f in report.findings if f is not report.finding]   # --keep-going
    for f in findings:
        at = x(f.step)
        out.append(f'<g><line class="mark-finding" x1="{at:.1f}" y1="{TOP}" x2="{at:.1f}" '
                   f'y2="{bottom}"/><line class="hit-area" x1="{at:.1f}" y1="{TOP}" '
                   f'x2="{at:.1f}" y2="{bottom}"/><title>finding at step {f.step}: '
                   f'{esc(f.cause)}</title></g>')
    if field in ("grad_norm", "scale"):
        for e in entries:
            if isinstance(e, BadStepEntry) and e.bad == BadStepAction.SKIPPED:  # --keep-going
                at = x(e.step)
                out.append(f'<line class="skip bad-step" x1="{at:.1f}" y1="{bottom - 10}" '
                           f'x2="{at:.1f}" y2="{bottom}"><title>step {e.step}: a bad step, its '
                           f'update skipped (--keep-going)</title></line>')
            elif e.skipped:
                at = x(e.step)
                out.append(f'<line class="skip" x1="{at:.1f}" y1="{bottom - 6}" x2="{at:.1f}" '
                           f'y2="{bottom}"><title>step {e.step}: skipped by the GradScaler'
                           f'</title></line>')
    return out


def _line(finite: list, x: _XScale, y: _YScale) -> list[str]:
    if not finite:
        return []
    shown = finite if len(finite) <= MAX_POINTS else _thinned(finite, x)
    coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in shown)
    out = [f'<polyline class="series" points="{coords}"/>']
    if len(finite) <= MAX_DOTS:
        out += [f'<circle class="dot" cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5"><title>step {s}: '
                f'{number(v)}</title></circle>' for s, v in finite]
    return out


def _summary_bands(ranges: list, x: _XScale, y: _YScale) -> list[str]:
    """Each summarized bucket as a band from its min to its max, its values on hover."""
    out = []
    for bucket, low, high, last in ranges:
        left, right = x(bucket.first_step), x(bucket.last_step)
        top, bottom = y(high), y(low)
        last_text = f", last {number(last)}" if last is not None else ""
        out.append(f'<rect class="summary" x="{left:.1f}" y="{top:.1f}" '
                   f'width="{max(right - left, 1.0):.1f}" height="{max(bottom - top, 1.0):.1f}">'
                   f"<title>steps {bucket.first_step}..{bucket.last_step} ({bucket.count} "
                   f"summarized): min {number(low)}, max {number(high)}{last_text}</title></rect>")
    return out


def _thinned(finite: list, x: _XScale) -> list:
    """Per pixel column the lowest and the highest point, in step order: the line's shape
    with a bounded number of points (spikes kept)."""
    columns: dict[int, list] = {}
    for s, v in finite:
        columns.setdefault(int(x(s)), []).append((s, v))
    out = []
    for column in columns.values():
        lo, hi = min(column, key=lambda p: p[1]), max(column, key=lambda p: p[1])
        out += sorted({lo, hi})
    return out


def _nonfinite(points: list, x: _XScale, title: str) -> list[str]:
    out = []
    for s, v in points:
        if isinstance(v, (int, float)) and not math.isfinite(v):
            cx, cy = x(s), TOP + 4
            out.append(f'<g><path class="nf" d="M{cx - 4:.1f},{cy - 4:.1f}l8,8m0,-8l-8,8"/>'
                       f'<title>step {s}: {esc(title)} {number(v)}</title></g>')
    return out
