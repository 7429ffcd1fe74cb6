"""An early warning explains a finding only when it bears on it (localize/early_warnings.py):
the same module or series, inside the window, for a cause where growth or overflow is the
mechanism; otherwise it stays in the report's warnings."""

from __future__ import annotations

from nanaudit.localize.causes import fix_for
from nanaudit.localize.early_warnings import WINDOW, attach_warnings
from nanaudit.report.model import EarlyWarning, Finding
from nanaudit.report.vocabulary import Cause, WarningKind, Where

GROWTH = EarlyWarning(kind=WarningKind.GRAD_GROWTH, step=17209, began=17205, value=3.1e4,
                      threshold=10.0,
                      message="the gradient norm grew 17.2x over 4 steps in a row, from 1802 at "
                              "step 17205 to 3.1e+04")


def _finding(step: int, where: Where, cause: Cause, module: str | None = None) -> Finding:
    return Finding(step=step, where=where, value="nan", cause=cause,
                   explanation="the op made nan", fix=fix_for(cause), module=module,
                   op="aten.linalg_vector_norm.default")


def test_an_all_zero_row_is_not_explained_by_growth_thousands_of_steps_earlier():
    # The case: a backward NaN from an all-zero input row at step 19,900, after a
    # gradient-growth warning at step 17,209 that has nothing to do with the row.
    finding = _finding(19900, Where.BACKWARD, Cause.NORM_AT_ZERO, module="features")
    attach_warnings(finding, [GROWTH], "fp32")
    assert finding.first_warning is None
    assert finding.explanation == "the op made nan" and finding.cause == Cause.NORM_AT_ZERO


def test_growth_of_an_unrelated_cause_stays_a_warning_even_inside_the_window():
    finding = _finding(GROWTH.step + 3, Where.BACKWARD, Cause.NORM_AT_ZERO)
    attach_warnings(finding, [GROWTH], "fp32")
    assert finding.first_warning is None and "warned" not in finding.explanation


def test_old_growth_does_not_make_an_unexplained_value_a_divergence():
    finding = _finding(GROWTH.step + WINDOW + 1, Where.FORWARD, Cause.UNKNOWN)
    attach_warnings(finding, [GROWTH], "fp32")
    assert finding.cause == Cause.UNKNOWN and finding.first_warning is None


def test_an_overflow_after_growth_of_the_same_series_is_a_divergence_explained_by_it():
    finding = _finding(GROWTH.step + 12, Where.FORWARD, Cause.DTYPE_OVERFLOW, module="proj")
    attach_warnings(finding, [GROWTH], "fp32")
    assert finding.cause == Cause.DIVERGENCE and finding.fix == fix_for(Cause.DIVERGENCE)
    assert finding.first_warning == GROWTH
    assert ("nanaudit warned at step 17209 (growing since step 17205): grad-growth"
            in finding.explanation)


def test_a_near_overflow_bears_only_on_the_module_it_names():
    near = EarlyWarning(kind=WarningKind.NEAR_OVERFLOW, step=40, began=40, module="head",
                        value=40000.0, threshold=32752.0,
                        message="the output of head reached |40000|, 61% of float16's largest")
    elsewhere = _finding(45, Where.FORWARD, Cause.DTYPE_OVERFLOW, module="proj")
    attach_warnings(elsewhere, [near], "fp16")
    assert elsewhere.first_warning is None and elsewhere.cause == Cause.DTYPE_OVERFLOW
    there = _finding(45, Where.FORWARD, Cause.DTYPE_OVERFLOW, module="head")
    attach_warnings(there, [near], "fp16")
    assert there.first_warning == near and "nanaudit warned at step 40: near-overflow" in (
        there.explanation)


def test_a_warning_after_the_finding_never_explains_it():
    finding = _finding(GROWTH.step - 1, Where.FORWARD, Cause.DIVERGENCE)
    attach_warnings(finding, [GROWTH], "fp32")
    assert finding.first_warning is None
