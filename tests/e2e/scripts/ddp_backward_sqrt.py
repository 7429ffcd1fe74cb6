"""Two DDP ranks (gloo): at step 3 rank 1's shard of the batch has an all-zero row, whose
`sqrt` is finite in forward and NaN in backward (d sqrt(x)/dx at 0 is inf, times 0 is NaN):
a gradient trip only rank 1's own step made, which DDP's all-reduce spreads to every rank.
Each rank appends a line per step to LOG.rank<r> (what a re-run would write twice); with
`--keep-going` the run goes on to its end and each rank writes its weights to LOG.rank<r>.pt."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Root(nn.Module):
    """sqrt(x * weight): at an all-zero row of x, finite forward, NaN weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * self.weight)


log = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(Root(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(6):
    gen = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.rand(8, 4, generator=gen) + 0.5, torch.randn(8, 1, generator=gen)
    if rank == 1 and step == 3:
        x[5] = 0.0
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    with open(f"{log}.rank{rank}", "a") as f:
        f.write(f"{step} {loss.item():.6f}\n")
torch.save(model.module.state_dict(), f"{log}.rank{rank}.pt")
dist.destroy_process_group()
