"""The shape of pytorch/examples time_sequence_prediction/train.py, in miniature: LBFGS, whose
`step(closure)` calls the closure (zero_grad, forward, loss, backward) up to `max_iter` times a
step, a `torch.no_grad()` prediction after each step, float64 data loaded from a file. The
model's last layer takes `log(margin - |prediction|)`: a margin the fit crosses makes log's
argument negative inside a later closure call. Run as `python lbfgs_fit.py DATA.pt [--steps N]
[--margin M]`; DATA.pt holds a (N, 2) float64 tensor of (x, y)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--margin", type=float, default=100.0)
args = parser.parse_args()
torch.manual_seed(0)


class Fit(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(1, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        y = self.out(torch.tanh(self.hidden(x)))
        return y + 0.01 * torch.log(args.margin - y.abs())


data = torch.load(args.data)
x, y = data[:, :1], data[:, 1:]
model = Fit().double()
optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=10)
for i in range(args.steps):
    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        print(f"loss: {loss.item():.8f}")
        loss.backward()
        return loss
    optimizer.step(closure)
    with torch.no_grad():
        print(f"step {i} fit: {nn.functional.mse_loss(model(x), y).item():.8f}")
