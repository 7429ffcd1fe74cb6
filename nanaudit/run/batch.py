"""Batches as trees: walking their tensor leaves, moving them to a device, the batch dimension
of each leaf and slicing a batch by rows.

The batch size is the leading size most leaves share; a leaf whose leading size differs (a
time-major `(T, B, C)` tensor for CTC) is sliced along the first dimension of that size, and a
leaf with none (a per-batch scalar) is passed whole. `batch_dim:` in the config overrides both.
"""

from __future__ import annotations

import dataclasses

from collections import Counter
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable, Iterator

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


def children(tree: Any) -> list[tuple[str, Any]] | None:
    """A container's children as (path suffix, child), or None for a leaf. Containers are the
    shapes batches come in: any Mapping (dict, OrderedDict, `UserDict`, and so Hugging Face's
    `BatchEncoding` / `BatchFeature`), dataclass instances, namedtuples, lists and tuples.
    Suffixes read like the user's code: `["input_ids"]`, `.pixels`, `[0]`."""
    if isinstance(tree, Mapping):
        return [(_key_path("", k), v) for k, v in tree.items()]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [(f".{f.name}", getattr(tree, f.name)) for f in dataclasses.fields(tree)]
    if isinstance(tree, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(tree)]
    return None


def rebuild(tree: Any, values: list) -> Any:
    """The container `tree` with its children replaced by `values` (same order as
    `children`), of the same type where the type can be rebuilt, else the plain equivalent."""
    if isinstance(tree, Mapping):
        pairs = dict(zip(tree.keys(), values))
        if type(tree) is dict:
            return pairs
        try:
            return type(tree)(pairs)
        except Exception:  # noqa: BLE001 - a Mapping type that cannot be built from a dict
            return pairs
    if dataclasses.is_dataclass(tree):
        return dataclasses.replace(tree, **{f.name: v for f, v in
                                            zip(dataclasses.fields(tree), values)})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*values)
    return type(tree)(values) if isinstance(tree, (list, tuple)) else values


def iter_leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (path, leaf) for every non-container leaf, depth first, in a stable order."""
    items = children(tree)
    if items is None:
        yield path, tree
        return
    for suffix, value in items:
        yield from iter_leaves(value, path + suffix)


def tensor_leaves(tree: Any) -> list[tuple[str, Any]]:
    import torch
    return [(p, t) for p, t in iter_leaves(tree) if isinstance(t, torch.Tensor)]


def float_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(p, t) for p, t in tensor_leaves(tree) if t.is_floating_point() or t.is_complex()]


def map_tensors(tree: Any, fn: Callable[[str, Any], Any], path: str = "") -> Any:
    """Rebuild the tree with fn(path, tensor) applied to each tensor; keeps container types."""
    import torch
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    items = children(tree)
    if items is None:
        return tree
    return rebuild(tree, [map_tensors(v, fn, path + suffix) for suffix, v in items])


def to_plain(tree: Any, leaf: Callable[[Any], Any] = lambda x: x) -> Any:
    """The tree as plain dict / list / tuple (what `torch.load(weights_only=True)` reads),
    `leaf` applied to every leaf: a dataclass becomes the dict of its fields."""
    items = children(tree)
    if items is None:
        return leaf(tree)
    values = [to_plain(v, leaf) for _, v in items]
    if isinstance(tree, Mapping) or dataclasses.is_dataclass(tree):
        keys = tree.keys() if isinstance(tree, Mapping) else [f.name for f in
                                                               dataclasses.fields(tree)]
        return dict(zip(keys, values))
    return values if isinstance(tree, list) else tuple(values)


def to_device(tree: Any, device) -> Any:
    return move(tree, device, [])


def move(tree: Any, device, leaves: list) -> Any:
    """The batch on `device`, collecting its floating-point tensors in `leaves` in the same
    walk (the step's batch check reads them). A leaf object with its own `.to(device)` (a
    custom batch class) is moved by it. non_blocking lets host-to-device copies overlap with
    compute on CUDA; it is a no-op on CPU."""
    if isinstance(tree, torch.Tensor):
        moved = tree.to(device, non_blocking=True)
        if moved.is_floating_point() or moved.is_complex():
            leaves.append(moved)
        return moved
    kind = type(tree)
    if kind is tuple or kind is list:     # the common shapes, without building path names
        return kind([move(v, device, leaves) for v in tree])
    if kind is dict:
        return {k: move(v, device, leaves) for k, v in tree.items()}
    items = children(tree)
    if items is None:
        mover = getattr(tree, "to", None)
        return mover(device) if callable(mover) and not isinstance(tree, (str, bytes)) \
            else tree
    return rebuild(tree, [move(v, device, leaves) for _, v in items])
