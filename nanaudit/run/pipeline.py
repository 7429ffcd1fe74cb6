"""Pipeline parallelism (`torch.distributed.pipelining`) is refused, by name: each rank holds a
different stage of the model, only the last computes the loss, and the stages trade
activations and gradients point to point, so no rank's step shows the values of another's and
one exchange of flags per step cannot name where a value was made. A clean report there would
be a false one, so the run stops with a usage error (exit 2) naming the stage.

The stage is seen where its module is first called: a frame of `torch.distributed.pipelining`
(a PipelineStage's forward, run by its schedule) on the stack of the step's outermost call.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

from nanaudit.errors import UsageError

_PIPELINING = os.sep + os.path.join("torch", "distributed", "pipelining") + os.sep


def refuse_pipeline_stage(module: torch.nn.Module) -> None:
    """Raise a UsageError when `module` is called by a pipeline stage's schedule."""
    if "torch.distributed.pipelining" not in sys.modules:
        return                      # cheap: no script that never imported it pays a walk
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if _PIPELINING in frame.f_code.co_filename:
            owner = frame.f_locals.get("self")
            what = type(owner).__name__ if owner is not None else "a pipeline schedule"
            raise UsageError(
                f"`{type(module).__name__}` runs as a stage of a pipeline (`{what}` from "
                f"torch.distributed.pipelining): nanaudit does not audit pipeline parallelism "
                f"(each rank holds another stage, and only the last computes the loss): audit "
                f"the model without pipelining, under DDP, FSDP2, HSDP or tensor parallel")
        frame = frame.f_back
