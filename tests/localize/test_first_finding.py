"""One builder for the findings stated without a replay: the check that tripped decides where,
cause and fix once, whichever front end saw it (`scan`'s loop, Sentinel, `nanaudit run`)."""

import pytest

from nanaudit.localize.causes import fix_for
from nanaudit.localize.first_finding import Seen, first_finding
from nanaudit.report.vocabulary import Cause, Check, Where
from nanaudit.script.findings import first_run_finding
from nanaudit.script.trip import ScriptTrip


@pytest.mark.parametrize("check, flags, where, cause", [
    (Check.INPUT, {}, Where.INPUT, Cause.NONFINITE_INPUT),
    (Check.OPTIMIZER, {}, Where.OPTIMIZER, Cause.OPTIMIZER_UPDATE),
    # Only buffers bad after an update: the forward changed them, not the optimizer.
    (Check.OPTIMIZER, {"parameters": False}, Where.PARAMETER, Cause.NONFINITE_PARAMETER),
    (Check.PARAMETER, {}, Where.PARAMETER, Cause.NONFINITE_PARAMETER),
    (Check.PARAMETER, {"in_forward": True}, Where.FORWARD, Cause.UNKNOWN),
    (Check.SCHEDULE, {}, Where.OPTIMIZER, Cause.OPTIMIZER_UPDATE),
    (Check.LOSS, {}, Where.FORWARD, Cause.UNKNOWN),
    (Check.GRADIENT, {}, Where.BACKWARD, Cause.UNKNOWN),
    (Check.ERROR, {}, Where.BACKWARD, Cause.UNKNOWN),
    (Check.ERROR, {"where": Where.FORWARD}, Where.FORWARD, Cause.UNKNOWN),
])
def test_the_check_decides_where_cause_and_fix(check, flags, where, cause):
    finding = first_finding(Seen(3, check, "inf", "seen", ["a", "b"], rank=1, **flags))
    assert (finding.where, finding.cause, finding.fix) == (where, cause, fix_for(cause))
    assert (finding.step, finding.value, finding.tensor, finding.tensors, finding.rank) == \
        (3, "inf", "a", ["a", "b"], 1)


def test_the_named_tensor_and_rows_are_the_front_ends():
    finding = first_finding(Seen(0, Check.LOSS, "nan", "seen", ["w.grad"], tensor="loss",
                                 samples=[2]))
    assert (finding.tensor, finding.samples, finding.inputs) == ("loss", [2], [])
    assert first_finding(Seen(0, Check.PARAMETER, "nan", "seen")).tensor is None


@pytest.mark.parametrize("trip, where, cause", [
    (ScriptTrip(step=4, check=Check.INPUT, tensors=["x"], rows=[1], input_shapes="[2, 3]"),
     Where.INPUT, Cause.NONFINITE_INPUT),
    (ScriptTrip(step=4, check=Check.OPTIMIZER, tensors=["fc.weight"], optimizer="SGD"),
     Where.OPTIMIZER, Cause.OPTIMIZER_UPDATE),
    (ScriptTrip(step=4, check=Check.PARAMETER, tensors=["ema"], where=Where.FORWARD),
     Where.FORWARD, Cause.UNKNOWN),
    (ScriptTrip(step=4, check=Check.GRADIENT, tensors=["fc.weight"]),
     Where.BACKWARD, Cause.UNKNOWN),
])
def test_nanaudit_run_builds_its_first_run_findings_through_the_one_builder(trip, where, cause):
    finding = first_run_finding(trip)
    assert (finding.step, finding.where, finding.cause) == (4, where, cause)
    assert finding.tensor == trip.tensors[0] and finding.tensors == trip.tensors
