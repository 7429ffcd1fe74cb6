"""Statistics of a tensor for the report (lovely-tensors style): shape, range, bad-value counts;
and of the tensor inputs of the op a finding names.
"""

from __future__ import annotations

import math

import torch

from nanaudit.localize.events import OpEvent
from nanaudit.localize.ops import named_tensors
from nanaudit.localize.overflow import released
from nanaudit.report.model import TensorStats
from nanaudit.run.checks import dense_values

SMALL_TENSOR = 16   # at most this many elements: show the values themselves


def tensor_stats(name: str, t: torch.Tensor) -> TensorStats:
    """min/max/mean over the finite elements, plus counts of NaN, +inf, -inf, zeros, negatives
    (none of them for a tensor whose memory was released since the op read it: `released`)."""
    if released(t):
        return TensorStats(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.numel(),
                           None, None, None, None, None, None, None, None, released=True)
    t = dense_values(t.detach())
    if t.is_complex():
        t = t.abs()
    shape, dtype, numel = tuple(t.shape), str(t.dtype).replace("torch.", ""), t.numel()
    if numel == 0:
        return TensorStats(name, shape, dtype, 0, None, None, None, 0, 0, 0, 0, 0, value=[])
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    work = t.to(torch.float64)
    finite = torch.isfinite(work)
    counts = torch.stack([
        torch.isnan(work).sum(), (work == math.inf).sum(), (work == -math.inf).sum(),
        (work == 0).sum(), (work < 0).sum(), finite.sum(),
    ]).tolist()
    nan, posinf, neginf, zeros, negatives, n_finite = (int(c) for c in counts)
    lo = hi = mean = None
    if n_finite:
        values = work[finite]
        lo, hi, mean = (float(v) for v in torch.stack([values.min(), values.max(),
                                                        values.mean()]).tolist())
    value = t.to(torch.float64).flatten().tolist() if numel <= SMALL_TENSOR else None
    return TensorStats(name, shape, dtype, numel, lo, hi, mean, nan, posinf, neginf, zeros,
                       negatives, value=value)


def first_index(mask: torch.Tensor) -> tuple | None:
    """The index of the first True element of a mask, as a tuple (syncs)."""
    nz = mask.nonzero()
    return tuple(int(i) for i in nz[0].tolist()) if nz.numel() else None


def input_stats(event: OpEvent) -> list[TensorStats]:
    """The statistics of each tensor input of the op, named by its schema (`self`, `other`)."""
    return [tensor_stats(name, t) for name, t in named_tensors(event.arg_names, event.args,
                                                                event.kwargs)]


def forward_input_stats(event: OpEvent) -> list[TensorStats]:
    """For a backward op: the statistics of its forward op's inputs, when the tracer kept them."""
    record = event.forward
    if record is None or record.args is None:
        return []
    return [tensor_stats(name, t) for name, t in named_tensors(record.arg_names, record.args,
                                                                record.kwargs)]
