"""A clean run of the user's own step with the usual extras: gradient clipping in the step, an
EMA copy of the weights updated after each optimizer step (no gradients, never optimized) and
a cosine schedule from the config. nanaudit checks each optimizer step the function makes and
must stay silent."""
import copy

import torch
from torch import nn


class WithEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 1))
        self.ema = copy.deepcopy(self.net).requires_grad_(False)


def build_model():
    torch.manual_seed(0)
    return WithEMA()


def make_optimizer(model):
    return torch.optim.AdamW(model.net.parameters(), lr=3e-3, weight_decay=0.01)


def batches():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 1, generator=g)
    for _ in range(24):
        x = torch.randn(16, 6, generator=g)
        yield x, x @ w + 0.1 * torch.randn(16, 1, generator=g)


def train_step(model, batch, optimizer, ema_decay=0.99):
    x, y = batch
    loss = nn.functional.mse_loss(model.net(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.net.parameters(), 1.0)
    optimizer.step()
    with torch.no_grad():
        for e, p in zip(model.ema.parameters(), model.net.parameters()):
            e.lerp_(p, 1 - ema_decay)
    return loss
