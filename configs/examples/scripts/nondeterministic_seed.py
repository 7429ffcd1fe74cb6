"""A training loop that seeds itself from the operating system's entropy (a common way to get
"a different run each time"), with the same planted log(0) as plain_log_counts.py.

The first run trips, but a re-run from the start cannot follow it: its initial weights differ,
so its losses differ from the first step. nanaudit must say the script is not deterministic and
report what the first run saw, not a guess.
"""

import os

import torch
from torch import nn


class LogFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, counts):
        return self.body(torch.log(counts))


def main():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = LogFeatures()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        x = torch.rand(8, 4) + 0.5
        if step == 3:
            x[6, 1] = 0.0                      # a zero count: log(0) = -inf
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
