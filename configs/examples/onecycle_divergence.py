"""OneCycleLR with a max_lr far past what the problem takes: plain SGD on a regression is
stable while the schedule warms up, then the loss grows step after step as the lr rises and
overflows. The finding is divergence (the weights, not a row), with the scheduler's lr in the
timeline."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 1))


def batches():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 1, generator=g)
    for _ in range(60):
        x = torch.randn(32, 8, generator=g) * 3
        yield x, x @ w


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
