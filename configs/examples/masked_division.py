"""Seed 001 (pytorch issue 4132): y = x / div; loss = y[mask]. The masked-out entry divides by
zero; the loss never sees it, yet its gradient is NaN."""
import torch
from torch import nn


class Ratio(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.ones(6))

    def forward(self, div):
        return self.x / div


def build_model():
    return Ratio()


def batches():
    for step in range(4):
        div = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        if step == 2:
            div[3] = 0.0
        yield {"div": div, "mask": div != 0}


def loss(model, batch):
    y = model(batch["div"])
    return y[batch["mask"]].sum()
