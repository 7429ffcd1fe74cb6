"""Seed 003: log(0) = -inf. A hand-written binary cross-entropy takes log(1 - sigmoid(z)); once
a logit saturates, sigmoid(z) rounds to exactly 1, the log is -inf, and 0 * -inf = NaN."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(2, 1)


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(6, 2, generator=g)
        y = (x[:, 0] > 0).float()
        if step == 2:
            x[3] = torch.tensor([300.0, 300.0])
            y[3] = 1.0
        yield x, y


def loss(model, batch):
    x, y = batch
    p = torch.sigmoid(model(x).squeeze(1))
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
