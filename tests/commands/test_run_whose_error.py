"""Whose error is it? An exception a hook of nanaudit's raised inside the script's call is
nanaudit's bug (exit 6, "please report it"), never the script's error (exit 4, "your code
raised"); an error of the user's that passes through a call nanaudit wraps for them (a patched
`clip_grad_norm_`, the mode recording the loss code, the wrapped `backward`) is still theirs,
with their line. Before, any exception out of the script was the script's."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from helpers import line_of, run_cli

import nanaudit

SCRIPT = """
    import sys

    import torch
    from torch import nn

    fault = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = torch.randn(6, 4), torch.randn(6, 1)
        out = model(x)
        if step == 2 and fault == "shapes":
            loss = ((out - torch.randn(5, 1)) ** 2).mean()      # FAULT
        else:
            loss = ((out - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == 2 and fault == "backward":
            loss.backward()                                     # FAULT
        if step == 2 and fault == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters())  # FAULT
        optimizer.step()
"""


def _run(tmp_path, fault: str) -> tuple[int, dict, str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "report.json"
    result = run_cli("run", "--json", out, script, fault)
    return result.code, json.loads(out.read_text()), result.stderr


@pytest.mark.parametrize("fault, exception", [("shapes", "RuntimeError"),
                                              ("backward", "RuntimeError"),
                                              ("clip", "TypeError")])
def test_the_users_error_through_a_call_nanaudit_wraps_is_still_the_users(tmp_path, fault,
                                                                          exception):
    code, report, _ = _run(tmp_path, fault)
    assert code == 4, report["error"]
    error = report["error"]
    assert error["exception"] == exception
    user = [f for f in error["frames"] if f["file"].endswith("train.py")]
    assert user[-1]["line"] == line_of(tmp_path / "train.py", "# FAULT" if fault == "shapes"
                                       else {"backward": "loss.backward()  ",
                                             "clip": "clip_grad_norm_"}[fault])


def test_an_exception_a_hook_of_nanaudits_raised_is_nanaudits_bug_not_the_scripts(
        tmp_path, monkeypatch):
    # A bug in the hook the script's every model call runs, as if written in nanaudit's file.
    from nanaudit.script import auditor
    namespace: dict = {}
    source = "def first_call(self, *args, **kwargs):\n    return {}['the step']\n"
    exec(compile(source, auditor.__file__, "exec"), namespace)
    monkeypatch.setattr(auditor.ScriptAuditor, "first_call", namespace["first_call"])
    code, report, stderr = _run(tmp_path, "none")
    assert code == 6
    error = report["error"]
    assert error["type"] == "InternalError" and "this is a bug in nanaudit" in error["hint"]
    assert error["message"] == "KeyError: 'the step'"
    assert os.path.dirname(nanaudit.__file__) in error["traceback"]
    assert "the script" not in stderr.split("Traceback")[0]


def test_the_error_the_scripts_own_sentinel_raises_is_the_scripts(tmp_path):
    # nanaudit's API raising at the script's call (Sentinel's NonFiniteError) is the script's
    # to handle: here the value it names is the run's finding, as for any raise on a NaN.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        from nanaudit import Sentinel

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sentinel = Sentinel(model, optimizer)
        for step in range(5):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            if step == 2:
                x[3] = float("nan")
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            sentinel.check(step, (x, y), loss)
            optimizer.step()
    """))
    out = tmp_path / "report.json"
    result = run_cli("run", "-q", "--no-rerun", "--json", out, script)
    report = json.loads(out.read_text())
    assert result.code == 1, report["error"]
    assert report["error"]["exception"] == "NonFiniteError"
    assert (report["finding"]["step"], report["finding"]["samples"]) == (2, [3])
