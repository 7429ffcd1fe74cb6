"""The one host read of a `nanaudit run` step (script/readout.py): its fast paths give the values
the plain computation gives, and its fallbacks (float64, several inputs, a loss of shape (1,),
no gradients) keep every check."""

from __future__ import annotations

import math
import textwrap

import torch

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.readout import (
    StepInbox,
    WeightsScope,
    input_extremes,
    input_peaks,
    read_step,
)
from nanaudit.script.target import ScriptOptions, ScriptTarget


def model_with_grads(dtype=torch.float32, width=8) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1)).to(dtype)
    loss = model(torch.randn(5, 4, dtype=dtype)).pow(2).mean()
    loss.backward()
    return model, loss


def expected_norms(model) -> tuple[float, float]:
    params = list(model.parameters())
    return (float(torch.cat([p.detach().double().flatten() for p in params]).norm()),
            float(torch.cat([p.grad.double().flatten() for p in params]).norm()))


def test_the_read_gives_the_loss_and_the_norms_packed_or_not():
    # float64: the per-group fallback; width 2048: a weight too large to pack beside small ones
    for dtype, width in ((torch.float32, 8), (torch.float32, 2048), (torch.float64, 8)):
        model, loss = model_with_grads(dtype, width)
        scope = WeightsScope(list(model.parameters()))
        assert scope.fused == (dtype == torch.float32)
        inbox = StepInbox()
        inbox.add_loss(loss)
        inbox.add_inputs([("input[0]", torch.ones(3, dtype=dtype))])
        read = read_step(inbox, scope, scope.grads())
        norm, grad_norm = expected_norms(model)
        assert read.inputs_ok and read.loss == float(loss.detach())
        assert math.isclose(read.norm, norm, rel_tol=1e-6)
        assert math.isclose(read.grad_norm, grad_norm, rel_tol=1e-6)


def test_input_peaks_are_finite_exactly_when_the_inputs_are():
    nan64 = torch.tensor([1.0, math.nan], dtype=torch.float64)
    big = torch.full((4,), 3e38)                  # its sum of squares overflows; its max does not
    peaks = input_peaks([big, torch.zeros(0), torch.ones(2, requires_grad=True), nan64,
                         torch.tensor([-math.inf], dtype=torch.bfloat16)])
    assert len(peaks) == 4                        # the empty input has nothing to check
    values = torch.stack(peaks).tolist()
    assert [math.isfinite(v) for v in values] == [True, True, False, False]
    assert all(not p.requires_grad for p in peaks)


def test_input_extremes_are_finite_exactly_when_the_inputs_are():
    # What the step's read takes of each input: its min and max from one kernel, read as they
    # are (no |value| folded on the device); a sum of squares would overflow on `big`.
    nan64 = torch.tensor([1.0, math.nan], dtype=torch.float64)
    big = torch.full((4,), 3e38)
    inputs = [big, torch.zeros(0), torch.ones(2, requires_grad=True), nan64,
              torch.tensor([-math.inf], dtype=torch.bfloat16),
              torch.tensor([0.0, math.inf], dtype=torch.float16)]
    extremes = input_extremes(inputs)
    assert len(extremes) == 10                    # two a non-empty input
    assert all(e.dim() == 0 and not e.requires_grad for e in extremes)
    assert [e.dtype for e in extremes[4:6]] == [torch.float64, torch.float64]
    assert all(e.dtype == torch.float32 for e in extremes[:4] + extremes[6:])
    values = torch.stack([e.double() for e in extremes]).tolist()
    assert [math.isfinite(v) for v in values] == [True] * 4 + [False] * 4 + [True, False]
    assert values[:4] == [float(big[0])] * 2 + [1.0, 1.0]
    for bad in (nan64, torch.tensor([-math.inf]), torch.tensor([2.0, math.inf])):
        inbox = StepInbox()
        inbox.add_inputs([("x", torch.ones(3)), ("y", bad)])
        assert not read_step(inbox).inputs_ok
    inbox = StepInbox()
    inbox.add_inputs([("x", big), ("y", torch.zeros(0))])
    assert read_step(inbox).inputs_ok


def test_the_losses_of_a_window_and_odd_shapes_and_dtypes():
    inbox = StepInbox()
    inbox.add_loss(torch.tensor([2.0]))                             # shape (1,)
    inbox.add_loss(torch.tensor(4.0, dtype=torch.float16))
    read = read_step(inbox)                   # no weights read (a step the GradScaler skipped)
    assert (read.loss, read.inputs_ok, read.norm) == (3.0, True, None)
    inbox.add_inputs([("x", torch.tensor([math.nan]))])
    assert not read_step(inbox).inputs_ok


def test_a_script_with_a_parameter_that_gets_no_gradient(tmp_path):
    # The weights are packed, the gradients then are not (their places do not line up).
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)
            def forward(self, x):
                return self.used(x)

        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    assert exit_code(report) == 0 and report.steps_run == 3
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 1), "unused": torch.nn.Linear(4, 1)})
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).norm()
    assert math.isclose(report.timeline[0].param_norm, float(weights), rel_tol=1e-6)
    assert all(math.isfinite(e.grad_norm) and e.grad_norm > 0 for e in report.timeline)


def test_a_parameter_given_new_storage_is_read_live():
    # `p.data = p.data * mask` (pruning) gives the parameter a new storage: the read follows.
    model, _ = model_with_grads()
    scope = WeightsScope(list(model.parameters()))
    read_step(StepInbox(), scope, scope.grads())
    for p in model.parameters():
        p.data = torch.full_like(p.data, 2.0)
    read = read_step(StepInbox(), scope, scope.grads())
    count = sum(p.numel() for p in model.parameters())
    assert math.isclose(read.norm, 2.0 * math.sqrt(count), rel_tol=1e-6)
    assert torch.is_grad_enabled()            # the read put grad mode back
