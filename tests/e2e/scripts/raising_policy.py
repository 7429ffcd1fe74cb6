"""Scripts that raise on a non-finite value instead of stepping on it, the shapes of public
reports: a policy sampled with `torch.multinomial` after a temperature annealed to 0 (it raises
"probability tensor contains either `inf`, `nan` or element < 0"); the script's own
`assert torch.isfinite(loss)` after a row's probability was zeroed before the log; a model
returning a `torch.distributions.Categorical`, whose argument check raises ValueError inside
the forward. Each goes bad at step BAD. Usage: raising_policy.py sample|assert|forward
[LOG_PATH] (a line appended per step when given)."""

import sys

import torch
from torch import nn

BAD = 3


class Policy(nn.Module):
    """Logits over 3 actions; `distribution`: return a Categorical over them (validated)."""

    def __init__(self, distribution: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.distribution = distribution
        self.temperature = 1.0

    def forward(self, obs: torch.Tensor):
        logits = self.net(obs) / self.temperature
        if self.distribution:
            return torch.distributions.Categorical(logits=logits, validate_args=True)
        return logits


mode = sys.argv[1]
log_path = sys.argv[2] if len(sys.argv) > 2 else None
torch.manual_seed(0)
policy = Policy(distribution=mode == "forward")
optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
for step in range(6):
    obs = torch.randn(8, 4)
    if mode == "forward":
        policy.temperature = max(0.0, 1.0 - step / BAD)
        dist = policy(obs)
        loss = -dist.log_prob(dist.sample()).mean()
    elif mode == "sample":
        temperature = max(0.0, 1.0 - step / BAD)        # annealed to 0 at step BAD
        probs = torch.softmax(policy(obs) / temperature, dim=-1)
        action = torch.multinomial(probs, 1)
        loss = -torch.log(probs.gather(1, action)).mean()
    else:
        probs = policy(obs).softmax(-1)
        if step == BAD:
            probs = probs * (torch.arange(8) != 2).float()[:, None]
        loss = -torch.log(probs[:, 0]).mean()
        assert torch.isfinite(loss), "loss diverged"
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if log_path is not None:        # opened a line at a time: the script raises mid-run
        with open(log_path, "a") as log:
            log.write(f"step {step} loss {loss.item():.4f}\n")
