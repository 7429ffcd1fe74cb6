"""A GradScaler's skipped steps, and when they become a finding: one rule for the step loop
(whose scaler nanaudit drives), `Sentinel` (the user's scaler) and `nanaudit run` (the script's).

A skipped step is normal AMP behaviour: the scale backs off and the next step tries again. It
becomes a finding when the scale collapses: it falls below `scale_floor`, or `max_skipped`
steps in a row are skipped, which means the gradients overflow the low-precision dtype
whatever the scale. The scale is the one the scaler's own backoff gives (a user's scaler may
back off by another factor than torch's default).

Skips at a scale above torch's default initial scale (2**16, already past float16's largest
value, 65504) do not join the row: there even a gradient of 1 overflows, so they say only that
the scaler started too high and is backing off to a usable scale (a script that starts at
2**40 skips some 25 steps before its first update, and then trains), not that the gradients
overflow whatever the scale.
"""

from __future__ import annotations

from typing import Any

SEARCH_ABOVE = 2.0 ** 16     # skips at a scale above this do not count toward max_skipped


def backoff_scale(scaler: Any, scale: float) -> float:
    """The scale a GradScaler moves to when it skips a step: times its own backoff factor
    (torch's default 0.5 for an object without `get_backoff_factor`)."""
    get_factor = getattr(scaler, "get_backoff_factor", None)
    return scale * (get_factor() if get_factor is not None else 0.5)


def collapse_reason(next_scale: float | None, floor: float, skipped_in_row: int,
                    max_skipped: int, options: str = "amp.",
                    scaler: str = "the GradScaler") -> str | None:
    """Why a skipped step is a finding (None: it is AMP's normal course): the scale after
    this skip (None: unknown) fell below `floor`, or `max_skipped` steps in a row were
    skipped. `options`: what the messages call the settings (`amp.` in a config; "" for
    Sentinel's arguments); `scaler`: what skipped them ("DeepSpeed" for its fp16 loss scaler)."""
    if next_scale is not None and next_scale < floor:
        return (f"the loss scale fell to {next_scale:g}, below {options}scale_floor {floor:g}, "
                f"after {skipped_in_row} skipped step(s) in a row")
    if skipped_in_row >= max_skipped:
        fell = f" and the scale fell to {next_scale:g}" if next_scale is not None else ""
        return (f"{scaler} skipped {skipped_in_row} steps in a row ({options}max_skipped)"
                f"{fell}")
    return None


class ScalerWatch:
    """Counts a run's skipped steps (all, and in a row) and says when a skip is a collapse."""

    def __init__(self, scale_floor: float, max_skipped: int, options: str = "amp."):
        self.scale_floor, self.max_skipped, self.options = scale_floor, max_skipped, options
        self.skipped = 0            # every skipped step of the run
        self.in_row = 0             # skipped since the last applied update

    def applied(self) -> None:
        """An update ran: the row of skips ends."""
        self.in_row = 0

    def skip(self, scale: float | None, next_scale: float | None,
             scaler: str = "the GradScaler") -> str | None:
        """A step `scaler` skipped at `scale`, which moves to `next_scale` (None: unknown): why
        the skips are now a finding, or None (AMP's normal course)."""
        self.skipped += 1
        if scale is None or scale <= SEARCH_ABOVE:
            self.in_row += 1
        return collapse_reason(next_scale, self.scale_floor, self.in_row, self.max_skipped,
                               self.options, scaler)

    def skip_with(self, scaler: Any, scale: float | None) -> str | None:
        """`skip`, the next scale from `scaler`'s own backoff of `scale`."""
        return self.skip(scale, backoff_scale(scaler, scale) if scale is not None else None)
