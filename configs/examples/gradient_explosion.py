"""Seeds 000 / 003: gradient explosion. Unscaled inputs and a learning rate too high make
linear regression diverge geometrically until the squared error overflows float32."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def batches():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for _ in range(200):
        x = torch.randn(16, 4, generator=g) * 10     # unscaled features
        yield x, x @ w


def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
