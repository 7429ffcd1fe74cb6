"""A tabular regressor (BatchNorm, Dropout) whose data holds three bad batches of different
kinds, for `nanaudit scan --keep-going`: a corrupt record (a NaN feature, step 3), a dead
sensor (an all-zero row, whose length has an infinite gradient, step 5) and a non-positive
target (the loss takes its log, step 8). Each is skipped and reported; the run goes on."""
import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(6))
        self.body = nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.Dropout(0.2),
                                  nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        z = x * self.gain
        length = torch.sqrt((z * z).sum(1, keepdim=True))   # sqrt(0): infinite gradient
        return self.head(self.body(torch.cat([z, length], dim=1)))


def build_model():
    torch.manual_seed(0)
    return Regressor()


def batches(steps: int = 12, rows: int = 8):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(rows, 6, generator=g)
        y = torch.rand(rows, 1, generator=g) + 0.5
        if step == 3:
            x[2, 4] = float("nan")       # a corrupt record
        elif step == 5:
            x[6] = 0.0                   # a dead sensor
        elif step == 8:
            y[1] = 0.0                   # a target of 0 on a log scale
        yield {"x": x, "y": y}


def log_mse(model, batch):
    return ((model(batch["x"]) - torch.log(batch["y"])) ** 2).mean()
