"""`--plot PATH.png`: loss, gradient norm, update ratio and activation maxima against steps.

The first warning is a dashed orange line, the finding a red one, GradScaler skips are marked
on the gradient-norm panel. A long run's summarized middle (`timeline_summary`) is drawn as
bands from each bucket's min to its max, with a thin line through its last values, so a spike
between the kept steps still shows. matplotlib is an optional extra (`nanaudit[plot]`),
imported only here, with the Agg backend so it never needs a display.
"""

from __future__ import annotations

import io
import math
from typing import Any

from nanaudit.report.model import Report


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


PANELS = (("loss", "loss", "linear"), ("gradient norm", "grad_norm", "log"),
          ("|update| / |weights|", "update_ratio", "log"),
          ("largest |activation|\n(fraction of dtype max)", "act_ratio", "log"))


def _segments(report: Report) -> list[list]:
    summary = report.timeline_summary
    return summary.runs(report.timeline) if summary is not None else [report.timeline]


def _bands(ax: Any, report: Report, name: str, log: bool) -> bool:
    """The summarized middle of one series as min-max bands: whether any was drawn."""
    summary = report.timeline_summary
    xs, lows, highs, lasts = [], [], [], []
    for b, low, high, last in summary.ranges(name) if summary is not None else ():
        if log and low <= 0:
            continue
        xs += [b.first_step, b.last_step]
        lows += [low, low]
        highs += [high, high]
        lasts.append((b.last_step, last))
    if not xs:
        return False
    ax.fill_between(xs, lows, highs, color="tab:blue", alpha=0.25, linewidth=0,
                    label="min-max of summarized steps")
    points = [(x, y) for x, y in lasts if y is not None and math.isfinite(y) and (y > 0 or not log)]
    if points:
        ax.plot(*zip(*points), color="tab:blue", linewidth=0.6)
    return True


def check_available() -> None:
    """Raise PlotUnavailable now, before a scan, rather than after all its steps."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'nanaudit[plot]'")


def render_png(report: Report) -> bytes:
    check_available()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(9, 9), constrained_layout=True)
    first_warning = min((w.step for w in report.warnings), default=None)
    finding = report.finding.step if report.finding is not None else None
    skipped = [e.step for e in report.timeline if e.skipped]
    for ax, (title, name, scale) in zip(axes, PANELS):
        drawn = _bands(ax, report, name, scale == "log")
        for segment in _segments(report):
            fx, fy = _finite([e.step for e in segment], [getattr(e, name) for e in segment])
            if scale == "log":
                kept = [(x, y) for x, y in zip(fx, fy) if y > 0]
                fx, fy = [x for x, _ in kept], [y for _, y in kept]
            if fx:
                ax.plot(fx, fy, marker="." if len(report.timeline) < 80 else None,
                        linewidth=1.2, color="tab:blue")
                drawn = True
        if drawn:
            ax.set_yscale(scale)
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center",
                    va="center", color="grey")
        ax.set_ylabel(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        if first_warning is not None:
            ax.axvline(first_warning, color="tab:orange", linestyle="--", linewidth=1,
                       label=f"first warning (step {first_warning})")
        if finding is not None:
            ax.axvline(finding, color="tab:red", linewidth=1.5,
                       label=f"finding (step {finding})")
    if skipped:
        axes[1].scatter(skipped, [axes[1].get_ylim()[0]] * len(skipped), marker="x",
                        color="tab:purple", label="GradScaler skipped", zorder=3)
    if report.timeline and any(e.act_ratio for e in report.timeline):
        axes[3].axhline(1.0, color="tab:red", linestyle=":", linewidth=1, label="dtype max")
    axes[-1].set_xlabel("step")
    for ax in axes:
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8, loc="upper left")
    status = report.finding.cause if report.finding is not None else report.status
    fig.suptitle(f"nanaudit: {report.config.get('path', '')} ({status})", fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
