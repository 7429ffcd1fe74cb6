"""Batches as trees: walking their tensor leaves, moving them to a device, the batch dimension
of each leaf and slicing a batch by rows.

The batch size is the leading size most leaves share; a leaf whose leading size differs (a
time-major `(T, B, C)` tensor for CTC) is sliced along the first dimension of that size, and a
leaf with none (a per-batch scalar) is passed whole. `batch_dim:` in the config overrides both.
A list or tuple holding no tensor whose length is the batch size (ids, file names, per-sample
lengths) is per-sample: it is sliced with the rows, and findings show its entries beside them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.errors import ConfigError, Problem, UserCodeError


@dataclass(frozen=True)
class BatchLayout:
    size: int | None                 # None: no batch dimension could be found
    dims: Mapping[str, int | None]   # leaf path -> its batch dimension (None: not sliced)
    per_sample: frozenset = frozenset()   # paths of per-sample lists/tuples of non-tensors


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
    return BatchLayout(size, dims, frozenset(per_sample_paths(batch, size)))


def per_sample_paths(tree: Any, size: int, path: str = "") -> list[str]:
    """Paths of the lists and tuples (not namedtuples: those are records) that hold no tensor
    and have one entry per row: `{"ids": ["a.wav", ...]}`, a dataclass's `names: list[str]`."""
    items = children(tree)
    if items is None:
        return []
    if _is_sequence(tree) and len(tree) == size and not _holds_tensor(tree):
        return [path]
    return [p for suffix, value in items for p in per_sample_paths(value, size, path + suffix)]


def _is_sequence(tree: Any) -> bool:
    return isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields")


def _holds_tensor(tree: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in iter_leaves(tree))


def select_rows(batch: Any, layout: BatchLayout, rows: list[int]) -> Any:
    """The batch restricted to `rows`, keeping its structure and each leaf's batch dimension;
    per-sample lists of non-tensors (ids, file names) are sliced with the rows."""
    def walk(tree: Any, path: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            dim = layout.dims.get(path)
            if dim is None:
                return tree
            return tree.index_select(dim, torch.tensor(rows, dtype=torch.long,
                                                       device=tree.device))
        if path in layout.per_sample:
            return rebuild(tree, [tree[r] for r in rows])
        items = children(tree)
        if items is None:
            return tree
        return rebuild(tree, [walk(value, path + suffix) for suffix, value in items])
    return walk(batch, "")


def row_values(batch: Any, layout: BatchLayout, row: int) -> list[tuple[str, Any]]:
    """The entries of the per-sample non-tensor leaves for one row: [(path, value)]."""
    found = []

    def walk(tree: Any, path: Any) -> None:
        if path in layout.per_sample:
            if row < len(tree):
                found.append((path, tree[row]))
            return
        for suffix, value in children(tree) or []:
            walk(value, path + suffix)
    walk(batch, "")
    return found


def nonfinite_rows(t: torch.Tensor, dim: int | None) -> list[int]:
    """Rows along `dim` holding a non-finite element (all of dim 0 when dim is None)."""
    bad = ~torch.isfinite(t)
    if dim is None or t.dim() == 0:
        return [0] if bool(bad.any()) else []
    bad = bad.movedim(dim, 0).reshape(t.shape[dim], -1).any(dim=1)
    return bad.nonzero().flatten().tolist()


def batch_fingerprint(batch: Any) -> list:
    """What identifies a batch's content: each tensor leaf's path, shape, the float64 sum of
    its finite values and its counts of NaN, +inf and -inf (syncs; only for batches that
    tripped). Two reads of the data are the same batch when their fingerprints are equal."""
    from nanaudit.run.checks import dense_values
    found = []
    for path, t in tensor_leaves(batch):
        values = dense_values(t).detach().double()
        counts = torch.stack([values.isnan().sum(), (values == float("inf")).sum(),
                              (values == float("-inf")).sum()]).tolist()
        found.append((path, tuple(t.shape),
                      float(values.nan_to_num(0.0, 0.0, 0.0).sum()), *counts))
    return found


def same_batch(a: Any, b: Any) -> bool:
    """Are two batches the same, value for value (NaN where NaN is)? Tensor leaves exactly;
    other leaves (ids, file names) by equality."""
    left, right = list(iter_leaves(a)), list(iter_leaves(b))
    return [p for p, _ in left] == [p for p, _ in right] and \
        all(_same_leaf(x, y) for (_, x), (_, y) in zip(left, right))


def _same_leaf(x: Any, y: Any) -> bool:
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        try:
            return type(x) is type(y) and bool(x == y)
        except (TypeError, ValueError, RuntimeError):
            return False
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    from nanaudit.run.checks import dense_values
    x, y = dense_values(x).detach().cpu(), dense_values(y).detach().cpu()
    if not (x.is_floating_point() or x.is_complex()):
        return torch.equal(x, y)
    return bool(((x == y) | (x.isnan() & y.isnan())).all())


# The names of the batch leaves that carry the data set's own ids of its rows.
SAMPLE_ID_KEYS = ("id", "ids", "index", "indices", "sample_id", "sample_ids")


def sample_ids(batch: Any, rows: list[int] | None) -> list[int] | None:
    """The data set's own ids for these rows, when the batch carries an id leaf."""
    if not rows:
        return None
    for path, t in tensor_leaves(batch):
        key = path.strip('[]"').lower()
        if key in SAMPLE_ID_KEYS and t.dim() == 1 and not t.is_floating_point():
            return [int(t[r]) for r in rows if r < t.shape[0]]
    return None


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
        mapping_class: Any = type(tree)   # a concrete Mapping; its constructor may differ
        try:
            return mapping_class(pairs)
        except Exception:
            return pairs
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):   # as `children`
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


