"""Generalized-mean (GeM) pooling for image retrieval (Radenovic et al.; cnnimageretrieval and
Kaggle landmark solutions) with a learnable exponent p: mean(x ** p) ** (1 / p). The reference
clamps x to eps first; this copy pools a convolution with no ReLU after it, so the mean of x ** 3
is negative for some channels and its cube root, pow(negative, 1/3), is NaN. The fix is about the
negative base, not the sqrt-at-zero text."""
import torch
import torch.nn.functional as F
from torch import nn


class GeM(nn.Module):
    def __init__(self, p: float = 3.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x):
        return F.avg_pool2d(x.pow(self.p), x.shape[-2:]).pow(1.0 / self.p).flatten(1)


class Retrieval(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = GeM()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.pool(self.conv(x)))


def build_model():
    torch.manual_seed(0)
    return Retrieval()


def batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        yield torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
