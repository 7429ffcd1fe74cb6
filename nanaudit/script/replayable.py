"""What rules out an in-process replay of a step: the options (`--no-rerun`, `--rerun`) and
what the step record of a call holds (no output heard, code too long to record, code run inside
a `torch.func` transform). NotReplayable says why;
the re-run is used instead."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.run.step_record import ModelCall
from nanaudit.script.target import ScriptOptions

_is_batched = torch._C._functorch.is_batchedtensor


class NotReplayable(Exception):
    """Why this window cannot be replayed in-process (the re-run is used instead)."""


def replay_allowed(options: ScriptOptions) -> None:
    """NotReplayable when the options rule the in-process replay out."""
    if not options.rerun:
        raise NotReplayable("--no-rerun: the step is not replayed")
    if options.force_rerun:
        raise NotReplayable("--rerun: localized by re-running the script from the start")


def replayable(call: ModelCall) -> None:
    """NotReplayable when the record of `call` cannot be run again."""
    if call.output is None and call.model_called:
        raise NotReplayable("the model's output was not heard")
    if call.code.overflowed:
        raise NotReplayable("the code between the model and backward is too long to record"
                            if call.model_called else
                            "the step's code (it calls no module) is too long to record")
    if any(_is_batched(t) for op in call.code.ops for t in tree_flatten(op.args)[0]
           if isinstance(t, torch.Tensor)):
        raise NotReplayable("the step's code runs inside a torch.func transform (vmap), whose "
                            "tensors do not exist outside it")
