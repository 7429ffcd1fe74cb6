"""Two DDP ranks (gloo) whose rank 1 raises on a non-finite value at step 2, the shapes of
public reports: `sample`: a policy samples its action with `torch.multinomial` inside its
forward, and rank 1's batch carries a row whose temperature is 0 (the logits divided by it are
+-inf, their softmax NaN: "probability tensor contains either `inf`, `nan` or element < 0");
`assert`: the loss code weights each row's log-probability, rank 1's row 2 weighs 0, and the
script's own `assert torch.isfinite(loss)` stops it. Rank 0 meanwhile waits in DDP's gradient
all-reduce. Each rank appends a line per step to LOG.rank<r>.
Usage: ddp_raising.py sample|assert LOG"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BAD = 2


class Policy(nn.Module):
    """Action probabilities over 3 actions at per-row temperatures; `sample`: with an action
    drawn from them."""

    def __init__(self, sample: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        self.sample = sample

    def forward(self, obs: torch.Tensor, temperature: torch.Tensor):
        probs = torch.softmax(self.net(obs) / temperature[:, None], dim=-1)
        if self.sample:
            return probs, torch.multinomial(probs, 1)
        return probs


mode, log = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(Policy(sample=mode == "sample"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    gen = torch.Generator().manual_seed(100 * rank + step)
    obs, temperature, weight = torch.randn(8, 4, generator=gen), torch.ones(8), torch.ones(8)
    if rank == 1 and step == BAD:
        (temperature if mode == "sample" else weight)[3 if mode == "sample" else 2] = 0.0
    if mode == "sample":
        probs, action = model(obs, temperature)
        loss = -torch.log(probs.gather(1, action)).mean()
    else:
        probs = model(obs, temperature)
        loss = -(torch.log(probs[:, 0] * weight)).mean()
        assert torch.isfinite(loss), "loss diverged"
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with open(f"{log}.rank{rank}", "a") as f:
        f.write(f"{step} {loss.item():.6f}\n")
dist.destroy_process_group()
