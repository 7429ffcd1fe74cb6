"""Device meshes as a finding names them: each rank's named coordinate on the model's mesh
(`dp_replicate=1, dp_shard=0` under HSDP, `dp=1, tp=1` under FSDP2 + tensor parallel), each
parameter's DTensor placement, and the global index of an element of a local shard.

Read once, when the checks first see the model (`MeshView.of`), from the parameters' own
DTensor specs: no collective, no host read per step. The widest mesh among the parameters is
the run's (FSDP2 over a TP model gives its parameters the whole ("dp", "tp") mesh; TP alone, a
1-D one). Plain frozen data, so it travels in the gather of every rank's finding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.report.model import Finding
from nanaudit.report.sections import ShardElement
from nanaudit.run.live import holds_hook
from nanaudit.run.sharded import is_sharded


@dataclass(frozen=True)
class MeshView:
    """The model's device mesh: its dimension names and shape, the global rank at each
    position (row-major), and each sharded parameter's placement (by the user's name)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module) -> MeshView | None:
        """The view of `model`'s widest mesh; None when no parameter is a DTensor."""
        params = [(name, p) for name, p in model.named_parameters() if is_sharded(p)]
        if not params:
            return None
        mesh = max((p.device_mesh for _, p in params), key=lambda m: m.ndim)  # type: ignore[attr-defined]
        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        return cls(names, tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten()),
                   {name: placement_of(p) for name, p in params})

    def coordinate(self, rank: int | None) -> dict[str, int] | None:
        """`rank`'s position by dimension name ({"dp": 1, "tp": 0}); None off the mesh."""
        if rank is None or rank not in self.ranks:
            return None
        flat, position = self.ranks.index(rank), []
        for size in reversed(self.shape):
            flat, index = divmod(flat, size)
            position.append(index)
        return dict(zip(self.names, reversed(position)))

    def placements_of(self, names: Sequence[str]) -> dict[str, str] | None:
        """The placements of the named parameters that are sharded (None: none is)."""
        found = {name: self.placements[name] for name in names if name in self.placements}
        return found or None


def placement_of(t: torch.Tensor) -> str:
    """A DTensor's placement by mesh dimension: `dp=Shard(dim=0), tp=Shard(dim=1)`."""
    mesh: Any = t.device_mesh                                   # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return ", ".join(f"{name}={placement!r}" for name, placement
                     in zip(names, t.placements))                # type: ignore[attr-defined]


def global_index(t: torch.Tensor, local: Sequence[int]) -> tuple[int, ...]:
    """The index in the whole tensor of the element at `local` in this rank's shard of `t`
    (`local` itself for a tensor that is not sharded). Exact for every placement, FSDP2's
    `_StridedShard` over tensor parallel included (its rows are not one block): each dimension's
    positions are laid out by DTensor itself, on a range as long as the dimension, with no
    communication (`src_data_rank=None`: each rank keeps its own part)."""
    if not is_sharded(t):
        return tuple(int(i) for i in local)
    return tuple(_positions(t, dim)[int(i)] for dim, i in enumerate(local))


