"""Cheap always-on checks: device-side finiteness and norms, read by the host once per step.

The trick (after torchtitan and GradScaler): one fused `_foreach_norm` over a set of tensors
gives per-tensor norms, combined in float64. A NaN or Inf element makes its tensor's norm
non-finite, so a finite total proves every element finite: the same reduction is the check and
the timeline's norm. The converse can fail (a float32 sum of squares overflows past ~1.8e19 per
element while every element is finite), so a non-finite norm is confirmed element by element
(`confirm_nonfinite`) before anything is reported: that extra sync happens only on the rare
step that trips. Nothing here calls `.item()` on the common path.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch._utils import _flatten_dense_tensors

from nanaudit.run.check.scope import float_buffers
from nanaudit.run.sharded import local_shard, local_shards

_FLOAT64_SAFE = (torch.float32, torch.float16, torch.bfloat16)
_GRAD, _LAYOUT = operator.attrgetter("grad"), operator.attrgetter("layout")
_IS_SET = functools.partial(operator.is_not, None)
_DENSE = {torch.strided}

# On the CPU every reduction kernel costs about a microsecond however small its tensor, and a
# model's biases and norm weights are many small tensors: those below PACK_BELOW elements are
# copied into one flat tensor (a copy that size costs less than a kernel) and reduced once.
# On an accelerator `_foreach_norm` is already a few fused kernels: nothing is packed there.
PACK_BELOW = 4096


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` as its tensors name it: a bare `cuda` is the current CUDA device, which a
    tensor's `.device` always gives with its index (`cuda:0`), so a check comparing the two
    never matched and took the per-tensor path, a copy and a launch per tensor per step."""
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.empty(0, device=device).device


