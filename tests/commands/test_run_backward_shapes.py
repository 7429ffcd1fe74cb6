"""`nanaudit run` replays a step in-process however the script differentiates it: a direct
`torch.autograd.backward([...])` of several losses, a non-scalar `backward(gradient)`, gradients
taken with `torch.autograd.grad` and set by the script (before, only the re-run named those), a
closure step after a forward of the script's own (a metric computed with autograd on): each names the
op, the step and the row, from the same process. A `torch.func` ensemble under vmap, whose
tensors exist only inside the transform, is named by the re-run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

# The row 5 of step 3's batch is all zero: the norm of its masked output is sqrt(0), finite in
# forward, whose derivative is infinite (NaN gradients). BACKWARD is how the step differentiates.
LOOP = """
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def lengths(x):
        out = model(x) * (x.abs().sum(1, keepdim=True) > 0)
        return torch.sqrt((out * out).sum(1))

    for step in range(6):
        x = torch.randn(16, 4)
        if step == 3:
            x[5] = 0.0
        BACKWARD
"""

SHAPES = {
    "several losses": """
        per_row = lengths(x)
        optimizer.zero_grad()
        torch.autograd.backward([per_row.mean(), 0.1 * per_row.pow(2).mean()])
        optimizer.step()""",
    "a gradient for a vector": """
        per_row = lengths(x)
        optimizer.zero_grad()
        per_row.backward(torch.full_like(per_row, 1 / 16))
        optimizer.step()""",
    "gradients taken and set": """
        params = list(model.parameters())
        grads = torch.autograd.grad(lengths(x).mean(), params)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()""",
    "gradients taken by keyword and copied": """
        params = list(model.parameters())
        grads = torch.autograd.grad(outputs=lengths(x).mean(), inputs=params)
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)
        optimizer.step()""",
    "a closure after a forward of its own": """
        shown = lengths(x).mean()        # a metric, with autograd on, never differentiated

        def closure():
            optimizer.zero_grad()
            loss = lengths(x).mean()
            loss.backward()
            return loss
        optimizer.step(closure)""",
}


def _script(tmp_path: Path, shape: str) -> Path:
    body = textwrap.indent(textwrap.dedent(SHAPES[shape]).strip(), " " * 4)
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(LOOP).replace("    BACKWARD", body))
    return path


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_way_of_differentiating_is_replayed_in_process(tmp_path, shape):
    path = _script(tmp_path, shape)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        3, "backward", "aten.div.Tensor", "sqrt-domain", [5])
    assert f.source.line == next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                                 if "torch.sqrt" in line)
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert report.run.rerun is None


def test_the_rerun_arms_at_the_closures_call_not_the_forward_before_it(tmp_path):
    path = _script(tmp_path, "a closure after a forward of its own")
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions(force_rerun=True))
    f = report.finding
    assert (f.step, f.op, f.cause, f.samples, f.localized_by) == (
        3, "aten.div.Tensor", "sqrt-domain", [5], "re-run")


# The functorch ensembling recipe: the members' weights stacked (`stack_module_state`) and one
# template module on the meta device called under `torch.vmap(functional_call)`. The module
# calls inside vmap see the transform's batched tensors, which mean nothing outside it.
ENSEMBLE = """
    import copy
    import torch
    from torch import nn
    from torch.func import functional_call, stack_module_state

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)) for _ in range(4)]
    params, buffers = stack_module_state(members)
    template = copy.deepcopy(members[0]).to("meta")

    def one(p, b, x):
        return functional_call(template, (p, b), (x,))

    optimizer = torch.optim.Adam(list(params.values()), lr=1e-2)
    for step in range(6):
        x = torch.randn(4, 32, 4)
        if step == 3:
            x[2, 7] = 0.0
        out = torch.vmap(one)(params, buffers, x) * (x.abs().sum(-1, keepdim=True) > 0)
        loss = torch.sqrt((out * out).sum(-1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_a_torch_func_ensemble_under_vmap_is_named_by_the_rerun_not_a_crash(tmp_path):
    # Before: functorch's internal assert from nanaudit's own step check (exit 4, as if the
    # script had raised); the re-run's tracer then read a value of the meta template.
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(ENSEMBLE))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert report.error is None
    assert (f.step, f.where, f.op, f.cause) == (3, "backward", "aten.div.Tensor", "sqrt-domain")
    assert "first at index [2, 7]" in f.explanation      # member 2, row 7
    assert f.localized_by == "re-run" and report.run.rerun.status == "reproduced"
    assert "torch.func transform (vmap)" in report.run.replay.note
