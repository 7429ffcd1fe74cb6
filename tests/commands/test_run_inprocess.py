"""`nanaudit run` localizes a loss or gradient trip in the process that tripped: the bad step's
window replayed from the step record, verified against what the run saw, no second run."""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

SCRIPTS = ROOT / "configs" / "examples" / "scripts"


def audit(path: Path | str, *args: str, **options):
    return run_script(ScriptTarget(path=str(path), args=args), ScriptOptions(**options))


def write(tmp_path: Path, code: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def in_process(report) -> None:
    """The op was named by the in-process replay, and nothing ran the script again."""
    assert report.finding.localized_by == "in-process" and report.finding.reproduced is True
    assert report.run.replay.status == "reproduced" and report.run.rerun is None
    assert report.run.replay.steps == 1 and report.run.replay.ops_traced > 0


@pytest.mark.slow
def test_accumulation_window_is_replayed_in_process_with_the_same_finding_as_the_rerun():
    args = ("--lr", "1e-2", "--epochs", "1", "--accumulate", "2")
    report = audit(SCRIPTS / "plain_log_counts.py", *args)
    f = report.finding
    assert exit_code(report) == 1
    # Batch 5 (the second micro-batch of step 2) holds the zero count: row 3 of it.
    assert (f.step, f.where, f.op, f.module, f.cause) == (2, "forward", "aten.log.default",
                                                         "encoder", "log-domain")
    path = SCRIPTS / "plain_log_counts.py"
    assert f.source.line == line_of(path, "torch.log(counts)") and f.samples == [3]
    assert f.chain[0].received == ["self: finite"] and f.chain[0].value == ["-inf"]
    in_process(report)
    rerun = audit(path, *args, force_rerun=True).finding
    assert rerun.localized_by == "re-run"
    assert (rerun.op, rerun.module, rerun.source, rerun.samples, rerun.cause) == (
        f.op, f.module, f.source, f.samples, f.cause)


def test_a_script_seeded_from_os_urandom_is_localized_at_the_trip():
    # The re-run from the start cannot follow it (test_run_script: "not deterministic"); the
    # replay of the step from the state the run holds can.
    report = audit(SCRIPTS / "nondeterministic_seed.py")
    f = report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (3, "forward", "aten.log.default",
                                                          "log-domain", [6])
    assert "not deterministic" not in f.explanation
    in_process(report)


def test_a_loss_skipped_before_backward_is_a_finding_with_its_op(tmp_path):
    # The commonest hand-written guard: the step's loss is -inf, the script skips it. Before,
    # nanaudit saw no loss reach backward and reported a clean run (exit 0).
    path = ROOT / "tests" / "e2e" / "scripts" / "guarded_loss.py"
    report = audit(path)
    f = report.finding
    assert exit_code(report) == 1 and report.status == "nonfinite"
    assert (f.step, f.where, f.op, f.cause, f.value) == (3, "forward", "aten.log.default",
                                                        "log-domain", "inf")
    assert f.source.line == line_of(path, "loss = -torch.log(") and f.samples == [5]
    assert "skipped it before backward" in f.explanation
    in_process(report)
    # The same guard on the script's last step: the loss is read when the script ends.
    last = write(tmp_path, path.read_text().replace("BAD = 3", "BAD = 5"), "last.py")
    assert (audit(last).finding.step, audit(last).finding.op) == (5, "aten.log.default")


def test_grad_scaler_and_autocast_loss_trip_is_replayed_with_the_scaled_backward(tmp_path):
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for step in range(6):
            optimizer.zero_grad()
            for micro in range(2):          # the first micro-batch's bf16 loss must match too
                x = torch.rand(4, 4) + 0.1
                if step == 2 and micro == 1:
                    x[1] = -1.0
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                    loss = torch.sqrt(x.mean(1)).mean() + out.pow(2).mean()
                scaler.scale(loss / 2).backward()
            scaler.step(optimizer)
            scaler.update()
    """)
    report = audit(path)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (2, "forward", "aten.sqrt.default",
                                                          "sqrt-domain", [1])
    assert f.source.line == line_of(path, "torch.sqrt(x.mean(1))")
    in_process(report)


def test_lbfgs_closure_gradient_trip_is_replayed_in_process(tmp_path):
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
        for step in range(5):
            x = torch.randn(6, 3)
            if step == 2:
                x[4] = 0.0

            def closure():
                optimizer.zero_grad()
                loss = torch.sqrt(model(x).pow(2) * x[:, :1].pow(2)).mean()
                loss.backward()
                return loss
            optimizer.step(closure)
    """)
    report = audit(path)
    f = report.finding
    # sqrt's backward divides by the zero norm of row 4: a gradient trip at step 2.
    assert (f.step, f.where, f.forward_op, f.cause) == (2, "backward", "aten.sqrt.default",
                                                        "sqrt-domain")
    assert f.source.line == line_of(path, "torch.sqrt(model(x)")
    in_process(report)


