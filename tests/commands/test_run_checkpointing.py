"""Activation checkpointing under `nanaudit run`: a backward value made in a checkpointed block
is named at the block's own forward op and line, in-process, for both of torch's checkpoints.

The reentrant one (`use_reentrant=True`, transformers 4's `gradient_checkpointing_enable()` default)
runs the block's first forward without autograd and its forward again inside its
backward: that recomputed forward is what the backward's nodes were made by."""

from __future__ import annotations

import textwrap

import pytest
from helpers import line_of

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

SCRIPT = """
    import sys
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    reentrant = sys.argv[1] == "reentrant"


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.register_buffer("gate", torch.ones(16))

        def forward(self, x):
            h = self.fc(x)
            return torch.sqrt(h * h * self.gate)      # the derivative of sqrt at 0 is inf


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            return self.head(x)


    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for step in range(8):
        x = torch.randn(32, 16, requires_grad=reentrant)
        if step == 5:
            net.blocks[1].gate[4] = 0.0          # a feature switched off: sqrt(0)
        loss = net(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_a_checkpointed_blocks_backward_value_is_named_at_its_forward_line(tmp_path, mode):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    report = run_script(ScriptTarget(path=str(path), args=(mode,)), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.module, f.cause) == (5, "backward", "blocks.1", "sqrt-domain")
    assert f.source.line == line_of(path, "return torch.sqrt(h * h * self.gate)")
    assert f.forward_op == "aten.sqrt.default"
    assert f.localized_by == "in-process" and report.run.rerun is None
