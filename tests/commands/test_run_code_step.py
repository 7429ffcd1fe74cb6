"""`nanaudit run` localizes in-process a step that calls no module: a model written as raw
tensors (a hand-written logistic regression over `nn.Parameter`s, its optimizer over them), a
head of raw tensors on a frozen encoder called under `no_grad`. The step's code is recorded from
the step's start (the optimizer's construction, then each update) to `backward`, and replayed
at the trip from the leaf tensors it read and the RNG streams as the step began; `--keep-going`
names each such bad step. A step the replay does not reproduce falls back to the re-run, saying
why; a script whose steps call a module records nothing between its steps."""

from __future__ import annotations

import textwrap

from helpers import line_of, plain

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget


def _run(tmp_path, code: str, **options):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path, run_script(ScriptTarget(path=str(path)), ScriptOptions(**options))


# A logistic regression written by hand; each step draws its batch and a dropout mask from the
# default generator (the replay must start from the step's RNG state to make the same ones).
# At the bad steps the batch is scaled up so that the sigmoid saturates: log(1 - 1) = -inf.
LOGISTIC = """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w, b], lr=0.5)
    for step in range(6):
        x = torch.randn(32, 4)
        y = (x[:, 0] > 0).float()
        if step in BAD:
            x = x * 1e4
        x = F.dropout(x, 0.1, training=True)
        p = torch.sigmoid(x @ w + b)
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"w {w.sum().item():.6f}")
"""


def test_a_step_of_raw_parameters_is_localized_in_process(tmp_path):
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(3,)"))
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert report.run.rerun is None or report.run.rerun.status == "skipped"


def test_keep_going_names_each_bad_step_of_raw_parameters(tmp_path, capsys):
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(1, 4)"), keep_going=True)
    assert exit_code(report) == 1 and report.error is None
    assert "w " in capsys.readouterr().out           # the script went on to its end
    assert [f.step for f in report.findings] == [1, 4]
    for f in report.findings:
        assert (f.op, f.cause, f.action) == ("aten.log.default", "log-domain", "skipped")
        assert f.localized_by == "in-process"
        assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")


# A frozen encoder called under no_grad (not a training call), a head of raw tensors trained
# by Adam; the loss divides by a count of the batch's positives, none at step 2.
FROZEN_ENCODER = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    head = torch.zeros(16, 1, requires_grad=True)
    opt = torch.optim.Adam([head], lr=1e-2)
    for step in range(5):
        x = torch.randn(16, 8)
        y = torch.zeros(16) if step == 2 else (x[:, 0] > 0).float()
        with torch.no_grad():
            features = encoder(x)
        score = (features @ head).squeeze(1)
        loss = ((score - y) ** 2 * y).sum() / y.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_head_of_raw_tensors_on_a_frozen_encoder_is_localized_in_process(tmp_path):
    path, report = _run(tmp_path, FROZEN_ENCODER)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.cause) == (2, "forward", "aten.div.Tensor", "div-by-zero")
    assert f.source.line == line_of(path, "loss = ((score - y)")
    assert f.localized_by == "in-process"


