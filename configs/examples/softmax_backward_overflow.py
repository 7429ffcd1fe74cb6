"""A hand-written softmax classifier whose loss reads only the target's probability (the
"cross-entropy from scratch" of many tutorials and forum threads): exp overflows past 88.7 for
one sample, exp(z) / exp(z).sum() is inf / inf = NaN at that entry, but the loss picks the
target's entry (finite / inf = 0, plus eps) and stays finite. The NaN first shows in backward,
in the gradient of the division; it was made by the exp in forward."""
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
    for step in range(4):
        x = torch.randn(8, 4, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        if step == 1:
            x[5] = torch.tensor([-300.0, 300.0, -300.0, 300.0])   # an unscaled feature row
            y[5] = 2
        yield x, y


def loss(model, batch):
    x, y = batch
    p = model(x)
    return -torch.log(p[torch.arange(len(y)), y] + 1e-9).mean()
