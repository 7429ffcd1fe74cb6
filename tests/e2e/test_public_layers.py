"""`nanaudit run` on a script that trains layers by calling their `forward` itself: no module
call is made in a training step (pytorch/examples mnist_forward_forward/main.py's shape, kept in
miniature in scripts/forward_forward.py). Its loss is the script's own code from the last update
to `backward`: recorded from the step's start, it is replayed in-process at the trip, and with
`--rerun` the re-run traces that stretch of the script's code and names the same op. Under
`--keep-going` a skipped step's hold ends at the next step's backward (no module call will end
it), so every later step is checked and updated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import line_of, plain

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

FF = Path(__file__).parent / "scripts" / "forward_forward.py"


@pytest.fixture
def digits(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    images = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.save((images, torch.arange(64) % 10), tmp_path / "digits.pt")
    return tmp_path / "digits.pt"


def audited(script: str, *args: str, **options):
    return run_script(ScriptTarget(path=script, args=args), ScriptOptions(**options))


def test_forward_forward_clean_run_prints_what_python_prints(digits, capsys):
    plain(str(FF), f"--data={digits}")
    printed = capsys.readouterr().out
    report = audited(str(FF), f"--data={digits}")
    assert exit_code(report) == 0 and report.finding is None
    assert capsys.readouterr().out == printed
    # Two layers, each its own optimizer, four steps each: eight steps audited.
    assert len(report.timeline) == 8


def test_forward_forward_threshold_overflow_is_named_in_process_from_the_steps_own_code(digits):
    # --threshold 100: exp(100 - goodness) overflows float32 at layer 0's first step; no module
    # was called (Layer.train calls self.forward): the step's code was recorded from its start.
    report = audited(str(FF), f"--data={digits}", "--threshold=100")
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.where, f.value) == (0, "forward", "inf")
    assert report.run.replay.status == "reproduced" and f.localized_by == "in-process"
    assert report.run.rerun is None or report.run.rerun.status == "skipped"
    assert (f.op, f.cause) == ("aten.exp.default", "exp-overflow")
    assert f.source.file == str(FF) and f.source.line == line_of(FF, "torch.exp(")
    assert any(s.name == "self" and s.max >= 99 for s in f.inputs)


def test_forward_forward_threshold_overflow_is_named_by_the_rerun_of_the_steps_own_code(digits):
    # --rerun: the re-run traces the step's own code and names the same op.
    report = audited(str(FF), f"--data={digits}", "--threshold=100", force_rerun=True)
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.where, f.value) == (0, "forward", "inf")
    assert report.run.replay.status == "skipped" and "--rerun" in report.run.replay.note
    assert report.run.rerun.status == "reproduced" and f.localized_by == "re-run"
    assert (f.op, f.cause) == ("aten.exp.default", "exp-overflow")
    assert f.source.file == str(FF) and f.source.line == line_of(FF, "torch.exp(")
    assert any(s.name == "self" and s.max >= 99 for s in f.inputs)


LATER_STEP = ("import torch\nlin = torch.nn.Linear(3, 1)\n"
              "opt = torch.optim.SGD(lin.parameters(), lr=0.1)\n"
              "for step in range(5):\n"
              "    count = torch.tensor(0.0 if step == 2 else 4.0)\n"
              "    loss = lin.forward(torch.ones(4, 3)).pow(2).sum() / count\n"
              "    opt.zero_grad(); loss.backward(); opt.step()\n")


@pytest.mark.parametrize("rerun", [False, True], ids=["in-process", "rerun"])
def test_a_later_step_without_a_module_call_is_named_at_its_own_line(tmp_path, monkeypatch,
                                                                     rerun):
    # The stretch replayed (or traced) is the bad step's own: the earlier steps' are dropped.
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text(LATER_STEP)
    report = audited(str(path), force_rerun=rerun)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.op, f.cause) == (2, "aten.div.Tensor", "div-by-zero")
    assert f.source.line == 6
    if rerun:
        assert report.run.rerun.status == "reproduced" and f.localized_by == "re-run"
    else:
        assert report.run.replay.status == "reproduced" and f.localized_by == "in-process"


KEEP_GOING = """import torch
lin = torch.nn.Linear(3, 1)
torch.nn.init.constant_(lin.weight, 0.5); torch.nn.init.constant_(lin.bias, 0.1)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
for step in range(5):
    scale = torch.tensor(0.0 if step == {bad} else 1.0)
    loss = lin.forward(torch.ones(4, 3)).pow(2).mean() / scale
    opt.zero_grad(); loss.backward(); opt.step()
print(f"weight {{lin.weight.sum().item():.6f}}")
"""


def test_keep_going_without_module_calls_updates_every_step_after_a_skipped_one(tmp_path,
                                                                                  monkeypatch,
                                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    # Four clean updates (no bad step) against five steps with step 1 skipped: the same weights.
    (tmp_path / "clean.py").write_text(KEEP_GOING.format(bad=-1).replace("range(5)", "range(4)"))
    plain(str(tmp_path / "clean.py"))
    four_updates = capsys.readouterr().out
    (tmp_path / "train.py").write_text(KEEP_GOING.format(bad=1))
    report = audited(str(tmp_path / "train.py"), keep_going=True)
    assert capsys.readouterr().out == four_updates
    assert exit_code(report) == 1 and [f.step for f in report.findings] == [1]
    assert report.findings[0].action == "skipped" and len(report.timeline) == 5