# The backward-only value of a raw-tensor step: sqrt's derivative at 0 (row 5 all zero).
SQRT = """
    import torch

    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(4):
        x = torch.randn(8, 4)
        if step == 2:
            x[5] = 0.0
        loss = torch.sqrt((x @ w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_gradient_made_in_the_backward_of_a_raw_tensor_step_is_localized_in_process(tmp_path):
    path, report = _run(tmp_path, SQRT)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause) == (2, "backward", "sqrt-domain")
    assert f.source.line == line_of(path, "loss = torch.sqrt(")
    assert f.localized_by == "in-process"


# A batch drawn from a generator of the script's own: the replay draws again from where that
# generator is now, makes another batch and another (finite) loss than the run's, so it says so
# and the re-run names the gradient's op.
OWN_GENERATOR = """
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.ones(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.01)
    for step in range(4):
        x = torch.randn(8, 4, generator=gen)
        if step == 2:
            x[5] = 0.0
        loss = torch.sqrt((x @ w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("next draw", torch.randn(1, generator=gen).item())
"""


def test_a_step_the_replay_does_not_reproduce_falls_back_to_the_rerun(tmp_path):
    path, report = _run(tmp_path, OWN_GENERATOR)
    f = report.finding
    assert exit_code(report) == 1
    assert report.run.replay.status == "not-reproduced"
    assert "loss" in report.run.replay.note
    assert report.run.rerun.status == "reproduced" and f.localized_by == "re-run"
    assert (f.step, f.where, f.cause) == (2, "backward", "sqrt-domain")
    assert f.source.line == line_of(path, "loss = torch.sqrt(")


def test_the_replay_leaves_the_scripts_own_generator_as_the_trip_left_it(tmp_path, capsys):
    # Under --keep-going the script goes on after the replay drew from its generator: its
    # next draw is the one `python` makes (the zero row does not draw).
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(OWN_GENERATOR))
    plain(str(path))
    printed = [line for line in capsys.readouterr().out.splitlines() if "next draw" in line]
    _, report = _run(tmp_path, OWN_GENERATOR, keep_going=True)
    assert [f.step for f in report.findings] == [2]
    assert [line for line in capsys.readouterr().out.splitlines()
            if "next draw" in line] == printed


# Whether nanaudit's recorder is on the torch function stack during each step's data code:
# recorded from the optimizer's construction up to the first step's model call (the step might
# have called none), never again for a script whose steps call a module.
DEPTH = """
    import torch
    from torch import nn

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        print("depth", step, torch._C._len_torch_function_stack())
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_script_whose_steps_call_a_module_records_nothing_between_its_steps(tmp_path, capsys):
    _, report = _run(tmp_path, DEPTH)
    assert exit_code(report) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("depth")]
    assert printed == ["depth 0 1", "depth 1 0", "depth 2 0", "depth 3 0"]
    # ...while the raw-parameter script's steps are recorded from each one's start
    _, report = _run(tmp_path, LOGISTIC.replace("BAD", "()").replace(
        "        x = torch.randn(32, 4)\n",
        "        x = torch.randn(32, 4)\n"
        "        print('depth', step, torch._C._len_torch_function_stack())\n"))
    assert exit_code(report) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("depth")]
    assert printed == [f"depth {s} 1" for s in range(6)]


def test_an_evaluation_before_training_ends_the_first_steps_recording(tmp_path, capsys):
    # A module called under no_grad after the optimizer's construction (an evaluation, as
    # Lightning's sanity check): its activations are not kept, and nothing is recorded after it.
    _, report = _run(tmp_path, DEPTH.replace(
        "    for step in range(4):\n",
        "    with torch.no_grad():\n"
        "        model(torch.randn(2, 4))\n"
        "    print('depth eval', torch._C._len_torch_function_stack())\n"
        "    for step in range(4):\n"))
    assert exit_code(report) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("depth")]
    assert printed == ["depth eval 0", "depth 0 0", "depth 1 0", "depth 2 0", "depth 3 0"]


# A raw tensor trained by no optimizer, its gradient summed over the steps by the script itself
# (never cleared): the replay's backward must not add the bad step's gradient to it again.
UNOPTIMIZED = """
    import torch

    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    scale = torch.ones((), requires_grad=True)      # no optimizer holds it
    opt = torch.optim.SGD([w], lr=0.01)
    expected = 0.0
    for step in range(4):
        x = torch.randn(8, 4)
        if step == 2:
            x[5] = 0.0
        loss = scale * torch.sqrt((x @ w) ** 2).mean()
        expected += float(torch.sqrt((x @ w) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(float(scale.grad) - expected) < 1e-4, f"{float(scale.grad)} != {expected}"
"""


def test_the_replay_adds_no_gradient_to_a_raw_tensor_no_optimizer_holds(tmp_path):
    path, report = _run(tmp_path, UNOPTIMIZED, keep_going=True)
    assert report.error is None                 # the script's own assertion held
    assert [f.step for f in report.findings] == [2]
    f = report.findings[0]
    assert (f.where, f.cause, f.localized_by) == ("backward", "sqrt-domain", "in-process")
    assert f.source.line == line_of(path, "loss = scale * torch.sqrt(")
