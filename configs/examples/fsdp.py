"""A small model for `torchrun --nproc-per-node 2 -m nanaudit scan fsdp_backward_nan.yaml`:
`distributed.fsdp` shards each block of its ModuleList, then the root, with FSDP2. Its length
feature is sqrt of a sum of squares: finite at an all-zero row, infinite in its gradient."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Blocks(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width + 1, 1)

    def forward(self, x):
        z = x * self.gain
        length = torch.sqrt((z * z).sum(1, keepdim=True))
        for block in self.blocks:
            z = block(z)
        return self.head(torch.cat([z, length], dim=1))


def build_model():
    torch.manual_seed(0)
    return Blocks()
