"""One canonical report of a run that kept going past bad steps, with hostile user-named
strings (modules, files, code, sample ids): the fixture of the multi-finding format tests."""

from __future__ import annotations

from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.model import (
    Finding,
    InputProducer,
    Report,
    SampleSearch,
    SourceLine,
    TensorStats,
    TimelineEntry,
)
from nanaudit.report.vocabulary import BadStepAction, Cause, ProducerKind, StopReason, Where

HOSTILE = '<script>alert("x")</script> & ]]> ::error:: %0A \x01'


def bad_step(step: int, cause: Cause = Cause.LOG_DOMAIN, op: str | None = "aten.log.default",
             line: int = 17, where: Where = Where.FORWARD, rows: list | None = None) -> Finding:
    stats = TensorStats("self", (4, 3), "float32", 12, -0.5, 2.0, 0.4, 0, 0, 0, 1, 2)
    return Finding(
        step=step, where=where, value="-inf", cause=cause,
        explanation=f"log received non-positive values at step {step} in `{HOSTILE}`",
        fix="`torch.log(x.clamp(min=eps))`", tensor="loss", op=op,
        module=f"enc.{HOSTILE}" if op else None,
        source=SourceLine(f"train_{HOSTILE}.py", line, f"y = torch.log(x)  # {HOSTILE}",
                          "forward") if op else None,
        samples=rows, inputs=[stats] if op else [], reproduced=True, batch_index=step * 2,
        sample_search=SampleSearch(4, 3, False), rank=None)


def keep_going_report() -> Report:
    """Three bad steps: a forward log(0) (rows [1]) skipped, a non-finite input (rows [0, 3],
    with its ids) skipped, and the log(0) again, where the run stopped at --max-bad-steps 2."""
    log = BadStepLog(max_bad_steps=2)
    first = bad_step(3, rows=[1])
    data = bad_step(5, cause=Cause.NONFINITE_INPUT, op=None, where=Where.INPUT, rows=[0, 3])
    data.producer = InputProducer(ProducerKind.OUTSIDE_TORCH, sample_indices=[40, 43],
                                  sample_ids=[f"clip_{HOSTILE}", "clip_7"])
    last = bad_step(8, rows=[2])
    log.record(first, BadStepAction.SKIPPED)
    log.record(data, BadStepAction.SKIPPED)
    log.record(last, BadStepAction.STOPPED, StopReason.MAX_BAD_STEPS)
    timeline = [TimelineEntry(i, 1.0 / (i + 1), 0.5, 4.4, 1e-3, 0.5) for i in range(9)]
    report = Report(tool_version="0.1.0", config={"path": f"configs/{HOSTILE}.yaml"},
                    torch_version="2.13.0", device="cpu", status="nonfinite", steps_run=9,
                    timeline=timeline, duration_s=2.5)
    log.apply(report)
    return report