@pytest.mark.slow
def test_a_replay_that_differs_from_the_run_is_not_believed_and_the_rerun_names_it(tmp_path):
    # The model's forward reads a counter its calls advance: the replay calls it once more, so
    # its loss differs from the run's, and no op is named from it.
    path = write(tmp_path, """
        import torch
        from torch import nn

        class Drifting(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 1)
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                return self.lin(x) * self.calls + torch.sqrt(self.lin.weight.sum() * 0 + x[:, :1])

        torch.manual_seed(0)
        model = Drifting()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(5):
            x = torch.rand(4, 4) + 0.1
            if step == 3:
                x[2, 0] = 0.0
            loss = model(x).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """)
    report = audit(path)
    replay = report.run.replay
    assert replay.status == "not-reproduced" and "where the run saw" in replay.note
    assert report.run.rerun.status == "reproduced"
    f = report.finding
    assert (f.step, f.where, f.forward_op, f.localized_by) == (3, "backward",
                                                               "aten.sqrt.default", "re-run")


@pytest.mark.slow
def test_rerun_flag_forces_the_rerun_and_the_json_says_which_path(tmp_path):
    out, forced = tmp_path / "r.json", tmp_path / "forced.json"
    script = SCRIPTS / "plain_log_counts.py"
    assert run_cli("run", "-q", "--json", out, script).code == 1
    assert run_cli("run", "-q", "--rerun", "--json", forced, script).code == 1
    report, rerun = json.loads(out.read_text()), json.loads(forced.read_text())
    assert report["finding"]["localized_by"] == "in-process"
    assert report["run"]["replay"]["status"] == "reproduced" and "rerun" not in report["run"]
    assert rerun["finding"]["localized_by"] == "re-run"
    assert rerun["run"]["rerun"]["status"] == "reproduced"
    assert "--rerun" in rerun["run"]["replay"]["note"]
    assert rerun["finding"]["op"] == report["finding"]["op"] == "aten.log.default"


@pytest.mark.parametrize("flag", ["--no-rerun"])
def test_no_rerun_names_no_op_either_way(tmp_path, flag):
    out = tmp_path / "r.json"
    assert run_cli("run", "-q", flag, "--json", out, SCRIPTS / "plain_log_counts.py").code == 1
    finding = json.loads(out.read_text())["finding"]
    assert finding["op"] is None and "localized_by" not in finding


