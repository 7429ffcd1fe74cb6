"""Batches as trees: tensors nested in tuples, lists and dicts, addressed by paths like `[0]["mask"]`."""

from __future__ import annotations

from typing import Any, Callable, Iterator


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