def to_device(tree: Any, device: Any) -> Any:
    return move(tree, device, [])


def move(tree: Any, device: Any, leaves: list) -> Any:
    """The batch on `device`, collecting its floating-point tensors in `leaves` in the same
    walk (the step's batch check reads them). A leaf object with its own `.to(device)` (a
    custom batch class) is moved by it. non_blocking lets host-to-device copies overlap with
    compute on CUDA; it is a no-op on CPU."""
    if isinstance(tree, torch.Tensor):
        if tree.is_meta:
            raise UserCodeError("the data", ValueError(
                f"a batch holds a meta tensor (shape {list(tree.shape)}, dtype "
                f"{str(tree.dtype).removeprefix('torch.')}): it has a shape but no values, "
                f"so it cannot be trained on or checked; load the real data"))
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


def container_kind(tree: Any) -> str:
    """mapping, dataclass, namedtuple, list or tuple: how a container's plain form is rebuilt."""
    if isinstance(tree, Mapping):
        return "mapping"
    if dataclasses.is_dataclass(tree):
        return "dataclass"
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return "namedtuple"
    return "list" if isinstance(tree, list) else "tuple"


def batch_structure(tree: Any) -> dict | None:
    """What `to_plain` forgets, for a replay to rebuild the user's batch types: per container
    whose type is not a plain dict, list or tuple, its kind and import path (`type_path`), and
    the same for its children in `children`' order. None when the tree is plain throughout."""
    items = children(tree)
    if items is None:
        return None
    below = [batch_structure(value) for _, value in items]
    plain = type(tree) in (dict, list, tuple)
    if plain and not any(below):
        return None
    node: dict = {"kind": container_kind(tree)}
    if not plain:
        node.update(type_path(type(tree)))
    if any(below):
        node["children"] = below
    return node


def type_path(cls: type) -> dict:
    """How a class can be imported again: {"type": "module:Qualname", "file": its module's
    file} (a module loaded from a file has a name only this process knows), or {"type": None,
    "why": ...} for a class no other process can import."""
    module, qualname = cls.__module__, cls.__qualname__
    name = f"{module}.{qualname}"
    if "<locals>" in qualname:
        return {"type": None, "name": name, "why": "it is defined inside a function"}
    if module == "__main__":
        return {"type": None, "name": name, "why": "it is defined in the script run as "
                                                   "__main__"}
    path = {"type": f"{module}:{qualname}", "name": name}
    source = getattr(sys.modules.get(module), "__file__", None)
    if source:
        path["file"] = source
    return path
