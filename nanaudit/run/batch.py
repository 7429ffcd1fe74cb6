"""Batches as trees: walking their tensor leaves, moving them to a device, the batch dimension
of each leaf and slicing a batch by rows.

The batch size is the leading size most leaves share; a leaf whose leading size differs (a
time-major `(T, B, C)` tensor for CTC) is sliced along the first dimension of that size, and a
leaf with none (a per-batch scalar) is passed whole. `batch_dim:` in the config overrides both.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from nanaudit.errors import ConfigError, Problem


@dataclass(frozen=True)
class BatchLayout:
    size: int | None                 # None: no batch dimension could be found
    dims: Mapping[str, int | None]   # leaf path -> its batch dimension (None: not sliced)


def infer_layout(batch: Any, overrides: Mapping[str, int] | None = None) -> BatchLayout:
    overrides = dict(overrides or {})
    leaves = tensor_leaves(batch)
    dims: dict[str, int | None] = {}
    for path, t in leaves:
        if path in overrides:
            if not -t.dim() <= overrides[path] < max(t.dim(), 1):
                raise ConfigError([Problem(f"batch_dim[{path!r}]", f"dimension "
                                           f"{overrides[path]} does not exist: batch{path} has "
                                           f"shape {list(t.shape)}")])
            dims[path] = overrides[path] % max(t.dim(), 1)
        elif "*" in overrides and -t.dim() <= overrides["*"] < t.dim():
            dims[path] = overrides["*"] % t.dim()
    sizes = Counter(t.shape[dims[p]] for p, t in leaves if p in dims and dims[p] is not None)
    if not sizes:
        sizes = Counter(t.shape[0] for _, t in leaves if t.dim() >= 1)
    if not sizes:
        return BatchLayout(None, {p: None for p, _ in leaves})
    size = max(sizes.items(), key=lambda kv: (kv[1], kv[0]))[0]
    for path, t in leaves:
        if path not in dims:
            dims[path] = next((d for d in range(t.dim()) if t.shape[d] == size), None)
    return BatchLayout(size, dims)


def select_rows(batch: Any, layout: BatchLayout, rows: list[int]) -> Any:
    """The batch restricted to `rows`, keeping its structure and each leaf's batch dimension."""
    def pick(path, t):
        dim = layout.dims.get(path)
        if dim is None:
            return t
        return t.index_select(dim, torch.tensor(rows, dtype=torch.long, device=t.device))
    return map_tensors(batch, pick)


def nonfinite_rows(t: torch.Tensor, dim: int | None) -> list[int]:
    """Rows along `dim` holding a non-finite element (all of dim 0 when dim is None)."""
    bad = ~torch.isfinite(t)
    if dim is None or t.dim() == 0:
        return [0] if bool(bad.any()) else []
    bad = bad.movedim(dim, 0).reshape(t.shape[dim], -1).any(dim=1)
    return bad.nonzero().flatten().tolist()


def _key_path(path: str, key: Any) -> str:
    return f"{path}[{key!r}]".replace("'", '"')


def iter_leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (path, leaf) for every non-container leaf, depth first, in a stable order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from iter_leaves(value, _key_path(path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from iter_leaves(value, f"{path}[{index}]")
    else:
        yield path, tree


def tensor_leaves(tree: Any) -> list[tuple[str, Any]]:
    import torch
    return [(p, t) for p, t in iter_leaves(tree) if isinstance(t, torch.Tensor)]


def float_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(p, t) for p, t in tensor_leaves(tree) if t.is_floating_point() or t.is_complex()]


def map_tensors(tree: Any, fn: Callable[[str, Any], Any], path: str = "") -> Any:
    """Rebuild the tree with fn(path, tensor) applied to each tensor; keeps container types."""
    import torch
    if isinstance(tree, dict):
        return type(tree)((k, map_tensors(v, fn, _key_path(path, k)))
                          for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(tree)))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(tree))
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    return tree


def to_device(tree: Any, device) -> Any:
    # non_blocking lets host-to-device copies overlap with compute on CUDA; a no-op on CPU.
    return map_tensors(tree, lambda _, t: t.to(device, non_blocking=True))