LOGS_AND_CHECKPOINTS = """
    import json, os
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists("ckpt.pt"):           # resume, as long runs do
        state = torch.load("ckpt.pt", weights_only=True)
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    for step in range(start, 60):
        x = torch.rand(8, 4) + 0.5
        if step == 40:
            x[3, 2] = 0.0
        loss = (model(x) * torch.log(x).sum(1, keepdim=True)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with open("train_log.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\\n")
        if step % 10 == 0:
            torch.save({"model": model.state_dict(), "step": step}, "ckpt.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("force_rerun", [False, True])
def test_the_users_log_and_checkpoint_are_as_the_first_run_left_them(tmp_path, monkeypatch,
                                                                     force_rerun):
    # Before: the re-run from the start appended the log's 40 lines again, rewrote the
    # checkpoints, and resumed from the checkpoint the first run left (not deterministic).
    import torch
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, LOGS_AND_CHECKPOINTS)
    report = audit(path, force_rerun=force_rerun)
    f = report.finding
    assert (f.step, f.op, f.cause, f.samples) == (40, "aten.log.default", "log-domain", [3])
    assert f.localized_by == ("re-run" if force_rerun else "in-process")
    assert f.reproduced is True and "not deterministic" not in f.explanation
    lines = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(40))
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "train.py", "train_log.jsonl"]


@pytest.mark.slow
def test_a_file_the_first_run_changed_is_named_when_the_rerun_reads_it(tmp_path, monkeypatch):
    import torch
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, LOGS_AND_CHECKPOINTS)
    torch.manual_seed(0)
    torch.save({"model": torch.nn.Linear(4, 1).state_dict(), "step": 5}, tmp_path / "ckpt.pt")
    report = audit(path, force_rerun=True)
    # The first run resumed from step 6 and overwrote ckpt.pt; the re-run resumes from what
    # it left, and the report says so rather than pretending it ran as the first run did.
    assert "the first run had changed ckpt.pt" in report.finding.explanation


def test_a_hand_written_update_without_an_optimizer_is_replayed_in_process(tmp_path):
    path = write(tmp_path, """
        import torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        for step in range(6):
            x = torch.rand(4, 3) + 0.1
            if step == 4:
                x[1, 0] = 0.0
            loss = torch.sqrt(model(x).pow(2) * x[:, :1]).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
    """)
    report = audit(path)
    f = report.finding
    assert (f.step, f.where, f.forward_op, f.cause, f.samples) == (
        4, "backward", "aten.sqrt.default", "sqrt-domain", [1])
    in_process(report)


VAR_OF_ONE_ROW = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, rows in enumerate([16, 16, 16, 1]):
        out = model(torch.randn(rows, 8))
        loss = out.mean() + 0.1 * out.var(0).sum()     # var of one row: NaN, and a warning
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_torchs_warning_in_the_loss_code_names_the_scripts_line_once(tmp_path):
    """torch warns in an op the step's record ran through its mode: the warning names the
    script's line (not nanaudit's frame that called the op), and the replay at the trip does
    not repeat it."""
    path = write(tmp_path, VAR_OF_ONE_ROW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = audit(path)
    assert (report.finding.step, report.finding.op) == (3, "aten.var.correction")
    in_process(report)
    seen = [(w.filename, w.lineno) for w in caught if "degrees of freedom" in str(w.message)]
    assert seen == [(str(path), line_of(path, "out.var(0)"))]


def test_the_same_torch_warning_from_two_script_lines_is_shown_at_each(tmp_path):
    """Under the default action a warning shows once per location: per script line, as without
    nanaudit. Before, Python keyed it by nanaudit's line and the second line's went unshown."""
    path = write(tmp_path, VAR_OF_ONE_ROW.replace(
        "        loss = out.mean() + 0.1 * out.var(0).sum()     # var of one row: NaN, and a "
        "warning\n",
        "        spread = out.var(0).sum()\n"
        "        loss = out.mean() + 0.1 * spread + 0.1 * out.var(0).mean()\n"))
    assert "spread = out.var(0)" in path.read_text()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        report = audit(path)
    assert report.finding.step == 3 and report.finding.localized_by == "in-process"
    seen = [(w.filename, w.lineno) for w in caught if "degrees of freedom" in str(w.message)]
    assert seen == [(str(path), line_of(path, "spread = out.var(0)")),
                    (str(path), line_of(path, "0.1 * out.var(0).mean()"))]


# A model the script calls in pieces, one of them with no parameters (a normalizer), and a
# 0-dim value of the loss code made before the last piece: the decoder's call takes the
# normalizer's output, so it goes on with the same forward, not the next micro-batch's (which
# takes data), and its input is no batch. The relu makes all-zero rows at step 0: 0/0.
PIECES = """
    import torch
    from torch import nn
    torch.manual_seed(0)

    class RowNormalize(nn.Module):
        def forward(self, h):
            return h / h.norm(dim=1, keepdim=True)

    enc, norm, dec = nn.Linear(8, 4), RowNormalize(), nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
    for step in range(5):
        unit = norm(torch.relu(enc(torch.randn(16, 8))))
        spread = unit.std()
        loss = dec(unit).pow(2).mean() + 0.1 * spread
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_a_module_called_on_another_modules_output_continues_its_forward(tmp_path):
    path = write(tmp_path, PIECES)
    report = audit(path)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause, f.module) == (
        0, "forward", "aten.div.Tensor", "div-by-zero", "norm")
    assert f.source.line == line_of(path, "return h / h.norm")
    assert f.samples and f.micro_batch is None
    in_process(report)
