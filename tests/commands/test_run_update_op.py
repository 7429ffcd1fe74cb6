"""`nanaudit run`'s update trip names, besides the rule (test_run_update_replay.py): the op
torch.optim's implementation ran (single-tensor, foreach or fused, verified by running torch's
own update on one-element copies under the tracer), the script's line that called the step
(the innermost frame of the script's own code: past GradScaler's, Accelerate's frames), where
the optimizer was built (the line a fix edits), the module holding the parameter, and the state
the rule read as the op's inputs; every format shows them, escaped."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import ROOT, line_of
from rich.console import Console
from test_run_inprocess import audit, write
from test_run_update_replay import GAN

from nanaudit.commands.common import exit_code
from nanaudit.report.console import print_report
from nanaudit.report.formats import renderer_for
from nanaudit.script.update_op import update_op

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "update_trip.py"
BUILT = {"adam-eps": "lr=1e-2, eps=0.0)", "adam-inf-lr": 'lr=float("inf"))',
         "sgd-overflow": "lr=1e38, momentum=0.9)", "adam-foreach": "**{case[5:]: True}",
         "adam-fused": "**{case[5:]: True}", "sgd-foreach": "foreach=True)",
         "Adagrad-eps": "(params, eps=0.0)", "RAdam-eps": "(params, eps=0.0)"}


@pytest.mark.parametrize(("case", "op", "state"), [
    # torch.optim's single-tensor Adam (CPU's default): param.addcdiv_(exp_avg, denom, -step)
    ("adam-eps", "aten.addcdiv_.default", ["exp_avg", "exp_avg_sq"]),
    ("adam-inf-lr", "aten.addcdiv_.default", ["exp_avg", "exp_avg_sq"]),
    # foreach=True: one _foreach_addcdiv_ over the group, its step sizes a list of floats
    ("adam-foreach", "aten._foreach_addcdiv_.ScalarList", ["exp_avg", "exp_avg_sq"]),
    ("adam-fused", "aten._fused_adam_.default", ["exp_avg", "exp_avg_sq"]),
    # SGD: param.add_(momentum_buffer, alpha=-lr); foreach: _foreach_add_ of the buffers
    ("sgd-overflow", "aten.add_.Tensor", ["momentum_buffer"]),
    ("sgd-foreach", "aten._foreach_add_.List", ["momentum_buffer"]),
    ("Adagrad-eps", "aten.addcdiv_.default", ["sum"]),
    # RAdam's adaptive lr is bias_correction2 ** 0.5 / (sqrt(exp_avg_sq) + eps): 1 / 0 first
    ("RAdam-eps", "aten.reciprocal.default", ["exp_avg", "exp_avg_sq"]),
])
def test_an_update_trip_names_the_op_the_step_line_the_module_and_the_state(case, op, state):
    report = audit(SCRIPT, case)
    f = report.finding
    assert exit_code(report) == 1 and f.cause == "optimizer-update"
    assert (f.op, f.module, f.localized_by) == (op, "0", "in-process")
    assert report.run.replay.status == "reproduced" and report.run.replay.ops_traced > 0
    assert f.source.file == str(SCRIPT) and f.source.code == "optimizer.step()"
    assert f.source.line == line_of(SCRIPT, "    optimizer.step()")
    built = line_of(SCRIPT, BUILT[case])
    assert f"was built at update_trip.py:{built} (`" in f.explanation
    # the state the rule read, over the whole parameter (10 x 4): the rows no batch reached
    # hold the zeros the eps-0 rules divided by
    assert [s.name for s in f.inputs] == state
    assert all(s.shape == (10, 4) and s.nan == 0 for s in f.inputs)
    if case.endswith("eps") and case != "adam-inf-lr":
        assert f.inputs[-1].zeros >= 7 * 4 and f.inputs[-1].min == 0
        assert f" eps (its default 1e-08) at update_trip.py:{built}: " in f.fix or \
            f" eps (its default 1e-10) at update_trip.py:{built}: " in f.fix


def test_a_state_that_cannot_stand_for_the_one_before_the_step_names_no_op():
    # Adadelta's acc_delta after the step holds the NaN the step made: the state before the
    # step is gone, so nothing is run again and the op is left null, saying why.
    f = audit(SCRIPT, "Adadelta-eps").finding
    assert f.cause == "optimizer-update" and f.localized_by == "in-process"
    assert f.op is None and f.module == "0" and f.source.code == "optimizer.step()"
    assert "after the step is non-finite at the element (acc_delta)" in f.explanation


def test_the_reproduction_must_make_the_kind_of_value_the_run_saw():
    # Adam with eps 0 over a zero second moment: 0/0 is NaN. A run that saw inf there is not
    # what torch's update makes from this state: no op is named.
    p = torch.nn.Parameter(torch.ones(2, 3))
    adam = torch.optim.Adam([p], lr=1e-2, eps=0.0)
    p.grad = torch.zeros_like(p)
    adam.step()
    assert update_op(adam, adam.param_groups[0], p, (1, 2), "nan").op == "aten.addcdiv_.default"
    said = update_op(adam, adam.param_groups[0], p, (1, 2), "inf")
    assert said.op is None and "made nan, not the inf the run saw" in said.note
    # nothing of the script's was touched: its weight, state and step count are the step's
    assert bool(torch.isnan(p).all()) and float(adam.state[p]["step"]) == 1.0

    class Mine(torch.optim.Adam):      # a subclass's step is the script's code: not run
        pass
    mine = Mine([p], eps=0.0)
    assert update_op(mine, mine.param_groups[0], p, (0, 0), "nan").op is None


SCALED = '''
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0)
scaler = torch.amp.GradScaler("cpu")


def train_step(tokens):
    loss = model(tokens).pow(2).mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)   # <script>alert("x")</script> & ]]> ::error:: %0A
    scaler.update()


for step in range(4):
    train_step(torch.tensor([0, 2, 3, 2]))
'''


def test_a_scaled_step_in_a_function_is_the_scripts_scaler_step_line(tmp_path):
    path = write(tmp_path, SCALED)
    f = audit(path).finding
    assert (f.step, f.cause, f.op, f.module) == (0, "optimizer-update",
                                                 "aten.addcdiv_.default", "0")
    # the innermost frame of the script's own code: not GradScaler's, nor the loop's call
    assert (f.source.line, f.source.function) == (line_of(path, "scaler.step("), "train_step")
    assert f"AdamW was built at train.py:{line_of(path, 'AdamW(')}" in f.explanation


def test_the_step_line_is_the_update_that_made_the_value_not_the_step_that_read_it(tmp_path):
    # The generator's update (its `opt_g.step()`) made the weights non-finite; the critic's
    # step read them: the line is the generator's step, the module the generator's layer.
    path = write(tmp_path, GAN, "gan.py")
    f = audit(path).finding
    assert (f.step, f.cause, f.module, f.op) == (1, "optimizer-update", "0",
                                                 "aten.addcdiv_.default")
    assert f.source.line == line_of(path, "opt_g.step()") != line_of(path, "opt_d.step()")
    assert f"Adam was built at gan.py:{line_of(path, 'opt_g = ')}" in f.explanation


ACCELERATED = '''
import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
accelerator = Accelerator(cpu=True)
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(4):
    loss = model(torch.tensor([0, 2, 3, 2])).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
'''


def test_an_accelerate_step_is_the_scripts_line_not_the_librarys(tmp_path):
    pytest.importorskip("accelerate")
    path = write(tmp_path, ACCELERATED)
    f = audit(path).finding
    assert (f.step, f.cause, f.op) == (0, "optimizer-update", "aten.addcdiv_.default")
    # Accelerate's AcceleratedOptimizer.step calls the torch optimizer's: an installed
    # library's frame, passed for the script's own `optimizer.step()`
    assert f.source.file == str(path) and f.source.line == line_of(path, "optimizer.step()")


def test_every_format_shows_the_op_its_inputs_and_the_line_escaped(tmp_path):
    path = write(tmp_path, SCALED)
    report = audit(path)
    out = io.StringIO()
    print_report(report, Console(file=out, width=160, force_terminal=False, color_system=None,
                                 highlight=False))
    console = out.getvalue()
    assert "inputs of the op that created it" in console and "exp_avg_sq" in console
    assert "aten.addcdiv_.default" in console and "scaler.step(optimizer)" in console
    # the hint names the build as where to edit, the step line as where the update ran
    assert (f"change the optimizer as the fix says (train.py:{line_of(path, 'scaler.step(')} "
            f"is the step that applied the update)") in console
    texts = {fmt: renderer_for(fmt).render(report) for fmt in ("markdown", "html", "junit",
                                                               "github", "json")}
    for fmt, text in texts.items():
        assert "aten.addcdiv_.default" in text, fmt
    assert "exp_avg_sq" in texts["markdown"] and "exp_avg_sq" in texts["html"]
    assert '<script>alert("x")' not in texts["html"]
    ET.fromstring(texts["junit"])                     # still well-formed XML
    line = line_of(path, "scaler.step(")
    errors = [t for t in texts["github"].splitlines() if t.startswith("::error")]
    assert f"line={line}" in errors[0] and errors[0].count("::") == 2
    body = json.loads(texts["json"])["finding"]
    assert body["source"]["line"] == line and "::error::" in body["source"]["code"]


ONE_STEP = '''
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
loss = model(torch.tensor([0, 2, 3, 2])).pow(2).mean()
loss.backward()
optimizer.step()
print("trained")
'''


def test_an_update_found_at_the_scripts_end_names_the_step_it_kept(tmp_path):
    # The only update is found when the script has ended: no step is on the stack then, and
    # the line is the one kept when the step ran.
    path = write(tmp_path, ONE_STEP)
    f = audit(path).finding
    assert (f.step, f.cause, f.op) == (0, "optimizer-update", "aten.addcdiv_.default")
    assert (f.source.line, f.source.code) == (line_of(path, "optimizer.step()"),
                                              "optimizer.step()")


TWO_DEPTHS = '''
import contextlib

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    if step == 3:
        optimizer.param_groups[0]["lr"] = float("inf")
        with contextlib.ExitStack() as later:
            later.callback(scaler.step, optimizer)
    else:
        scaler.step(optimizer)
    scaler.update()
'''


def test_an_update_under_a_gradscaler_that_left_the_weights_non_finite_is_its_steps_finding(
        tmp_path):
    # The NaN loss the next step's forward makes of those weights makes the GradScaler skip
    # that step, where no check reads the weights: before, the finding was that step's forward
    # (step 4, cause unknown, a re-run from the start), not the update.
    path = write(tmp_path, TWO_DEPTHS.replace("with contextlib.ExitStack() as later:\n"
                                              "            later.callback(scaler.step, "
                                              "optimizer)", "scaler.step(optimizer)"))
    assert "ExitStack" not in path.read_text()
    report = audit(path)
    f = report.finding
    assert (f.step, f.where, f.cause, f.op) == (3, "optimizer", "optimizer-update",
                                                "aten.addcdiv_.default")
    assert "GradScaler skipped this step" not in f.explanation
    assert report.run.rerun is None


def test_a_step_wrapper_reached_at_two_depths_names_the_scripts_line_each_time(tmp_path):
    # GradScaler's step is called by the script at steps 0-2, and at step 3 through the
    # standard library (an ExitStack's callback): two frames more between torch's caller of
    # the optimizer's step and the script. The depth learned at step 0 named contextlib's
    # line at step 3; it is learned again when the frame it finds is not the script's.
    path = write(tmp_path, TWO_DEPTHS)
    f = audit(path).finding
    assert (f.step, f.cause) == (3, "optimizer-update")
    assert f.source.file == str(path)
    assert f.source.line == line_of(path, "with contextlib.ExitStack() as later:")
