"""An Accelerate training loop: a model that feeds the length of its hidden vector as an extra
feature.

Planted bug: one sample (--poison-sample) is all zeros; with a bias-free projection its hidden
vector is zero, sqrt(0) = 0 is fine in forward but the derivative 1/(2*sqrt(0)) is infinite, and
the gradients go NaN in backward while the loss stays finite. (The fix: sqrt(x + eps).)
--poison-sample -1 is the clean run.
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LengthFeature(nn.Module):
    def forward(self, h):
        return torch.sqrt((h * h).sum(dim=-1, keepdim=True))


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.length = LengthFeature()
        self.head = nn.Linear(17, 1)

    def forward(self, x):
        h = self.proj(x)
        return self.head(torch.cat([torch.tanh(h), self.length(h)], dim=-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--poison-sample", type=int, default=45)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    if args.poison_sample >= 0:
        x[args.poison_sample] = 0.0
    accelerator = Accelerator(cpu=True)
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(args.epochs):
        for inputs, targets in loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
