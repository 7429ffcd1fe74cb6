"""A Poisson regression over event counts with a hand-written "safe log" as a custom
`torch.autograd.Function`: its forward clamps the rate away from 0, but its backward divides the
incoming gradient by the raw rate. A sample with zero exposure time (a sensor that was off for
the whole window) has rate exactly 0: the forward stays finite, the backward makes inf. Nothing in
the forward is wrong; the bad value is made by the user's own `backward`, and the report must
point there, not at the forward line."""
import torch
from torch import nn


class SafeLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rate):
        ctx.save_for_backward(rate)
        return torch.log(rate.clamp(min=1e-8))

    @staticmethod
    def backward(ctx, grad):
        (rate,) = ctx.saved_tensors
        return grad / rate


class PoissonRate(nn.Module):
    def __init__(self, features: int = 5):
        super().__init__()
        self.linear = nn.Linear(features, 1)

    def forward(self, x, exposure):
        return exposure * torch.exp(self.linear(x).squeeze(-1))


def build_model():
    torch.manual_seed(0)
    return PoissonRate()


def batches(poison_step: int = 2):
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(8, 5, generator=g)
        exposure = torch.rand(8, generator=g) + 0.5
        counts = torch.poisson(exposure * 2.0, generator=g) + 1.0
        if step == poison_step:
            exposure[3] = 0.0
        yield {"x": x, "exposure": exposure, "counts": counts}


def loss(model, batch):
    rate = model(batch["x"], batch["exposure"])
    return (rate - batch["counts"] * SafeLog.apply(rate)).mean()
