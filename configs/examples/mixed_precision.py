"""Mixed-precision cases (issue 8), small enough for the CPU: float16 autocast with a GradScaler,
float16 weights with Adam, and an activation that grows past float16's range."""
import torch
from torch import nn


def regressor(features: int = 16, outputs: int = 4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, outputs))


def regression_batches(steps: int = 30, rows: int = 16, features: int = 16, outputs: int = 4,
                       scale: float = 1.0, dtype: str = "float32"):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(features, outputs, generator=g)
    for _ in range(steps):
        x = torch.randn(rows, features, generator=g) * scale
        yield x.to(getattr(torch, dtype)), (x @ w / features ** 0.5).to(getattr(torch, dtype))


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y.float())


# --- unnormalized inputs: the fp16 backward overflows whatever the loss scale ---------------

def wide_linear():
    torch.manual_seed(0)
    layer = nn.Linear(16, 4)
    nn.init.constant_(layer.weight, 0.001)
    return layer


def raw_sensor_batches(steps: int = 40, rows: int = 256):
    for _ in range(steps):
        yield (torch.full((rows, 16), 1000.0),)     # raw counts, never normalized


def summed_output(model, batch):
    (x,) = batch
    return model(x).float().sum()


# --- float16 weights: Adam's eps=1e-8 is 0 in float16 ----------------------------------------

def half_regressor():
    torch.manual_seed(0)
    return nn.Linear(4, 1).half()


def half_batches(steps: int = 10):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        x[:, 0] = 0.0                                 # a feature that is always absent
        yield x.half(), (x @ torch.tensor([[0.0], [1.0], [-1.0], [0.5]])).half()


# --- an activation that grows every step until float16 overflows -----------------------------

class Amplifier(nn.Module):
    """One linear unit whose objective rewards a larger output: it grows ~1.4x per step."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 1, bias=False)
        nn.init.constant_(self.proj.weight, 6.0)

    def forward(self, x):
        return self.proj(x)


def amplifier():
    torch.manual_seed(0)
    return Amplifier()


def ones(steps: int = 60):
    for _ in range(steps):
        yield (torch.ones(8, 16),)


def reward_magnitude(model, batch):
    (x,) = batch
    return -model(x).float().pow(2).mean() * 1e-4
