"""Seed 004: acos of 2. An upstream step computed a cosine feature that is 2 for one row."""
import torch
from torch import nn


class AngleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 1)

    def forward(self, cos):
        angle = torch.acos(cos).unsqueeze(1)
        return self.head(angle).squeeze(1)


def build_model():
    return AngleModel()


def batches():
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        cos = torch.rand(6, generator=g) * 2 - 1
        if step == 1:
            cos[4] = 2.0
        yield {"cos": cos, "target": torch.zeros(6)}


def loss(model, batch):
    return ((model(batch["cos"]) - batch["target"]) ** 2).mean()
