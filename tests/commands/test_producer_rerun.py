"""Issue 35, the data-code producer: when the batch of step N was already non-finite when the
model got it, `nanaudit run`'s re-run does not compute the model for the steps before N (the
data code does not depend on it), checks that it made the first run's bad batch bit for bit,
and re-runs in full (and says why) when the data code depends on the model: its outputs (an
environment stepped by the model's actions) or a random stream the model's dropout shares."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import line_of, run_cli

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

# The loop's own standardization of a batch with a constant feature: 0/0 at step 6. The data
# draws from its own generator, so the model's dropout (the global stream) changes nothing.
STANDARDIZED = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for step in range(10):
        raw, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step == 6:
            raw[:, 1] = 2.5                        # a constant feature in this batch
        x = (raw - raw.mean(0)) / raw.std(0)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if loss.item() < best:                     # the script's own use of the loss
            best = loss.item()
            torch.save(model.state_dict(), "best.pt")
"""

# The value is made at step 2 (a recalibration on a batch with a constant feature: 1/0) and
# reaches the training batch from step 6 on: the cheap re-run's first try, tracing only the
# last steps' data code, finds no op that made it, and its second try traces it all.
RECALIBRATED = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    scale = torch.ones(4)
    for step in range(10):
        raw = torch.randn(8, 4, generator=g)
        if step == 2:
            held = torch.randn(16, 4, generator=g)
            held[:, 1] = 1.0                       # a constant feature in the held-out batch
            scale = torch.ones(4) / held.std(0)
        x = raw * scale if step >= 6 else raw
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""

# An environment stepped by the model's actions: the rows whose action passed 1.0 are done,
# their feature 2 set to 0; once every row is done the standardization divides 0 by 0. Without
# the model (its output stood in for) no row is ever done.
ENVIRONMENT = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    action = None
    for step in range(30):
        state = torch.randn(8, 4, generator=g)
        if action is not None:
            state[:, 2] = torch.where(action[:, 0] > 1.0, 0.0, state[:, 2])
        obs = (state - state.mean(0)) / state.std(0)
        out = model(obs)
        loss = ((out - 3.0) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        action = out.detach()
"""

# The data code draws from the global stream (an augmentation) that the model's dropout draws
# from too: without the model the augmentation of every later batch would differ.
SHARED_STREAM = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x, y = torch.rand(8, 3), torch.rand(8, 1)
        if step == 4:
            x[:, 0] = 0.5                          # a constant feature in this batch
        x = (x - x.mean(0)) / x.std(0)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def _write(tmp_path, code: str):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path


@pytest.mark.slow
def test_the_rerun_of_the_loops_standardization_does_not_compute_the_model(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, STANDARDIZED)
    out = tmp_path / "report.json"
    html = tmp_path / "report.html"
    result = run_cli("run", "--json", out, "--html", html, "--quiet", str(path))
    report = json.loads(out.read_text())
    f, rerun = report["finding"], report["run"]["rerun"]
    assert result.code == 1
    assert (f["step"], f["where"], f["op"], f["cause"]) == (6, "input", "aten.div.Tensor",
                                                            "div-by-zero")
    assert f["source"]["line"] == line_of(path, "raw.std(0)")
    assert f["producer"]["made_by"] == "torch-op" and f["localized_by"] == "re-run"
    # Steps 0-5 before the bad one: the first call computed (its output's form), 5 stood in.
    assert rerun["status"] == "reproduced" and rerun["steps"] == 7
    assert rerun["model_skipped"] is True and rerun["stood_in"] == 5
    assert "model_note" not in rerun and rerun["duration_s"] > 0
    assert "did not compute the model before the bad step" in f["explanation"]
    assert "not computed before the bad step (5 call(s) stood in for)" in html.read_text()


@pytest.mark.slow
def test_a_value_made_steps_before_the_batch_is_traced_from_the_start(tmp_path):
    path = _write(tmp_path, RECALIBRATED)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f, rerun = report.finding, report.run.rerun
    assert (f.step, f.where, f.op, f.cause) == (6, "input", "aten.div.Tensor", "div-by-zero")
    assert f.source.line == line_of(path, "held.std(0)") and f.producer.made_by == "torch-op"
    assert f.producer.traced.startswith("the script's own code from its start to step 6")
    assert rerun.status == "reproduced" and rerun.model_skipped is True


@pytest.mark.slow
def test_data_stepped_by_the_models_output_is_rerun_with_the_model(tmp_path):
    path = _write(tmp_path, ENVIRONMENT)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f, rerun = report.finding, report.run.rerun
    assert (f.where, f.op, f.cause) == ("input", "aten.div.Tensor", "div-by-zero")
    assert f.step > 0 and f.source.line == line_of(path, "state.std(0)")
    assert rerun.status == "reproduced" and rerun.model_skipped is False
    assert "it depends on the model" in rerun.model_note and rerun.model_try_s > 0
    assert "computed the model" in f.explanation


@pytest.mark.slow
def test_data_drawing_from_the_stream_the_dropout_draws_from_is_rerun_with_the_model(
        tmp_path):
    path = _write(tmp_path, SHARED_STREAM)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f, rerun = report.finding, report.run.rerun
    assert (f.step, f.where, f.op, f.cause) == (4, "input", "aten.div.Tensor", "div-by-zero")
    assert f.source.line == line_of(path, "x.std(0)")
    assert rerun.status == "reproduced" and rerun.model_skipped is False
    assert "global random stream" in rerun.model_note


# The loop's feature ratio divides by a zero at step 4, row 3 (an inf in the batch); the
# model's tanh saturates, so the loss stays finite, but the weight gradient is 0 * inf = NaN and
# the script's own `clip_grad_norm_(..., error_if_nonfinite=True)` raises before any step.
CLIP_RAISES = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        raw = torch.randn(8, 4)
        if step == 4:
            raw[3, 1] = 0.0
        x = torch.cat([raw[:, :1] / raw[:, 1:2], raw[:, 1:]], dim=1)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        optimizer.step()
"""


@pytest.mark.slow
def test_a_batch_already_bad_when_the_script_raises_is_the_finding(tmp_path):
    # Before: an error trip whose replay blamed the model's backward (`aten.mm`,
    # masked-nonfinite-gradient): the step's inputs were never read, as no check came.
    path = _write(tmp_path, CLIP_RAISES)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert (f.step, f.where, f.value, f.cause, f.samples) == (4, "input", "-inf", "div-by-zero",
                                                               [3]), f
    assert f.op == "aten.div.Tensor" and f.source.line == line_of(path, "raw[:, 1:2]")
    assert "the script then raised RuntimeError: The total norm" in f.explanation
    assert report.run.rerun.status == "reproduced"


RAW_SCALE = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x = torch.randn(8, 16) * (3e38 if step == 2 else 1.0)     # raw values, never scaled
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_a_float32_overflow_in_the_data_code_is_not_told_to_use_float32(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(RAW_SCALE))
    f = run_script(ScriptTarget(path=str(path)), ScriptOptions()).finding
    assert (f.step, f.where, f.op, f.cause) == (2, "input", "aten.mul.Tensor", "dtype-overflow")
    assert f.source.line == line_of(path, "x = torch.randn(8, 16) * (3e38")
    assert "float32 max" in f.explanation
    assert "too large for any dtype to be the fix" in f.fix and "in float32" not in f.fix
