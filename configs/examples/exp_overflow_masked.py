"""Seed 004: c / exp(a) with a = 1000: exp overflows to inf, c / inf = 0 keeps the loss finite,
and backward multiplies 0 * inf = NaN."""
import torch
from torch import nn


class Decay(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.rand(100, generator=g) + 1000)

    def forward(self, c):
        return c / torch.exp(self.a)


def build_model():
    return Decay()


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        yield torch.rand(100, generator=g)


def loss(model, batch):
    return model(batch).sum()
