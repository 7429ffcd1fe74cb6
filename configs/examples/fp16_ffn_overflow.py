"""Real-world 18 (T5 / BERT fine-tuning in float16, transformers issues 10956 and 14189): a
post-norm encoder block under float16 autocast. One unnormalised sensor reading drives the
feed-forward block's output projection past 65504 (float16's largest value); the RMSNorm after
the residual computes x * rsqrt(mean(x^2)) = inf * 0 = NaN. The NaN is made in the norm, the
infinity in the output projection."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """T5LayerNorm: the variance in float32, no mean subtraction."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.wi = nn.Linear(width, hidden)
        self.wo = nn.Linear(hidden, width)
        for layer in (self.wi, self.wo):       # the scale of a checkpoint trained in bfloat16
            nn.init.normal_(layer.weight, std=1.0)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class Block(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 64):
        super().__init__()
        self.ffn = FeedForward(width, hidden)
        self.norm = RMSNorm(width)

    def forward(self, x):
        return self.norm(x + self.ffn(x))


class SensorEncoder(nn.Module):
    def __init__(self, channels: int = 4, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(channels, width)
        self.block = Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.block(self.embed(x))).mean(dim=1).squeeze(-1)


def build_model():
    torch.manual_seed(0)
    return SensorEncoder()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(8, 6, 4, generator=g)           # (batch, time, channels), standardised
        if step == 2:
            x[3, 2] = 1.0e4                               # one raw, unscaled reading
        yield x, torch.randn(8, generator=g)


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)
