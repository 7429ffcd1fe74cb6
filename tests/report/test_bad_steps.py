"""A run that keeps going: every bad step's finding in `findings` (the first whole, the rest
summarized by cause, op and line), what became of each step, the persistent-cause rule, the
2 MB bound with thousands of bad steps, and the skip list (report/bad_steps.py,
report/skip_list.py)."""

from __future__ import annotations

import json

import pytest
from keep_going_case import bad_step, keep_going_report

from nanaudit.report.bad_steps import KEEP_WHOLE, MAX_SPANS, BadStepLog
from nanaudit.report.formats import renderer_for
from nanaudit.report.model import Report, report_to_dict
from nanaudit.report.skip_list import skip_list_text
from nanaudit.report.vocabulary import BadStepAction, Cause, StopReason

LONG_RUN_BOUND = 2 * 1024 * 1024


def _report() -> Report:
    return Report(tool_version="0.1.0", config={}, torch_version="2.13.0", device="cpu",
                  status="nonfinite", steps_run=0)


def test_every_bad_step_is_a_finding_in_order_and_the_first_stays_finding():
    body = json.loads(renderer_for("json").render(keep_going_report()))
    assert [f["step"] for f in body["findings"]] == [3, 5, 8]
    assert body["finding"] == body["findings"][0]
    assert [(f["action"], f.get("stop_reason")) for f in body["findings"]] == [
        ("skipped", None), ("skipped", None), ("stopped", "max-bad-steps")]
    section = body["bad_steps"]
    assert (section["count"], section["skipped"], section["whole"], section["stopped"],
            section["max_bad_steps"]) == (3, 2, 3, "max-bad-steps", 2)
    assert section["steps"] == {"first": 3, "last": 8, "spans": [[3, 3], [5, 5], [8, 8]],
                                "spans_left_out": 0}
    assert section["persistent"] is False and section["summarized"] == []
    # `finding`'s optional keys are left out of each of `findings` the same way.
    assert all("optimizer" not in f and "loss_name" not in f for f in body["findings"])


def test_a_run_that_did_not_keep_going_keeps_its_shape():
    report = _report()
    report.finding = bad_step(3)
    body = report_to_dict(report)
    assert "findings" not in body and "bad_steps" not in body
    assert "action" not in body["finding"] and "stop_reason" not in body["finding"]


def test_thousands_of_bad_steps_stay_under_the_long_run_bound():
    # A corrupt shard: 6,000 bad steps, every third step, three ways of going bad.
    log = BadStepLog(max_bad_steps=100_000)
    causes = [(Cause.LOG_DOMAIN, "aten.log.default", 17), (Cause.DIV_BY_ZERO,
              "aten.div.Tensor", 23), (Cause.NONFINITE_INPUT, None, 0)]
    for i in range(6000):
        cause, op, line = causes[i % 3]
        log.record(bad_step(3 * i, cause=cause, op=op, line=line, rows=list(range(8))),
                   BadStepAction.SKIPPED)
    report = _report()
    log.apply(report)
    text = renderer_for("json").render(report)
    assert len(text.encode()) < LONG_RUN_BOUND
    body = json.loads(text)
    assert len(body["findings"]) == KEEP_WHOLE == body["bad_steps"]["whole"]
    groups = body["bad_steps"]["summarized"]
    assert sum(g["count"] for g in groups) == 6000 - KEEP_WHOLE
    # By first step: the 21st bad step (step 60) is the first one summarized.
    assert [(g["cause"], g["op"], g["line"], g["steps"]["first"]) for g in groups] == [
        ("nonfinite-input", None, None, 60), ("log-domain", "aten.log.default", 17, 63),
        ("div-by-zero", "aten.div.Tensor", 23, 66)]
    steps = body["bad_steps"]["steps"]
    assert (steps["first"], steps["last"], len(steps["spans"])) == (0, 17997, MAX_SPANS)
    assert steps["spans_left_out"] == 6000 - MAX_SPANS
    assert len(log.skip) == 6000 and log.skip[-1].step == 17997


def test_consecutive_bad_steps_are_one_span_and_the_same_op_and_line_is_persistent():
    log = BadStepLog(max_bad_steps=500)
    for step in range(100, 400):
        log.record(bad_step(step), BadStepAction.SKIPPED)
    section = log.section()
    assert section.persistent is True
    assert section.steps.spans == [[100, 399]]
    (group,) = section.summarized
    assert (group.count, group.steps.first, group.steps.last) == (300 - KEEP_WHOLE, 120, 399)


def test_a_cause_is_persistent_only_at_one_op_and_line_over_enough_steps():
    def persistent(*findings) -> bool:
        log = BadStepLog(max_bad_steps=10)
        for f in findings:
            log.record(f, BadStepAction.SKIPPED)
        return log.persistent
    assert not persistent(bad_step(1), bad_step(2))                     # too few to say
    assert persistent(bad_step(1), bad_step(2), bad_step(4))
    assert not persistent(bad_step(1), bad_step(2), bad_step(4, line=18))   # another line
    no_op = [bad_step(s, cause=Cause.NONFINITE_INPUT, op=None) for s in (1, 2, 3)]
    assert not persistent(*no_op)                                       # names no op


def test_the_log_refuses_what_cannot_happen():
    log = BadStepLog(max_bad_steps=3)
    log.record(bad_step(5), BadStepAction.SKIPPED)
    with pytest.raises(ValueError, match="step order"):
        log.record(bad_step(4), BadStepAction.SKIPPED)
    with pytest.raises(ValueError, match="says why"):
        log.record(bad_step(6), BadStepAction.STOPPED)
    log.record(bad_step(6), BadStepAction.STOPPED, StopReason.NONFINITE_STATE)
    with pytest.raises(ValueError, match="already stopped"):
        log.record(bad_step(7), BadStepAction.SKIPPED)
    with pytest.raises(ValueError):
        BadStepLog(max_bad_steps=0)


def test_the_skip_list_records_each_bad_steps_batch_rows_and_ids():
    log = BadStepLog(max_bad_steps=10)
    report = keep_going_report()
    for f in report.findings:
        f.action = f.stop_reason = None
    for f in report.findings[:2]:
        log.record(f, BadStepAction.SKIPPED)
    body = json.loads(skip_list_text(log.skip))
    assert body["skip"][0] == {"batch": 6, "rows": [1], "sample_ids": None,
                               "cause": "log-domain", "step": 3}
    assert body["skip"][1]["rows"] == [0, 3] and body["skip"][1]["batch"] == 10
    assert body["skip"][1]["sample_ids"][1] == "clip_7"
