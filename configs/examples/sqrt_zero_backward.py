"""Seed 004: sqrt at 0 is finite forward, but its derivative is infinite: mse_loss(x, sqrt(x))."""
import torch
from torch import nn


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.tensor([1.0, 2.0, 0.0]))

    def forward(self):
        return torch.sqrt(self.x)


def build_model():
    return Root()


def batches():
    for _ in range(3):
        yield torch.zeros(4, 1)   # the data does not matter here


def loss(model, batch):
    y = model()
    return nn.functional.mse_loss(model.x, y) + 0 * batch.sum()
