"""Adversarial probes (issue 30): hostile entrypoints and scripts, closed streams, signals at the
edges, odd paths. Each failed on the code before it: a stale "clean" verdict, a lost or
misplaced report, a wrong exit code or a raw traceback of ours."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import LINEAR_CASE, run_cli


def _nanaudit(*args, cwd, **popen):
    return subprocess.Popen([sys.executable, "-m", "nanaudit", *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _wait_for(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the point to signal"
        time.sleep(0.02)

# --- 1. user code that exits is the user's error, and every report is written -----------------

EXITING = {
    "sys.exit(0) in the model factory": ("build_model", "import sys; sys.exit(0)"),
    "sys.exit(3) in the model factory": ("build_model", "import sys; sys.exit(3)"),
    "argparse in the model factory": ("build_model", "import argparse; p = argparse."
                                      "ArgumentParser(); p.add_argument('--x', required=True); "
                                      "p.parse_args([])"),
    "GeneratorExit from the data": ("batches", "raise GeneratorExit()"),
}


@pytest.mark.parametrize("name", sorted(EXITING))
def test_user_code_that_exits_is_exit_4_over_the_stale_clean_report(tmp_path, case, name):
    function, statement = EXITING[name]
    config = case(LINEAR_CASE)
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert run_cli("scan", config, "-q", "--json", out, "--junit-xml", xml).code == 0
    assert json.loads(out.read_text())["status"] == "clean"
    code = LINEAR_CASE.replace(f"def {function}():\n", f"def {function}():\n    {statement}\n")
    (tmp_path / "case.py").write_text(code)
    result = run_cli("scan", config, "-q", "--json", out, "--junit-xml", xml)
    assert result.code == 4, result.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "error" and report["error"]["exit_code"] == 4
    assert report["error"]["exception"] in ("SystemExit", "GeneratorExit")
    assert any(f["file"] == str(tmp_path / "case.py") for f in report["error"]["frames"])
    assert report["error"]["exception"] in xml.read_text()     # rewritten too


# --- 2. a loss nanaudit saw non-finite is never "clean" ---------------------------------------

GUARDED_LOSS = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        if step == 3:
            loss = loss + torch.log(torch.zeros(()))
        optimizer.zero_grad()
        loss.backward()
        if not torch.isfinite(loss):
            sys.exit(0)          # the script's own guard: stop on a bad loss
        optimizer.step()
""")


@pytest.mark.slow
def test_a_script_that_exits_on_its_nan_loss_is_a_finding_not_clean(tmp_path):
    (tmp_path / "train.py").write_text(GUARDED_LOSS)
    out = tmp_path / "r.json"
    result = run_cli("run", "-q", "--json", out, tmp_path / "train.py")
    report = json.loads(out.read_text())
    assert result.code == 1 and report["status"] == "nonfinite"
    f = report["finding"]
    assert (f["step"], f["value"], f["op"], f["cause"]) == (3, "-inf", "aten.log.default",
                                                            "log-domain")
    assert report["run"]["rerun"]["status"] == "reproduced"
    assert [e["step"] for e in report["timeline"]] == [0, 1, 2, 3]


# --- 3. a stop signal the script's own handler takes still stops the run ---------------------

OWN_HANDLER = textwrap.dedent("""
    import pathlib, signal, time
    import torch
    from torch import nn

    stop = False
    def handler(signum, frame):          # as Lightning and the Trainer do: stop gracefully
        global stop
        stop = True
    signal.signal(signal.SIGTERM, handler)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        if stop:
            break
        loss = model(torch.randn(4, 3)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 2:
            pathlib.Path("marker").touch()
        time.sleep(0.1)
""")


@pytest.mark.slow
def test_sigterm_taken_by_the_scripts_own_handler_is_interrupted_143(tmp_path):
    (tmp_path / "train.py").write_text(OWN_HANDLER)
    proc = _nanaudit("run", "-q", "--json", "r.json", "train.py", cwd=tmp_path)
    _wait_for(tmp_path / "marker", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    report = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 143 and report["status"] == "interrupted"
    assert report["error"]["signal"] == "SIGTERM" and 3 <= report["steps_run"] < 40


# --- 4. a script that changes folder: reports where asked, the re-run from the start folder ----

CHDIR = textwrap.dedent("""
    import os
    import torch
    from torch import nn

    os.chdir("results")                   # the script's own output folder
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        if step == 3:
            loss = loss + torch.log(torch.zeros(()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
""")


@pytest.mark.slow
def test_a_script_that_changes_folder_keeps_reports_in_place_and_reruns(tmp_path):
    (tmp_path / "train.py").write_text(CHDIR)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("the user's own results\n")
    result = run_cli("run", "-q", "--json", "r.json", "--junit-xml", "r.xml", "train.py")
    assert (tmp_path / "results" / "r.json").read_text() == "the user's own results\n"
    assert not (tmp_path / "results" / "r.xml").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert result.code == 1 and report["run"]["rerun"]["status"] == "reproduced"
    assert (report["finding"]["step"], report["finding"]["op"]) == (3, "aten.log.default")
    assert (tmp_path / "r.xml").is_file()


def test_an_entrypoint_that_changes_folder_keeps_the_reports_and_bundle_in_place(tmp_path,
                                                                                 case):
    (tmp_path / "elsewhere").mkdir()
    code = LINEAR_CASE.replace("def build_model():\n", "def build_model():\n    import os; "
                               "os.chdir('elsewhere')\n")
    config = case(code.replace("yield torch.randn(4, 3, generator=g)",
                               "yield torch.full((4, 3), float('nan'))"))
    result = run_cli("scan", config, "-q", "--json", "r.json")
    assert result.code == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["repro"] == str(tmp_path / "repro-step0")
    assert list((tmp_path / "elsewhere").iterdir()) == []
