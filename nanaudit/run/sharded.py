"""FSDP2 (`fully_shard`) as the checks see it: each rank's own shards, and its own gradients
before the reduce-scatter mixes them.

Under FSDP2 every parameter, gradient and optimizer-state tensor is a DTensor sharded on dim 0:
each rank holds a slice of rows (an empty one when dim 0 is smaller than the world), and an op
on the DTensor itself (`isfinite(p).all()`, `.tolist()`) is a collective, which run by one rank
alone hangs. So the checks read each rank's own shard (`local_shards`), and what one rank sees
becomes every rank's decision through the step's exchange of flags (run/distributed.py).

After the reduce-scatter, a NaN made in one rank's backward sits in whichever rank owns those
elements, and that rank is not the one that made it. `PreReduceFlags` wraps each FSDP module's
reduce-scatter (FSDP's own `set_custom_reduce_scatter`, delegating to the one in place) to note
on the device, with no host read, whether this rank's unsharded gradients were finite before
they were reduced: what DDP's communication hook tells for DDP. Under HSDP (a 2-D mesh) the
reduce-scatter over dp_shard runs before the all-reduce over dp_replicate, so its input is still
this rank's own; the mesh itself is named by run/mesh.py. While a replay traces the step
it computes nothing (no op of ours in the trace) and keeps the inputs as the values to walk
back from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from nanaudit.config.sections import mesh_world_problems
from nanaudit.errors import ConfigError


def _dtensor_class() -> Any:
    """DTensor when torch.distributed.tensor is loaded (none can exist before it is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise). The DTensor's own tensor,
    not `to_local()`, which costs microseconds of autograd plumbing per call and per step."""
    return t._local_tensor if is_sharded(t) else t    # type: ignore[attr-defined]


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    cls = _dtensor_class()
    if cls is None:
        return list(tensors)
    return [t._local_tensor if isinstance(t, cls) else t for t in tensors]


def nonfinite_shards(tensors: list, owners: list | None = None) -> list:
    """(owner, local shard) of each tensor whose shard on this rank holds NaN or Inf (`owners`:
    what to name each by, default the tensor itself): a read per tensor, after a trip only."""
    return [(o, v) for o, v in zip(owners if owners is not None else tensors,
                                   local_shards(tensors))
            if not bool(torch.isfinite(v).all())]


def shard_rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(first row, rows held, rows in all) of dim 0 that this rank's shard of `t` holds; None
    for a tensor that is not sharded."""
    if not is_sharded(t) or t.dim() == 0:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements)              # type: ignore[attr-defined]
    return int(offset[0]), int(shape[0]), int(t.shape[0])


def describe_shard(t: torch.Tensor, rank: int | None) -> str:
    """`rank 1's shard (rows 4-7 of 8)`, or '' for a tensor that is not sharded."""
    rows = shard_rows(t)
    if rows is None:
        return ""
    first, held, total = rows
    who = f"rank {rank}'s shard" if rank is not None else "this rank's shard"
    span = f"rows {first}-{first + held - 1}" if held else "no rows"
    return f"{who} ({span} of {total})"


def fsdp_modules(module: torch.nn.Module) -> list:
    """The FSDP2 modules in `module`'s tree (none unless FSDP2 is loaded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    if cls is None:
        return []
    return [m for m in module.modules() if isinstance(m, cls)]


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int,
                param_dtype: str, dims: dict | None = None, tp: int = 1,
                parallelize: Callable[..., Any] | None = None) -> None:
    """`distributed.fsdp`: shard the user's model with FSDP2 as torchtitan does, each block on
    its own (every module of every ModuleList), then the root; `param_dtype` bf16 or fp16 runs
    forward and backward in it and reduces the gradients in float32. `dims` (HSDP's
    `distributed.mesh`, {name: size}): over that 2-D mesh, replicated over its first dimension,
    sharded over its second. `tp` > 1: the user's `parallelize(model, mesh["tp"])` (their
    ColwiseParallel / RowwiseParallel plan) runs first on the mesh's last dimension, and FSDP2
    shards over the data-parallel dimensions before it, torchtitan's order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    problems = mesh_world_problems(dims, tp, world_size)
    if problems:
        raise ConfigError(problems)
    sizes = dict(dims or ({"dp_shard": world_size // tp} if tp > 1 else {}))
    sizes.update({"tp": tp} if tp > 1 else {})
    mesh = init_device_mesh(device.type, tuple(sizes.values()) or (world_size,),
                            mesh_dim_names=tuple(sizes) or None)
    if tp > 1 and parallelize is not None:
        parallelize(model, mesh["tp"])
        mesh = mesh[tuple(name for name in sizes if name != "tp")]
    blocks = [block for module in model.modules() if isinstance(module, torch.nn.ModuleList)
              for block in module]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


class PreReduceFlags:
    """Notes whether this rank's own gradients were finite before each FSDP reduce-scatter
    (see the module docstring). `take()` returns the flag since the last take."""

    def __init__(self) -> None:
        self.wrapped: set[int] = set()
        self._extremes: list[torch.Tensor] = []   # each reduce-scatter input's min and max
        self.tracing = False                     # a replay's traced window: keep, compute none
        self.sinks: list[torch.Tensor] = []      # the reduce-scatter inputs seen while tracing

    def install(self, modules: Sequence) -> None:
        """Wrap the reduce-scatter of each FSDP module not wrapped yet (the one in place, the
        user's own included, still runs)."""
        for module in modules:
            if id(module) in self.wrapped:
                continue
            self.wrapped.add(id(module))
            groups = fsdp_param_groups(module._get_fsdp_state())
            if len(groups) != 1:
                continue            # no parameters, or several meshes: FSDP refuses a custom one
            inner = getattr(groups[0], "_reduce_scatter_comm", None)
            if inner is None or not hasattr(module, "set_custom_reduce_scatter"):
                continue            # a torch whose FSDP2 takes no custom reduce-scatter
            module.set_custom_reduce_scatter(_flagging_comm(self, inner))

    def note(self, unsharded: torch.Tensor) -> None:
        if self.tracing:
            self.sinks.append(unsharded)
        elif unsharded.numel():
            # One pass and no mask: the least and greatest element are finite iff every one is
            # (NaN propagates), at a twentieth of isfinite().all()'s cost on the CPU.
            self._extremes.extend(torch.aminmax(unsharded))

    def take(self, device: torch.device) -> torch.Tensor:
        """1.0 (float64, on the device) when a reduce-scatter since the last take carried a
        non-finite value of this rank's own gradients, else 0.0."""
        extremes, self._extremes = self._extremes, []
        if not extremes:
            return torch.zeros((), dtype=torch.float64, device=device)
        finite = torch.isfinite(torch.stack(extremes)).all()
        return (~finite).to(device=device, dtype=torch.float64)


def fsdp_param_groups(state: Any) -> list:
    """An FSDP module's parameter groups: torch 2.13 keeps a list (`_fsdp_param_groups`, one per
    mesh), torch 2.11 one group or None (`_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    single = getattr(state, "_fsdp_param_group", None)
    return [] if single is None else [single]


def _flagging_comm(flags: PreReduceFlags, inner: Any) -> Any:
    """A ReduceScatter that notes its input in `flags`, then runs `inner`."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class FlaggingReduceScatter(ReduceScatter):
        def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
            return inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, op: Any, async_op: bool = False) -> Any:
            flags.note(input_tensor)
            return inner(output_tensor, input_tensor, group, op, async_op)
    return FlaggingReduceScatter()
