"""A plain PyTorch training loop with argparse: predicts a rate from log-count features.

Planted bug: the encoder takes log() of raw counts; one row of the batch at --poison-step has a
zero count, log(0) = -inf, and the loss goes non-finite. (The fix: log1p.) --poison-step -1 is
the clean run; --accumulate N steps the optimizer every N batches (gradient accumulation).
"""

import argparse

import torch
from torch import nn


class CountEncoder(nn.Module):
    def __init__(self, features: int, width: int):
        super().__init__()
        self.proj = nn.Linear(features, width)

    def forward(self, counts):
        return torch.relu(self.proj(torch.log(counts)))


class RateModel(nn.Module):
    def __init__(self, features: int = 6, width: int = 32):
        super().__init__()
        self.encoder = CountEncoder(features, width)
        self.head = nn.Linear(width, 1)

    def forward(self, counts):
        return self.head(self.encoder(counts))


def batches(steps: int, batch_size: int, poison_step: int, generator: torch.Generator):
    for step in range(steps):
        counts = torch.randint(1, 50, (batch_size, 6), generator=generator).float()
        if step == poison_step:
            counts[3, 2] = 0.0
        target = counts.sum(dim=1, keepdim=True).log()
        yield counts, target


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--poison-step", type=int, default=5, help="the batch with a zero count")
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = RateModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1)
    for epoch in range(args.epochs):
        data = batches(args.steps, args.batch_size, args.poison_step, generator)
        for index, (counts, target) in enumerate(data):
            loss = nn.functional.mse_loss(model(counts), target)
            (loss / args.accumulate).backward()
            if (index + 1) % args.accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
