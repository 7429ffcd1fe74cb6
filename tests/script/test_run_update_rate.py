"""An update trip of `nanaudit run` names the learning rate the update ran with, not the one a
scheduler set for the next step before the trip was read (the Trainer steps its scheduler right
after `optimizer.step()`; nanoGPT sets the next step's rate by hand at the top of its loop).
Seen on a Trainer script with `--adam_epsilon 0` under a linear decay: the finding said
`AdamW(lr=4.167e-05, ...)` for an update that ran at 5e-05."""

from __future__ import annotations

import textwrap

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptTarget

WARMED_UP = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
    for step in range(4):
        tokens = torch.randint(0, 8, (4,))           # rows 8..15 never get a gradient
        loss = model(tokens).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        warmup.step()
"""


def test_an_update_trip_names_the_rate_its_update_ran_with(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(WARMED_UP))
    f = run_script(ScriptTarget(path=str(path))).finding
    # eps 0 over the zero second moment of the rows no token reached: 0/0 at step 0's update,
    # which ran at lr 1e-3 * 1/4; the scheduler had set 1e-3 * 2/4 for step 1 by the check.
    assert (f.step, f.where, f.cause) == (0, "optimizer", "optimizer-update")
    assert f.tensors == ["0.weight"]
    assert "AdamW(lr=0.00025, eps=0" in f.explanation
    assert "lr=0.0005" not in f.explanation + f.fix
