"""The one GradScaler rule (run/check/scaler.py): skips are AMP's normal course until the scale
collapses; an applied update ends the row."""

from __future__ import annotations

import torch

from nanaudit.run.check.decision import StepDecision
from nanaudit.run.check.scaler import ScalerWatch


def test_skips_in_a_row_collapse_at_max_skipped_and_an_update_ends_the_row():
    watch = ScalerWatch(scale_floor=1.0, max_skipped=3)
    assert [watch.skip(2.0 ** 10, 2.0 ** 9) for _ in range(2)] == [None, None]
    watch.applied()
    assert [watch.skip(2.0 ** 10, 2.0 ** 9) for _ in range(2)] == [None, None]
    reason = watch.skip(2.0 ** 10, 2.0 ** 9)
    assert reason is not None and "skipped 3 steps in a row (amp.max_skipped)" in reason
    assert (watch.skipped, watch.in_row) == (5, 3)


def test_a_scale_below_the_floor_collapses_by_the_scalers_own_backoff():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, backoff_factor=0.25)
    watch = ScalerWatch(scale_floor=1.5, max_skipped=100, options="")
    reason = watch.skip_with(scaler, 4.0)
    assert reason is not None and "fell to 1, below scale_floor 1.5" in reason
    assert ScalerWatch(1.5, 100).skip_with(scaler, None) is None    # scale unknown


def test_the_decision_stops_only_on_a_trip():
    assert StepDecision.of(None) is StepDecision.APPLY
    assert StepDecision.of(object()) is StepDecision.STOP


def test_skips_above_the_default_initial_scale_are_the_scalers_search_not_a_collapse():
    # A scaler started at 2**40 backs off some 25 steps before its first update (the
    # amp_grad_scaler_clean example): those skips say the start was too high.
    watch, scale = ScalerWatch(scale_floor=1.0, max_skipped=10), 2.0 ** 40
    while scale > 2.0 ** 16:
        assert watch.skip(scale, scale / 2) is None
        scale /= 2
    assert (watch.skipped, watch.in_row) == (24, 0)
    reasons = [watch.skip(2.0 ** 16 / 2 ** i, 2.0 ** 15 / 2 ** i) for i in range(10)]
    assert reasons[:9] == [None] * 9 and "skipped 10 steps in a row" in reasons[9]