def finite_norm(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The float64 L2 norm of all tensors together, on `device`; non-finite iff an element is."""
    if len(tensors) == 1 and tensors[0].dtype in _FLOAT64_SAFE \
            and tensors[0].device == torch.device(device):
        # One tensor (a packed copy): one kernel. Squares of these dtypes fit in float64.
        return torch.linalg.vector_norm(tensors[0], dtype=torch.float64)
    return finite_norms([tensors], device)[0]


def finite_norms(groups: Sequence[Sequence[torch.Tensor]], device: torch.device | str
                 ) -> list[torch.Tensor]:
    """finite_norm of each group, from one fused `_foreach_norm` over all of them: one call
    instead of one per group is what a small model's step notices."""
    flat = [t for group in groups for t in group]
    device = torch.device(device)
    if flat and all(t.dtype in _FLOAT64_SAFE and t.device == device for t in flat):
        # The common case, kept to a handful of ops: one fused pass, one stack, one norm per group.
        per_tensor = torch.stack(torch._foreach_norm(flat, 2.0, dtype=torch.float32))
    else:
        per_tensor = torch.stack(_mixed_norms(flat, device)) if flat else torch.zeros(0)
    out, start = [], 0
    for group in groups:
        if group:                     # then `flat`, and so `per_tensor`, has its norms
            out.append(torch.linalg.vector_norm(per_tensor[start:start + len(group)],
                                                dtype=torch.float64))
        else:
            out.append(torch.zeros((), dtype=torch.float64, device=device))
        start += len(group)
    return out


def _mixed_norms(flat: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Per-tensor float64 norms on `device` when dtypes or devices differ."""
    safe_index = [i for i, t in enumerate(flat) if t.dtype in _FLOAT64_SAFE]
    per_tensor: list = [None] * len(flat)
    if safe_index:
        norms = torch._foreach_norm([flat[i] for i in safe_index], 2.0, dtype=torch.float32)
        for i, n in zip(safe_index, norms):
            per_tensor[i] = n.to(device=device, dtype=torch.float64)
    for i, t in enumerate(flat):
        if per_tensor[i] is None:
            # float64 squares could overflow: keep the norm finite (clamped) and add NaN only
            # when an element really is non-finite.
            bad = (~torch.isfinite(t)).any()
            norm = torch.where(bad, float("nan"), t.detach().abs().double().norm().clamp(max=1e150))
            per_tensor[i] = norm.to(device=device, dtype=torch.float64)
    return per_tensor


def exact_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The norm computed without overflow (float64, scaled), for a false alarm's timeline."""
    total = 0.0
    for t in tensors:
        t = t.detach().to(torch.float64)
        scale = float(t.abs().max()) if t.numel() else 0.0
        if scale:
            total += (scale * float((t / scale).norm())) ** 2
    return total ** 0.5


def confirm_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    """Element-wise: does any tensor really hold NaN/Inf? (syncs; only after a norm trips)"""
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def batch_finite(batch_norm: float, leaves: Sequence[torch.Tensor]) -> bool:
    """Is the batch finite: its norm is, or (a float32 overflow) every element is?"""
    return math.isfinite(batch_norm) or not confirm_nonfinite(leaves)


class NormSource(Protocol):
    """What confirm_norms reads: a StepChecks, or Sentinel's scope."""

    def state_tensors(self) -> list[torch.Tensor]: ...
    def grad_values(self) -> list[torch.Tensor]: ...


def confirm_norms(checks: NormSource, norm: float, gnorm: float,
                  state: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """(state norm, gradient norm) with a non-finite one replaced by the exact norm when no
    element is actually non-finite. `checks`: a StepChecks (or anything with its
    `state_tensors` and `grad_values`); `state`: the tensors the state norm was taken over
    (default: the live state)."""
    state = checks.state_tensors() if state is None else state
    if not math.isfinite(norm) and not confirm_nonfinite(state):
        norm = exact_norm(state)
    if not math.isfinite(gnorm) and not confirm_nonfinite(checks.grad_values()):
        gnorm = exact_norm(checks.grad_values())
    return norm, gnorm


def peak(t: torch.Tensor) -> torch.Tensor:
    """0-dim, of `t`'s dtype: the largest |value| of a tensor with elements, finite exactly when
    every element is (NaN propagates through `aminmax` and `maximum`; -inf is the minimum),
    never an overflow. One pass: on the CPU `isfinite(t).all()` and the infinity-norm kernel
    cost 15 to 50 times as much (a 256 x 1024 batch on one thread: 0.54 and 0.69 ms, this
    0.04 ms), which a batch of images pays on every step."""
    low, high = torch.aminmax(t.detach() if t.requires_grad else t)
    return torch.maximum(high, low.neg())


def all_finite(tensors: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """A float64 0-dim tensor on `device`: 1.0 when every element is finite, else 0.0."""
    peaks = [peak(t).to(device=device, dtype=torch.float64) for t in tensors if t.numel()]
    if not peaks:
        return torch.ones((), dtype=torch.float64, device=device)
    return torch.isfinite(torch.stack(peaks)).all().to(torch.float64)


@dataclass
class StepReadout:
    """A step's loss and norms in one device tensor: [loss, batch norms, state norms, gradient
    norms], per tensor (the host combines them: no per-group reductions on the device, which a
    small model's step would notice) or one norm per group when dtypes or devices are mixed."""

    values: torch.Tensor
    n_batch: int
    n_state: int
    n_grads: int

    def __len__(self) -> int:
        return 1 + self.n_batch + self.n_state + self.n_grads

    def read(self, host: Sequence[float]) -> tuple[float, float, float, float]:
        """(batch norm, state norm, loss, gradient norm) from the host copy of `values`: each
        group's L2 norm of its per-tensor norms, in float64 (an Inf or NaN makes it
        non-finite; `hypot` scales, so finite norms never overflow their combination)."""
        a = 1 + self.n_batch
        b = a + self.n_state
        return (math.hypot(*host[1:a]), math.hypot(*host[a:b]), host[0],
                math.hypot(*host[b:b + self.n_grads]))

    def grad_norm(self) -> torch.Tensor:
        """The gradients' float64 norm on the device (for clipping: no sync)."""
        start = 1 + self.n_batch + self.n_state
        return torch.linalg.vector_norm(self.values[start:start + self.n_grads],
                                        dtype=torch.float64)

    def state_norm(self) -> torch.Tensor:
        start = 1 + self.n_batch
        return torch.linalg.vector_norm(self.values[start:start + self.n_state],
                                        dtype=torch.float64)

    def batch_bad(self) -> torch.Tensor:
        """1.0 (float64, on the device) when a batch norm is non-finite."""
        part = self.values[1:1 + self.n_batch]
        return (~torch.isfinite(part.sum(dtype=torch.float64))).to(torch.float64)


class StepChecks:
    """The step loop's checks on one model: state (parameters and float buffers) and gradients."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str,
                 params: list[torch.Tensor] | None = None) -> None:
        self.device = canonical_device(device)
        self.params = list(params) if params is not None else list(model.parameters())
        buffers = list(model.buffers())
        # Which buffers the state check reads (the check core's scope: the floating ones), by
        # their place in `model.buffers()`: a BufferKeeper's copies stand in for the live ones.
        floating = {id(b) for b in float_buffers(model)}
        self.float_buffers = [i for i, b in enumerate(buffers) if id(b) in floating]
        self.state = self.params + [buffers[i] for i in self.float_buffers]
        # Detached once: aliases of the same storage, which in-place updates keep current
        # (FSDP2: this rank's shards, whose storage the optimizer updates in place).
        self._state = [t.detach() for t in local_shards(self.state)]
        self.param_values = self._state[:len(self.params)]   # the parameters, detached
        # One fused float32 pass covers them (gradients share their parameter's dtype and
        # device); float64 or scattered tensors take the per-group path.
        self._fused = all(t.dtype in _FLOAT64_SAFE and t.device == self.device
                          for t in self._state)
        self._pack = (ParamPack(self.param_values) if self._fused and self.device.type == "cpu"
                      else None)

    def state_norm(self) -> torch.Tensor:
        return finite_norm(self._state, self.device)

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self._state)

    def grads(self) -> list[torch.Tensor]:
        # filter/map/attrgetter walk the parameters in C: this runs every step.
        return local_shards(filter(_IS_SET, map(_GRAD, self.params)))

    def grad_values(self) -> list[torch.Tensor]:
        """Each gradient as a dense tensor of its values: a sparse gradient
        (`Embedding(sparse=True)`) contributes its coalesced values, which no dense kernel
        such as `_foreach_norm` would take whole."""
        grads = self.grads()
        if set(map(_LAYOUT, grads)) <= _DENSE:
            return grads
        return [dense_values(g) for g in grads]

    def grad_norm(self) -> torch.Tensor:
        return finite_norm(self.grad_values(), self.device)

    def norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(state norm, gradient norm) from one fused reduction."""
        state, grads = finite_norms([self._state, self.grad_values()], self.device)
        return state, grads

    def state_before(self, saved_buffers: list | None) -> list[torch.Tensor]:
        """The state as this step's forward found it: the parameters (a forward leaves them
        alone) and the buffers' copies from before it (BatchNorm's running statistics change
        inside the forward; a NaN made there is this step's, not an earlier update's)."""
        if not saved_buffers or not self.float_buffers:
            return self._state
        return self.param_values + [saved_buffers[i] for i in self.float_buffers]

    def step_readout(self, loss: torch.Tensor, batch_leaves: list,
                     state: list | None = None) -> StepReadout:
        """The step's loss and the norms of its batch, weights and gradients: one fused
        `_foreach_norm` and one stack on the common path."""
        grads = self.grad_values()
        state = self._state if state is None else state
        # The batch's leaves were moved to the device with the batch: only dtypes can differ.
        if self._fused and all(t.dtype in _FLOAT64_SAFE for t in batch_leaves):
            if self._pack is not None:
                state, grads = self._pack.state(state), self._pack.pack(grads)
            norms = torch._foreach_norm(batch_leaves + state + grads, 2.0,
                                        dtype=torch.float32)
            return StepReadout(torch.stack([loss.detach(), *norms]), len(batch_leaves),
                               len(state), len(grads))
        batch_norm, state_norm, grad_norm = finite_norms([batch_leaves, state, grads],
                                                         self.device)
        values = torch.stack([loss.detach().to(torch.float64), batch_norm, state_norm, grad_norm])
        return StepReadout(values, 1, 1, 1)

    def zero_grad(self) -> None:
        """`model.zero_grad(set_to_none=True)` without walking the module tree each step."""
        for p in self.params:
            p.grad = None

    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Scale gradients by max_norm / total_norm when above it, without a host sync."""
        grads = self.grads()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        by_key: dict = {}
        for g in grads:
            by_key.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), group in by_key.items():
            torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))


class PackLayout:
    """Which of a CPU model's tensors are small (below PACK_BELOW elements, contiguous), and a
    list of tensors in their places (the parameters, their gradients) with the small ones
    flattened into one: a group's norm is the same whichever way its elements are grouped.
    It keeps places, not the tensors, so it follows a parameter given new storage."""

    def __init__(self, params: list[torch.Tensor]):
        small = [i for i, p in enumerate(params) if p.numel() < PACK_BELOW and p.is_contiguous()]
        self.small = small if len(small) > 1 else []    # packing one tensor saves nothing
        chosen = set(self.small)
        self.large = [i for i in range(len(params)) if i not in chosen]
        self.count = len(params)

    def pack(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors`, one per parameter in order, with the small ones packed, when every
        parameter has one (otherwise their places do not line up: one by one). The packing
        walks the list in C (`flatten_dense_tensors`, as DDP's buckets do): a Python loop of
        reshapes would cost what it saves."""
        if not self.small or len(tensors) != self.count:
            return tensors
        if not self.large:                       # a small model: every tensor is packed
            return [_flatten_dense_tensors(tensors)]
        small = [tensors[i] for i in self.small]
        return [_flatten_dense_tensors(small), *[tensors[i] for i in self.large]]


class ParamPack(PackLayout):
    """A CPU model's small contiguous parameters (below PACK_BELOW elements), handled as one
    flat tensor: reduced once for a norm and copied once for a snapshot."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params)
        # Flat views, made once: in-place updates keep them current.
        self._small_views = [params[i].view(-1) for i in self.small]
        self.large_params = [params[i] for i in self.large]

    def params(self) -> list[torch.Tensor]:
        """The parameters' tensors to reduce: the small ones packed, then the large ones."""
        return [torch.cat(self._small_views), *self.large_params] if self.small \
            else self.large_params

    def state(self, state: list[torch.Tensor]) -> list[torch.Tensor]:
        """The state's tensors to reduce (state is the parameters, then the buffers)."""
        return self.params() + state[self.count:] if self.small else state

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the parameters, in `params()`'s layout."""
        copies = [p.clone() for p in self.large_params]
        return [torch.cat(self._small_views), *copies] if self.small else copies

    def subtract_from(self, snapshot: list[torch.Tensor]) -> list[torch.Tensor]:
        """snapshot - the parameters now, in place: the update since the snapshot, negated."""
        if self.small:
            snapshot[0].sub_(torch.cat(self._small_views))
        large = snapshot[1:] if self.small else snapshot
        if large:
            torch._foreach_sub_(large, self.large_params)
        return snapshot


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's stored values as a dense tensor (itself when dense; this rank's shard
    of an FSDP2 DTensor, whose own ops would be collectives): what the finiteness checks and
    statistics read, since most kernels take no sparse layout."""
    if t.layout is torch.strided:      # the common case, first: this runs per gradient per step
        return local_shard(t)
    if t.layout is torch.sparse_coo:
        return t.coalesce().values()
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return t.values()
    return t


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a non-finite element: for the report, after a trip (syncs)."""
    return [name for name, t in named
            if t is not None and not bool(torch.isfinite(dense_values(t.detach())).all())]


def value_kind(t: torch.Tensor) -> str:
    """'nan', 'inf' or '-inf': the kind of non-finite value a tensor holds, NaN first (syncs)."""
    t = dense_values(t.detach())
    if bool(torch.isnan(t).any()):
        return "nan"
    if bool((t == float("inf")).any()):
        return "inf"
    return "-inf"
