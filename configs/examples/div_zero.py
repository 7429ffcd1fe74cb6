"""Seed 000: c / 0. A per-sample loss is averaged over each sample's token count, and one
sample has no tokens."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.rand(5, 3, generator=g) + 0.5
        count = torch.randint(1, 5, (5,), generator=g).float()
        if step == 1:
            count[0] = 0.0
        yield {"x": x, "count": count}


def loss(model, batch):
    total = model(batch["x"]).squeeze(1).abs() + 1.0
    return (total / batch["count"]).mean()
