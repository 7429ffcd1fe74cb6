"""Seed 002: a hand-written softmax exp(z) / exp(z).sum() overflows once a logit passes ~88.7
(the seed saw it at z = 92): inf / inf = NaN."""
import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        z = self.fc(x)
        e = torch.exp(z)
        return e / e.sum(dim=1, keepdim=True)


def build_model():
    torch.manual_seed(0)
    return Classifier()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(8, 4, generator=g)
        if step == 3:
            x[6] = 400.0          # an unnormalised outlier drives one logit past 88.7
        yield x, torch.randint(0, 3, (8,), generator=g)


def loss(model, batch):
    x, y = batch
    p = model(x)
    target = nn.functional.one_hot(y, 3).float()
    return -(target * torch.log(p + 1e-9)).sum(dim=1).mean()
