"""`nanaudit run`: unmodified scripts audited in-process, localized by a re-run to the bad step."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_cli

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

SCRIPTS = ROOT / "configs" / "examples" / "scripts"


def script(name: str, *args: str, **options):
    return run_script(ScriptTarget(path=str(SCRIPTS / name), args=args), ScriptOptions(**options))


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def write(tmp_path: Path, code: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


LOOP = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    lr = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(6):
        x = torch.randn(5, 4)
        {poison}
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.slow
def test_plain_loop_log_zero_is_localized_by_the_rerun_under_gradient_accumulation():
    # Batch 5 holds the zero; with 2 micro-batches per optimizer step that is step 2, and the
    # traced window (both micro-batches of step 2) names the row of the second one.
    report = script("plain_log_counts.py", "--lr", "1e-2", "--epochs", "1", "--accumulate", "2",
                    force_rerun=True)
    f = report.finding
    assert exit_code(report) == 1 and report.status == "nonfinite"
    assert (f.step, f.where, f.op, f.module, f.cause) == (2, "forward", "aten.log.default",
                                                         "encoder", "log-domain")
    path = SCRIPTS / "plain_log_counts.py"
    assert f.source.file == str(path) and f.source.line == line_of(path, "torch.log(counts)")
    assert f.samples == [3] and f.reproduced is True
    assert f.chain[0].op == "aten.log.default"
    # It received finite counts (a zero among them) and returned -inf: the op made the value.
    assert f.chain[0].received == ["self: finite"] and f.chain[0].value == ["-inf"]
    # Every later op received a non-finite input (the chain carries it to the loss).
    assert f.chain[1].received == ["self: finite", "mat1: -inf", "mat2: finite"]
    assert all(any(not r.endswith(": finite") for r in link.received) for link in f.chain[1:])
    assert report.run.rerun.status == "reproduced"
    assert report.run.rerun.steps == 3
    assert [e.step for e in report.timeline] == [0, 1, 2]


def test_clean_script_exits_0_through_the_cli_with_its_own_flags(tmp_path):
    out = tmp_path / "report.json"
    result = run_cli("run", "--quiet", "--json", out, SCRIPTS / "plain_log_counts.py",
                     "--poison-step", "-1", "--steps", "7")
    report = json.loads(out.read_text())
    assert result.code == 0 and report["status"] == "clean" and report["command"] == "run"
    assert report["steps_run"] == 7 and report["finding"] is None
    assert report["config"]["argv"] == ["--poison-step", "-1", "--steps", "7"]


def test_ci_outputs_of_a_finding(tmp_path):
    junit, markdown = tmp_path / "r.xml", tmp_path / "r.md"
    result = run_cli("run", "-q", "--no-rerun", "--format", "github", "--junit-xml", junit,
                     "--markdown", markdown, SCRIPTS / "plain_log_counts.py")
    assert result.code == 1
    assert result.stdout.startswith("::error") and "step 5" in result.stdout
    assert "<failure" in junit.read_text() and "step 5" in markdown.read_text()


def test_no_rerun_and_max_rerun_steps_report_the_first_run_only():
    report = script("plain_log_counts.py", rerun=False)
    f = report.finding
    assert (f.step, f.where, f.op, f.reproduced) == (5, "forward", None, None)
    assert "--no-rerun" in f.explanation and "encoder.proj.weight" in f.tensors
    assert report.run.rerun.status == "skipped"
    bounded = script("plain_log_counts.py", max_rerun_steps=3, force_rerun=True)
    assert bounded.finding.op is None
    assert "repeats 6 steps, more than --max-rerun-steps 3" in bounded.finding.explanation


@pytest.mark.slow
def test_a_non_deterministic_script_is_reported_as_such():
    report = script("nondeterministic_seed.py", force_rerun=True)
    f = report.finding
    rerun = report.run.rerun
    assert exit_code(report) == 1
    assert rerun.status == "nondeterministic" and "loss at step 0" in rerun.note
    assert f.step == 3 and f.reproduced is False and f.op is None
    assert "not deterministic" in f.explanation and "body.0.weight" in f.tensors


def test_script_sees_main_argv_file_and_path(tmp_path):
    path = write(tmp_path, """
        import os, sys
        import torch
        assert __name__ == "__main__"
        assert sys.argv == [sys.argv[0], "--flag", "x"] and sys.argv[0].endswith("probe.py")
        assert __file__.endswith("probe.py") and sys.path[0] == os.path.dirname(__file__)
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        (w * 2).sum().backward()
        opt.step()
    """, "probe.py")
    report = run_script(ScriptTarget(path=str(path), args=("--flag", "x")))
    assert report.status == "clean", report.error
    assert sys.argv[0] != str(path)


@pytest.mark.slow
def test_module_target_runs_like_python_dash_m(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, LOOP.format(poison="x[2, 1] = float('inf') if step == 4 else 0.0"),
          "train.py")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    # After `-m MODULE` every argument is the module's, even one named like nanaudit's.
    result = run_cli("run", "-q", "--json", out, "-m", "mypkg.train", "0.1", "--seed", "7")
    report = json.loads(out.read_text())
    f = report["finding"]
    assert result.code == 1
    assert (f["step"], f["where"], f["cause"], f["samples"], f["value"]) == (
        4, "input", "nonfinite-input", [2], "inf")
    assert report["config"]["path"] == "-m mypkg.train" and report["config"]["seed"] == 0
    assert report["config"]["argv"] == ["0.1", "--seed", "7"]


def test_one_host_read_per_optimizer_step(tmp_path, host_reads):
    path = write(tmp_path, LOOP.format(poison="pass"))
    report = run_script(ScriptTarget(path=str(path)))
    assert report.status == "clean" and report.steps_run == 6
    # One read per step plus the final check of the last update's parameters.
    assert host_reads["tolist"] == 6 and host_reads["item"] == 1


def test_a_bad_update_is_the_optimizer_step_that_made_it(tmp_path):
    path = write(tmp_path, LOOP.format(poison="pass"))
    report = run_script(ScriptTarget(path=str(path), args=("inf",)))
    f = report.finding
    assert (f.step, f.where, f.cause) == (0, "optimizer", "optimizer-update")
    assert "SGD(lr=inf" in f.explanation and f.tensors[0] == "0.weight"


def test_hooks_are_removed_after_the_run(tmp_path):
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks
    backward = torch.autograd.backward
    path = write(tmp_path, LOOP.format(poison="x[0, 0] = float('nan') if step == 1 else 0.0"))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(rerun=False))
    assert report.finding.where == "input"
    assert torch.autograd.backward is backward
    assert not module_hooks._global_forward_pre_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks


def test_a_script_that_raises_is_exit_4_with_its_frames(tmp_path):
    path = write(tmp_path, """
        def load():
            raise FileNotFoundError("data/train.bin")

        load()
    """)
    report = run_script(ScriptTarget(path=str(path)))
    assert exit_code(report) == 4
    frames = report.error.frames
    assert frames[-1].file == str(path) and frames[-1].line == 3
    assert all("runpy" not in f.file and "nanaudit" not in f.file for f in frames)


def test_a_script_that_never_steps_is_exit_5(tmp_path):
    path = write(tmp_path, "import torch\nprint(torch.ones(2).sum())\n")
    report = run_script(ScriptTarget(path=str(path)))
    assert exit_code(report) == 5
    assert "without stepping an optimizer" in report.error.message


def test_interrupt_leaves_a_valid_partial_report(tmp_path):
    path = write(tmp_path, LOOP.format(poison="if step == 3: raise KeyboardInterrupt"))
    out = tmp_path / "r.json"
    result = run_cli("run", "-q", "--json", out, path)
    report = json.loads(out.read_text())
    assert result.code == 130 and report["status"] == "interrupted"
    assert report["steps_run"] == 3


def test_sigterm_caught_by_a_framework_still_ends_as_interrupted(tmp_path):
    # Lightning catches KeyboardInterrupt for a graceful shutdown and returns normally.
    path = write(tmp_path, LOOP.format(poison="""
        if step == 2:
            import os, signal
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except KeyboardInterrupt:
                break"""))
    report = run_script(ScriptTarget(path=str(path)))
    assert report.status == "interrupted" and report.steps_run == 2


def test_sigterm_is_exit_143_with_the_signal_in_the_report(tmp_path):
    path = write(tmp_path, LOOP.format(poison="""
        if step == 2:
            import os, signal
            os.kill(os.getpid(), signal.SIGTERM)"""))
    out = tmp_path / "r.json"
    result = run_cli("run", "-q", "--json", out, path)
    report = json.loads(out.read_text())
    assert result.code == 143 and report["status"] == "interrupted"
    assert report["error"]["signal"] == "SIGTERM" and report["steps_run"] == 2


def test_usage_and_missing_script(tmp_path):
    assert run_cli("run").code == 2
    out = tmp_path / "r.json"
    assert run_cli("run", "-q", "--json", out, tmp_path / "nope.py").code == 3
    assert "no such script" in json.loads(out.read_text())["error"]["message"]


def test_grad_scaler_skips_are_not_findings():
    report = script("amp_grad_scaler_clean.py")
    assert report.status == "clean" and exit_code(report) == 0
    # 30 iterations, the first ones skipped by the scaler: steps all the same, as the loop
    # counts them (before: only the updates applied were counted, fewer than 30).
    skipped = [entry.step for entry in report.timeline if entry.skipped]
    assert report.steps_run == 30 and skipped and skipped[0] == 0


@pytest.mark.slow
def test_lightning_script_fp16_overflow():
    pytest.importorskip("lightning")
    report = script("lightning_fp16_penalty.py")
    f = report.finding
    path = SCRIPTS / "lightning_fp16_penalty.py"
    assert (f.step, f.where, f.op, f.module, f.cause) == (4, "forward", "aten.pow.Tensor_Scalar",
                                                         "penalty", "dtype-overflow")
    assert f.source.line == line_of(path, "h.half().pow(2)") and f.samples == [2]
    assert f.reproduced is True and "65504" in f.explanation
    # Lightning's `optimizer.step(closure)`: the closure's step replayed in-process (issue 35).
    assert f.localized_by == "in-process" and report.run.rerun is None
    clean = script("lightning_fp16_penalty.py", "--poison-sample", "-1", "--max-steps", "4")
    assert clean.status == "clean" and clean.steps_run == 4


@pytest.mark.slow
def test_trainer_script_poisoned_sample():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = script("trainer_zero_sample.py")
    f = report.finding
    path = SCRIPTS / "trainer_zero_sample.py"
    assert (f.step, f.where, f.op, f.module, f.cause) == (5, "forward", "aten.div.Tensor",
                                                         "normalize", "div-by-zero")
    assert f.source.line == line_of(path, "return x / x.norm(")
    assert f.reproduced is True and len(f.samples) == 1
    assert f.localized_by == "in-process" and report.run.rerun is None
    clean = script("trainer_zero_sample.py", "--poison-sample", "-1", "--max-steps", "3")
    assert clean.status == "clean" and clean.steps_run == 3


@pytest.mark.slow
def test_accelerate_script_backward_finding_names_the_forward_op():
    pytest.importorskip("accelerate")
    report = script("accelerate_zero_norm.py")
    f = report.finding
    path = SCRIPTS / "accelerate_zero_norm.py"
    assert (f.step, f.where, f.forward_op, f.module, f.cause) == (5, "backward",
                                                                 "aten.sqrt.default", "length",
                                                                 "sqrt-domain")
    assert f.source.line == line_of(path, "return torch.sqrt(") and f.tensors == ["proj.weight"]
    assert f.localized_by == "in-process" and report.run.rerun is None
    # Accelerate's wrapped optimizer steps the real one once: one check per step, not two.
    clean = script("accelerate_zero_norm.py", "--poison-sample", "-1", "--epochs", "2")
    assert clean.status == "clean" and clean.steps_run == 16


@pytest.mark.slow
def test_under_torchrun_every_rank_names_the_rank_that_made_the_value(tmp_path):
    from helpers import launch_ranks
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out,
                                   SCRIPTS / "ddp_log_counts.py"])
    assert codes == [1, 1], outputs
    rank0 = json.loads(out.read_text())
    rank1 = json.loads((tmp_path / "report.rank1.json").read_text())
    # DDP all-reduces the gradients, so both ranks' go bad at step 3; the exchanged flags and
    # rank 1's in-process replay of its own step name rank 1, whose batch held the zero, in
    # both reports (issue 35: no re-run).
    for report in (rank0, rank1):
        f = report["finding"]
        assert (f["step"], f["rank"], f["where"], f["op"], f["samples"]) == (
            3, 1, "forward", "aten.log.default", [2])
        assert report["run"]["replay"]["status"] == "reproduced"
        assert f["localized_by"] == "in-process" and "rerun" not in report["run"]
    assert (rank0["run"]["rank"], rank1["run"]["rank"]) == (0, 1)
    assert [r["status"] for r in rank0["distributed"]["ranks"]] == ["nonfinite", "nonfinite"]


@pytest.mark.parametrize("seed", [-1, 2**40])
def test_any_seed_the_command_line_takes_seeds_numpy_too(tmp_path, seed):
    # Two seeding routines disagreed: one reduced the seed for NumPy, the other did not, so
    # `nanaudit run --seed -1` made NumPy raise inside our seeding, reported as the script's.
    path = write(tmp_path, "    import numpy\n" + LOOP.format(poison="pass").lstrip("\n"))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(seed=seed))
    assert report.status == "clean", report.error
    assert report.config["seed"] == seed
