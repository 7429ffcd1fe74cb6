"""Custom autograd.Functions: a value made in a hand-written backward is found at the user's
line in that backward, named by the Function's class; one made outside torch ops is said so."""

import pytest
from helpers import ROOT, scan

CASE = """
import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable


class NumpySlope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        slope = np.float32(1.0) / x.detach().numpy()
        return grad * torch.from_numpy(slope)


class RawWrite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        out = torch.empty_like(grad)
        np.divide(grad.detach().numpy(), x.detach().numpy(), out=out.numpy())
        return out


class Model(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.function = function

    def forward(self, x):
        h = self.lin(x).squeeze(-1) * x[:, 0]
        return self.function.apply(h)


def build_model(function="NumpySlope"):
    torch.manual_seed(0)
    return Model(globals()[function])


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(6, 3, generator=g)
        if step == 1:
            x[4, 0] = 0.0
        yield x


def loss(model, batch):
    return model(batch).square().mean()
"""


def _scan(case, tmp_path, function):
    config = case(CASE, model={"entrypoint": "case:build_model", "args": {"function": function}},
                  optimizer={"class": "torch.optim.SGD", "lr": 0.01})
    return scan(config, tmp_path=tmp_path)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_numpy_in_a_backward_is_created_outside_torch_at_the_backward_line(case, tmp_path):
    result = _scan(case, tmp_path, "NumpySlope")
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["cause"], f["samples"]) == (1, "backward", "unknown", [4])
    assert f["forward_op"] == "autograd.Function NumpySlope"
    assert f["source"]["function"] == "backward"
    assert "torch.from_numpy(slope)" in f["source"]["code"]
    assert "created outside torch ops" in f["explanation"]
    assert "backward of the autograd.Function NumpySlope" in f["explanation"]
    assert "overflow of" not in f["explanation"].replace("not an overflow of", "")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_memory_written_in_a_backward_names_the_function_that_made_the_tensor(case, tmp_path):
    result = _scan(case, tmp_path, "RawWrite")
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["cause"], f["samples"]) == (1, "backward", "unknown", [4])
    assert "created outside torch ops" in f["explanation"]
    assert "made in the backward of the autograd.Function RawWrite (case.py:" in f["explanation"]


def test_hand_written_backward_example_points_at_the_backward_line(tmp_path):
    result = scan(ROOT / "configs" / "examples" / "custom_backward.yaml", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["cause"], f["samples"]) == (
        2, "backward", "aten.div.Tensor", "div-by-zero", [3])
    assert f["forward_op"] == "autograd.Function SafeLog"
    assert f["source"]["function"] == "backward" and f["source"]["code"] == "return grad / rate"
    assert f["explanation"].startswith("in the hand-written backward of the autograd.Function "
                                       "SafeLog (custom_backward.py:")
    assert f["chain"][0]["op"] == "aten.div.Tensor"


def test_uninitialized_memory_is_never_the_op_that_made_a_value():
    """`torch.empty*` hands out whatever bits were in memory, NaN patterns included: the
    tracer must not name it as the creating op (what later writes the memory made the value)."""
    import torch

    from nanaudit.localize.tracer import OpTracer
    model = torch.nn.Linear(2, 2)
    for _ in range(500):
        garbage = torch.full((64,), float("nan"))
        del garbage                      # freed memory that the next allocation may reuse
        with OpTracer(model) as tracer:
            fresh = torch.empty(64)
        if bool(torch.isnan(fresh).any()):
            assert not [e for e in tracer.trace.events if "empty" in e.op]
            return
    pytest.skip("the allocator never handed back NaN garbage here")
