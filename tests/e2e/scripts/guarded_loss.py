"""The commonest hand-written guard: `if not torch.isfinite(loss): continue`. Step BAD's loss is
-inf (a row's probability zeroed before the log), and the script leaves that step out itself.
Usage: guarded_loss.py [STATE_PATH] (its final weights saved there when given)."""

import sys

import torch
from torch import nn

BAD = 3

torch.manual_seed(0)
model = nn.Linear(4, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    probs = model(x).softmax(-1)
    if step == BAD:
        probs = probs * (torch.arange(8) != 5).float()[:, None]
    loss = -torch.log(probs.gather(1, y[:, None])).mean()
    if not torch.isfinite(loss):
        continue
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if len(sys.argv) > 1:
    torch.save(model.state_dict(), sys.argv[1])
