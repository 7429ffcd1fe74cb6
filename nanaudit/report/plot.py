"""`--plot PATH.png`: loss, gradient norm, update ratio and activation maxima against steps.

The first warning is a dashed orange line, the finding a red one, GradScaler skips are marked
on the gradient-norm panel. matplotlib is an optional extra (`nanaudit[plot]`), imported only
here, with the Agg backend so it never needs a display.
"""

from __future__ import annotations

import io
import math

from nanaudit.report.model import Report


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _finite(xs, ys):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _panels(report: Report):
    steps = [e.step for e in report.timeline]
    yield "loss", steps, [e.loss for e in report.timeline], "linear"
    yield "gradient norm", steps, [e.grad_norm for e in report.timeline], "log"
    yield "|update| / |weights|", steps, [e.update_ratio for e in report.timeline], "log"
    yield ("largest |activation|\n(fraction of dtype max)", steps,
           [e.act_ratio for e in report.timeline], "log")


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
    for ax, (title, xs, ys, scale) in zip(axes, _panels(report)):
        fx, fy = _finite(xs, ys)
        if scale == "log":
            fx, fy = zip(*[(x, y) for x, y in zip(fx, fy) if y > 0]) if any(
                y > 0 for y in fy) else ((), ())
        if fx:
            ax.plot(fx, fy, marker="." if len(fx) < 80 else None, linewidth=1.2)
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