def global_rows(t: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """The indices in the whole tensor of these rows (along dim 0) of this rank's shard of `t`
    (themselves for a tensor that is not sharded)."""
    if not is_sharded(t) or not rows:
        return [int(r) for r in rows]
    positions = _positions(t, 0)
    return [positions[int(r)] for r in rows]


def _positions(t: Any, dim: int) -> list[int]:
    """The global positions along `dim` of this rank's shard of the DTensor `t`."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    along: list[Any] = []
    for placement in t.placements:
        if isinstance(placement, _StridedShard) and placement.dim == dim:
            along.append(_StridedShard(0, split_factor=placement.split_factor))
        elif isinstance(placement, Shard) and placement.dim == dim:
            along.append(Shard(0))
        else:
            along.append(Replicate())
    positions = torch.arange(t.shape[dim])
    spread = distribute_tensor(positions, t.device_mesh, along, src_data_rank=None)
    return [int(i) for i in spread._local_tensor.tolist()]


def first_bad_element(name: str, t: torch.Tensor) -> ShardElement | None:
    """The first non-finite element of this rank's shard of the sharded `t`, by its index in
    the shard and in the whole tensor (None: `t` is not sharded, or its shard is finite). A
    host read: after a trip only."""
    if not is_sharded(t):
        return None
    bad = (~torch.isfinite(t._local_tensor.detach())).nonzero()   # type: ignore[attr-defined]
    if not bad.numel():
        return None
    local = [int(i) for i in bad[0].tolist()]
    return ShardElement(tensor=name, local_index=local, global_index=list(global_index(t, local)))


def first_element(named: Iterable[tuple[str, torch.Tensor | None]]) -> ShardElement | None:
    """The first bad element of the first sharded tensor among `named` ((name, tensor), in
    order; None entries skipped) whose shard on this rank holds one. A host read per tensor:
    after a trip only."""
    for name, t in named:
        element = first_bad_element(name, t) if t is not None else None
        if element is not None:
            return element
    return None


def tensor_element(model: torch.nn.Module, gradients: bool) -> ShardElement | None:
    """The first bad element of `model`'s sharded parameters (`gradients`: of their
    gradients, named `NAME.grad`), on this rank: what `scan` and `Sentinel` name, as
    `nanaudit run` does from its trip."""
    return first_element((f"{name}.grad", p.grad) if gradients else (name, p)
                         for name, p in model.named_parameters())


def name_on_mesh(view: MeshView | None, finding: Finding | None) -> None:
    """Give `finding` its origin rank's mesh coordinate and its sharded tensors' placements
    (a run on no mesh, or no finding: nothing)."""
    if view is None or finding is None:
        return
    finding.mesh = view.coordinate(finding.rank)
    finding.placements = view.placements_of(finding.tensors)


class PartialFlags:
    """Notes, on the device and with no host read, how early in the step this rank's own
    partial sums first held a non-finite value before tensor parallel's all-reduce made them
    every tp peer's, in each direction:

    * forward: a forward hook, run before TP's own output hook (`prepend`), on each module that
      holds DTensor parameters, reads the output a row-wise layer leaves `Partial`;
    * backward: a forward pre-hook, run after TP's input hook (which made the input a DTensor),
      hooks the gradient of each DTensor input: a column-wise layer's input gradient is
      `Partial` (this rank's columns' share) until the backward of TP's input redistribution
      all-reduces it over the tp group.

    Every rank of a tp group runs the same all-reduces in the same order, and a value that
    arrived from a peer shows only in later ones: the rank whose bad partial came first made
    it. While a replay traces the hooks compute nothing."""

    def __init__(self) -> None:
        self.hooked: dict[int, Any] = {}     # id(module) -> its forward hook's handle
        self._extremes: list[torch.Tensor] = []    # each partial output's least and greatest
        self._gradients: list[torch.Tensor] = []   # each partial input gradient's
        self.tracing = False

    def install(self, model: torch.nn.Module) -> None:
        """Hook `model`'s modules that hold DTensor parameters, when tensor parallelism laid
        any of them out (FSDP2 alone never leaves a value `Partial`: no hook)."""
        if not tensor_parallel(model):
            return
        for module in model.modules():
            if holds_hook(self.hooked, module) or not any(
                    is_sharded(p) for p in module.parameters(recurse=False)):
                continue
            self.hooked[id(module)] = module.register_forward_hook(self._note, prepend=True)
            module.register_forward_pre_hook(self._hook_inputs)

    def _note(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.tracing:
            _note_partial(self._extremes, output)

    def _hook_inputs(self, module: torch.nn.Module, args: Any) -> None:
        if self.tracing:
            return
        for arg in args:
            if is_sharded(arg) and arg.requires_grad:
                arg.register_hook(self._note_gradient)

    def _note_gradient(self, grad: torch.Tensor) -> None:
        if not self.tracing:
            _note_partial(self._gradients, grad)

    def take(self, device: torch.device) -> torch.Tensor:
        """How early this step's first non-finite partial output came (float64, on the
        device): n - i for the i-th of n, 0.0 when none was."""
        extremes, self._extremes = self._extremes, []
        return _earliness(extremes, device)

    def take_gradients(self, own: torch.Tensor) -> torch.Tensor:
        """This rank's own-gradients column (check/rank_row.py) from `own`, its flag from the
        reductions (1.0: bad before one), and how early its first non-finite partial input
        gradient came (e, as `take`): 1 + e when one was bad, ranking it above a plain flag
        (`own_gradients` reads it back), else `own`. On the device, no host read."""
        gradients, self._gradients = self._gradients, []
        if not gradients:           # no tensor-parallel layer noted one: no kernel to launch
            return own
        early = _earliness(gradients, own.device)
        return torch.where(early > 0, early + 1.0, own)


def tensor_parallel(model: torch.nn.Module) -> bool:
    """Did tensor parallelism lay out any of `model`'s modules? torch's `parallelize_module`
    distributes each module its plan names with `distribute_module`, which marks the module;
    FSDP2's `fully_shard` marks none."""
    return any(getattr(m, "_distribute_module_applied", False) for m in model.modules())


def _note_partial(into: list[torch.Tensor], t: Any) -> None:
    """Append the least and greatest of this rank's part of `t` when it is a DTensor left
    `Partial` (finite iff every element is: NaN propagates)."""
    if not is_sharded(t) or not any(p.is_partial() for p in t.placements):
        return
    local = t._local_tensor.detach()
    into.append(torch.stack(torch.aminmax(local)) if local.numel()
                else torch.zeros(2, dtype=local.dtype, device=local.device))


def _earliness(extremes: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """n - i for the first non-finite of n noted pairs (the i-th), 0.0 when none is."""
    if not extremes:
        return torch.zeros((), dtype=torch.float64, device=device)
    bad = ~torch.isfinite(torch.stack([e.to(device) for e in extremes])).all(dim=1)
    earliness = torch.arange(len(extremes), 0, -1, device=device, dtype=torch.float64)
    return (bad.to(torch.float64) * earliness).max()


def own_losses(loss_ok: list[bool], earliness: list[float]) -> list[bool]:
    """Per rank, is its loss free of a value its own computation made? When ranks with a bad
    loss had bad partial outputs, the makers are those whose bad partial came first
    (`earliness`: PartialFlags.take of each rank); the others received it through TP's
    all-reduce. Otherwise a bad loss is the rank's own."""
    first = max((e for ok, e in zip(loss_ok, earliness) if not ok), default=0.0)
    if first <= 0:
        return loss_ok
    return [ok or e < first for ok, e in zip(loss_ok, earliness)]


def own_gradients(column: list[float]) -> list[bool]:
    """Per rank, are its own gradients free of a value its own backward made (`column`: each
    rank's PartialFlags.take_gradients)? When a rank's partial input gradient went bad before
    tensor parallel's backward all-reduce (a value above 1.0), the makers are the ranks whose
    bad one came first, their reductions' flag set or not (TP alone reduces nothing else);
    every other rank's bad gradients arrived through that all-reduce. Otherwise a set flag is
    the rank's own."""
    first = max(column, default=0.0)
    if first <= 1.0:
        return [not value > 0 for value in column]
    return [value < first for value in column]
