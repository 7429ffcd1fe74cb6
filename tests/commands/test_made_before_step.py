"""Issue 35: a value the script's own code made before the step's first model call, then used by
the step's loss code or model. A module called without autograd before the training call (a
distillation teacher under `no_grad`) is kept with the step's record, with the code after it,
and replayed before the training call: a value its forward or that code made is named at the
trip, in-process. What the record does not hold (a weight the script changed in place between
steps) ends the replay's walk at a value no replayed op made: it must not name the op that
passed it on (nor blame numpy, a C extension or divergence), but fall back to the re-run,
saying why, and the re-run traces the script's code before the step's first model call and
names the op there.

The scripts follow public patterns: knowledge distillation's temperature-scaled softmax of
a frozen teacher's logits as the target (`F.kl_div(log_softmax(s), softmax(t / T))`, with T
reaching 0), and a hand-written EMA of the weights updated in place under `no_grad` after the
optimizer's step (`ema_p.mul_(decay).add_(p, alpha=1 - decay)`, the timm/`torch.optim.swa_utils`
pattern) with a bad decay, evaluated without backward."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers import line_of

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

TEACHER = """
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    student = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.SGD(student.parameters(), 0.1)
    T = 1.0
    for step in range(40):
        x = torch.randn(8, 10)
        with torch.no_grad():
            t = teacher(x)
            if step == 30: T = 0.0
            p = F.softmax(t / T, dim=1)
        s = F.log_softmax(student(x), dim=1)
        loss = F.kl_div(s, p, reduction="batchmean")
        opt.zero_grad(); loss.backward(); opt.step()
"""

EMA = """
    import torch, torch.nn as nn, copy
    torch.manual_seed(0)
    m = nn.Linear(6, 1); ema = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), 0.05)
    decay = 0.99
    for step in range(40):
        x = torch.randn(8, 6); y = x.sum(1, keepdim=True)
        loss = (m(x) - y).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad():
            d = decay if step != 33 else float("inf")
            for pe, p in zip(ema.parameters(), m.parameters()):
                pe.mul_(d).add_(p, alpha=1 - d)
        eval_loss = (ema(x) - y).pow(2).mean()
"""

WRONG = ("created outside torch ops", "numpy", "C extension")


def write(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path


def fell_back(report, step: int, what: str) -> None:
    """The in-process replay named nothing, said why, and the re-run named the op."""
    replay = report.run.replay
    assert replay.status == "made-before-step" and replay.ops_traced > 0
    assert f"made it before step {step}'s first model call" in replay.note and what in replay.note
    assert report.run.rerun.status == "reproduced"
    assert report.finding.localized_by == "re-run" and report.finding.reproduced is True


@pytest.mark.slow
def test_a_distillation_target_made_non_finite_under_no_grad_names_the_division(tmp_path):
    # The teacher's call under no_grad and the code after it are kept with the step's record
    # (frozen calls) and replayed before the student's call: named at the trip, in-process.
    path = write(tmp_path, TEACHER)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1
    # Before: aten.xlogy.Tensor (kl_div's), cause unknown, "created outside torch ops"; then
    # a re-run from the start.
    assert (f.step, f.where, f.op, f.cause) == (30, "forward", "aten.div.Tensor", "div-by-zero")
    assert f.source.line == line_of(path, "p = F.softmax(t / T")
    assert not any(word in f.explanation for word in WRONG)
    assert f.localized_by == "in-process" and report.run.rerun is None
    assert report.run.replay.status == "reproduced"


TEACHER_FORWARD = """
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)

    class Teacher(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = self.body(x)
            return self.head(torch.sqrt(h.abs() - (x[:, :1] < -50).float()))

    teacher = Teacher().eval()
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    for step in range(60):
        x = torch.randn(8, 16)
        if step == 40:
            x[3, 0] = -100.0
        with torch.no_grad():
            target = F.softmax(teacher(torch.relu(x) + (x < -50).float() * x) / 2.0, dim=-1)
        out = student(x)
        loss = F.kl_div(F.log_softmax(out / 2.0, dim=-1), target, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


@pytest.mark.slow
def test_a_value_a_frozen_teachers_forward_made_is_named_in_the_teacher(tmp_path):
    # Public pattern: knowledge distillation with an eval-mode teacher under no_grad. Row 3's
    # input makes the teacher's sqrt see a negative value; only its output reaches the loss.
    path = write(tmp_path, TEACHER_FORWARD)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1
    # Before: a re-run from the start (the replay's walk ended at the teacher's output).
    assert (f.step, f.where, f.op, f.module, f.cause, f.samples) == (
        40, "forward", "aten.sqrt.default", "teacher", "sqrt-domain", [3])
    assert f.source.line == line_of(path, "return self.head(torch.sqrt(")
    assert f.localized_by == "in-process" and report.run.rerun is None


@pytest.mark.slow
def test_an_ema_copy_updated_in_place_with_an_infinite_decay_names_the_update(tmp_path):
    path = write(tmp_path, EMA)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1
    # Before: aten.t.default (the EMA Linear's transpose of its NaN weight), cause divergence
    # (linked to the trained model's update-ratio warning).
    assert (f.step, f.where, f.op, f.cause) == (34, "forward", "aten.mul_.Tensor",
                                                "inf-arithmetic")
    assert f.source.line == line_of(path, "pe.mul_(d).add_(p")
    assert "the Python number inf" in f.explanation
    assert "skipped it before backward" in f.explanation
    assert not any(word in f.explanation for word in WRONG)
    fell_back(report, 34, "Linear.weight")


def test_keep_going_names_a_skipped_steps_distillation_target_in_process(tmp_path):
    # A skipped step is never re-run: its finding is the in-process replay's or none.
    path = write(tmp_path, TEACHER.replace("if step == 30: T = 0.0",
                                           "T = 0.0 if step == 30 else 1.0"))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(keep_going=True))
    first = report.findings[0]
    assert exit_code(report) == 1 and report.run.rerun is None
    # Before: no op ("not localized: a tensor the loss code reads ..."): the teacher's code
    # is now part of the step's record, so the skipped step is named in-process.
    assert (first.step, first.op, first.cause, first.localized_by) == (
        30, "aten.div.Tensor", "div-by-zero", "in-process")
    assert not any(word in first.explanation for word in WRONG)


@pytest.mark.slow
@pytest.mark.parametrize("code, op, text", [
    (TEACHER, "aten.div.Tensor", "p = F.softmax(t / T"),
    (EMA, "aten.mul_.Tensor", "pe.mul_(d).add_(p"),
])
def test_the_forced_rerun_traces_the_code_before_the_step_too(tmp_path, code, op, text):
    # --rerun: no in-process replay looked; the re-run of a loss trip traces the script's code
    # before the step's first model call all the same (before: xlogy / t, "outside torch").
    path = write(tmp_path, code)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(force_rerun=True))
    f = report.finding
    assert (f.op, f.source.line, f.localized_by) == (op, line_of(path, text), "re-run")
    assert report.run.replay.status == "skipped" and report.run.rerun.status == "reproduced"
    assert not any(word in f.explanation for word in WRONG)
