"""What the first run of a script saw at the step that tripped (`ScriptTrip`), and the
non-finite tensors in the frames of an exception the script raised."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

import torch

from nanaudit.report.sections import ShardElement
from nanaudit.report.vocabulary import Check, Where
from nanaudit.run.checks import value_kind


@dataclass
class ScriptTrip:
    """What the first run saw at the step that tripped (sync allowed: it happens once)."""

    step: int
    check: Check                        # a sentinel, or Check.ERROR: the script raised after it
    loss: float | None = None
    grad_norm: float | None = None
    value: str = "nan"
    tensors: list = field(default_factory=list)    # bad parameters, or the bad input names
    rows: list | None = None            # input trips: the rows holding the non-finite values
    input_shapes: list = field(default_factory=list)
    optimizer: str = ""                 # the optimizer's class and hyper-parameters
    rank: int | None = None
    skipped: bool = False               # the GradScaler skipped this step's update
    optimizers: int = 1                 # how many optimizers the script stepped so far
    manual: bool = False                # the script updates its weights itself (no optimizer)
    evaluation: int = 0                 # which call of the step's closure (LBFGS: several)
    error: str = ""                     # the script's exception after the value, first line
    where: Where | None = None          # error trips: raised in forward or in backward;
    #                                     a PARAMETER trip in forward: buffers it made bad
    collapsed: str = ""                 # the GradScaler's scale collapsed: why (scaler.py)
    scaler: str = "the GradScaler"      # whose loss scale (DeepSpeed's under fp16)
    skips: int = 0                      # collapse trips: the skipped tries of the step, in all
    state: list = field(default_factory=list)      # optimizer-state entries holding the value
    unreached: bool = False             # a loss the script computed and skipped before backward
    element: ShardElement | None = None  # a sharded tensor's first bad element (run/mesh.py)
    fingerprint: str | None = None      # input trips: the first bad input's bytes, hashed
    micro_batch: int | None = None      # input trips: the window's call whose batch was bad
    made_before: bool = False           # in-process: the value was made before the step's
    #                                     first model call (the re-run traces that code)

    @property
    def in_buffers(self) -> bool:
        """The step's forward made floating buffers of the model non-finite."""
        return self.check == Check.PARAMETER and self.where == Where.FORWARD

    @property
    def needs_rerun(self) -> bool:
        """A loss, gradient, buffer or error trip names no op until the step is re-run traced;
        an input trip, no op of the data code that made the batch."""
        return self.check in (Check.INPUT, Check.LOSS, Check.GRADIENT, Check.ERROR) \
            or self.in_buffers

    @property
    def phase(self) -> Where:
        """Where the value showed: the loss and buffers in forward, the gradients in
        backward."""
        return Where.FORWARD if self.check == Check.LOSS or self.in_buffers else Where.BACKWARD


def window_input_fields(calls: list[list]) -> dict:
    """input_fields of the window's first call whose floating inputs are non-finite (each
    call's [(name, tensor)], in order; one host read a call, at a trip only), with its place
    in the window (`micro_batch`) when the window had more than one call: under gradient
    accumulation the bad batch need not be the last micro-batch, nor the first."""
    index = next((i for i, inputs in enumerate(calls)
                  if not all(bool(torch.isfinite(t).all()) for _, t in inputs)), len(calls) - 1)
    fields = input_fields(calls[index] if calls else [])
    fields["micro_batch"] = index if len(calls) > 1 else None
    return fields


def input_fields(inputs: list) -> dict:
    """What an input trip records of the first call's floating inputs [(name, tensor)]: the
    kind of the first bad value, the bad inputs' names and shapes, their bad rows, and the
    first bad input's fingerprint (a re-run's batch is the first run's when it matches)."""
    from nanaudit.run.batch import nonfinite_rows
    bad = [(n, t) for n, t in inputs if not bool(torch.isfinite(t).all())]
    rows = sorted({r for _, t in bad for r in nonfinite_rows(t, 0 if t.dim() else None)})
    return {"value": value_kind(bad[0][1]) if bad else "nan", "tensors": [n for n, _ in bad],
            "rows": rows, "input_shapes": [list(t.shape) for _, t in bad],
            "fingerprint": fingerprint(bad[0][1]) if bad else None}


def fingerprint(tensor: torch.Tensor) -> str | None:
    """A hash of a tensor's dtype, shape and bytes (one read to the host, at a trip only);
    None for a tensor subclass (a DTensor's bytes are its shard's)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_meta:
        return None
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(data.tobytes())
    return digest.hexdigest()[:32]


def float_kind(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nonfinite_locals(exc: BaseException, limit: int = 32,
                     held: list[torch.Tensor] | None = None) -> list[tuple[str, str]]:
    """[(description, kind)] of the floating tensors holding NaN or Inf among the local
    variables of the frames an exception passed through, innermost first (the op that raised
    is closest to the bad value), nanaudit's own frames left out; at most `limit` checked.
    Without any, the value anomaly mode's error names (`anomaly_output`). `held`, when given,
    gets the bad tensors themselves, in the same order (the in-process replay maps them)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    seen: set[int] = set()
    bad: list[tuple[str, str]] = []
    checked = 0
    for frame in reversed(frames):
        path = frame.f_code.co_filename
        if os.path.abspath(path).startswith(_OURS + os.sep):
            continue
        for name, value in frame.f_locals.items():
            if (not isinstance(value, torch.Tensor) or id(value) in seen or value.is_sparse
                    or value.device.type == "meta" or not value.numel()
                    or not (value.is_floating_point() or value.is_complex())):
                continue
            seen.add(id(value))
            if checked >= limit:
                return bad
            checked += 1
            if not bool(torch.isfinite(value.detach()).all()):
                where = f"{frame.f_code.co_name} ({os.path.basename(path)}:{frame.f_lineno})"
                bad.append((f"`{name}` in {where}", value_kind(value.detach())))
                if held is not None:
                    held.append(value)
    return bad or anomaly_output(exc)


_ANOMALY = re.compile(r"Function '(\w+)' returned nan values in its (\d+)th output")


def anomaly_output(exc: BaseException) -> list[tuple[str, str]]:
    """[(description, "nan")] when the exception is anomaly mode's (a script that calls
    `torch.autograd.set_detect_anomaly(True)`: backward raises as soon as a function returns
    NaN): that value is the finding, the error its effect."""
    match = _ANOMALY.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return [(f"output {match[2]} of {match[1]} (anomaly detection)", "nan")] if match else []
