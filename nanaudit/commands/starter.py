"""`nanaudit init`: the commented starter config and the entrypoint module it names.

Both files run as written (a small MLP on random data scans clean), so a new user's first
`nanaudit scan` works before they edit anything; the comments say what to replace.
"""

from __future__ import annotations

from nanaudit.exitcodes import ExitCode

CONFIG = """\
# nanaudit starter config: `nanaudit scan {config}` runs the steps below under cheap
# sentinels and, on the first NaN/Inf, names the batch, sample, module, op, line and cause.
# Replace the three entrypoints with your own (module:function or file.py:function, resolved
# from this file's folder). Check the file without running anything: `nanaudit validate`.
schema_version: 1

model: {module}:build_model        # () -> torch.nn.Module
data: {module}:batches             # () -> iterable of batches (list, generator, DataLoader)
loss: {module}:loss                # (model, batch) -> scalar tensor (or {{"loss": tensor}})

optimizer:                         # or `optimizer: {module}:make_optimizer` (model -> optim)
  class: torch.optim.AdamW
  lr: 1.0e-3

steps: 50                          # audit this many steps (omit: the whole data)
seed: 0                            # seeds python, torch and numpy before building the model
device: auto                       # auto | cpu | cuda | cuda:N
# precision: fp16                  # fp32 | fp16 | bf16 (autocast; fp16 adds a GradScaler)
# grad_clip: 1.0                   # clip the gradient norm as your training does
# checkpoint: runs/last.pt         # start from these weights (loaded with weights_only=True)
# watch:                           # early warnings (see the README)
#   loss_spike: 2.0
#   update_ratio: 0.1
# fail_on: warning                 # CI: also fail (exit {warning_exit}) on an early warning
"""

MODULE = '''\
"""Entrypoints for nanaudit ({config}). Replace the bodies with calls into your project:
import your model class, your dataset or DataLoader, and your loss."""
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))


def batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(32, 16, generator=g)
        yield x, x.sum(dim=1, keepdim=True)


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
'''


def render(config_name: str, module_name: str) -> tuple[str, str]:
    """The config text and the module text, naming each other."""
    return (CONFIG.format(config=config_name, module=module_name,
                          warning_exit=int(ExitCode.WARNING)),
            MODULE.format(config=config_name))
