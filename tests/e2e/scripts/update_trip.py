"""Updates that make finite weights non-finite from finite gradients, the shapes of public
reports: Adam with eps=0 over embedding rows no batch has reached (their second moment is 0:
0/0), a learning rate a scheduler or a flag made inf, SGD whose momentum step overflows
float32, eps=0 in the other adaptive optimizers of torch.optim (an OPTIMIZER-eps case), and SGD
without momentum whose step overflows (its update, the gradient, is not kept: not evaluated
in-process); Adam's eps=0 and SGD's overflow again under the foreach and fused implementations.
A model in float16 with Adam's default eps=1e-8, which is 0 in float16, is the first case again.
Usage: update_trip.py adam-eps|adam-inf-lr|sgd-overflow|sgd-plain|adam-foreach|adam-fused|
sgd-foreach|adam-half|NAME-eps [LOG_PATH], NAME one of torch.optim's classes taking eps."""

import sys

import torch
from torch import nn

case = sys.argv[1]
log = open(sys.argv[2], "a") if len(sys.argv) > 2 else None
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
params = model.parameters()
if case == "adam-eps":
    optimizer = torch.optim.Adam(params, lr=1e-2, eps=0.0)
elif case == "adam-inf-lr":
    optimizer = torch.optim.Adam(params, lr=float("inf"))
elif case == "sgd-overflow":
    optimizer = torch.optim.SGD(params, lr=1e38, momentum=0.9)
elif case == "sgd-plain":
    optimizer = torch.optim.SGD(params, lr=1e38)
elif case in ("adam-foreach", "adam-fused"):   # the implementations a flag chooses on CPU
    optimizer = torch.optim.Adam(params, lr=1e-2, eps=0.0, **{case[5:]: True})
elif case == "adam-half":                      # the model in float16, Adam's default eps
    optimizer = torch.optim.Adam(model.half().parameters(), lr=1e-2)
elif case == "sgd-foreach":
    optimizer = torch.optim.SGD(params, lr=1e38, momentum=0.9, foreach=True)
else:
    optimizer = getattr(torch.optim, case.removesuffix("-eps"))(params, eps=0.0)
for step in range(8):
    tokens = torch.tensor([0, 2, 3, 2, 0, 3])          # rows 1 and 4..9 are never looked up
    loss = model(tokens).pow(2).mean() * (1e3 if case.startswith("sgd") else 1.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if log is not None:
        log.write(f"step {step}\n")
        log.flush()
