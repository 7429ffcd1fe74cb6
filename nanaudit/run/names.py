"""The user's names for modules, parameters and buffers, without the wrappers' path components.

`torch.compile(model)` keeps the user's module as `_orig_mod` of an `OptimizedModule`, DDP as
`module`, FSDP as `_fsdp_wrapped_module`, `checkpoint_wrapper` as `_checkpoint_wrapped_module`:
PyTorch's own names then read `_orig_mod.encoder.fc.weight` where the user wrote
`encoder.fc.weight`. torch.distributed.checkpoint drops the same components when it maps a
state-dict key to its canonical name (`_get_fqns`), and, as there, a component is dropped only
where the module it names is held by a wrapper of that type: a user's own attribute called
`module` stays. Every name a report shows comes through here, once, where it enters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

# (the wrapper class's module, its name) -> the attribute holding the wrapped module. Matched
# by name along the class's MRO, so that no torch.distributed or dynamo import is needed to
# ask (both are heavy, and absent in some builds).
WRAPPERS: dict[tuple[str, str], str] = {
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"):
        "_fsdp_wrapped_module",
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"):
        "_checkpoint_wrapped_module",
}


def wrapped_attribute(module: Any) -> str | None:
    """The attribute in which `module`, a wrapper, holds the user's module; None otherwise."""
    for cls in type(module).__mro__:
        attribute = WRAPPERS.get((cls.__module__, cls.__name__))
        if attribute is not None:
            return attribute
    return None


def unwrapped(module: Any) -> Any:
    """The user's module inside any wrappers (`torch.compile`, DDP, FSDP, checkpointing)."""
    attribute = wrapped_attribute(module)
    while attribute is not None:
        inner = getattr(module, "_modules", {}).get(attribute)
        if inner is None:
            return module
        module, attribute = inner, wrapped_attribute(inner)
    return module


def without_data_parallel(module: Any) -> Any:
    """The module a DistributedDataParallel (or DataParallel) wrapper holds, else `module`
    itself: a model of the user's with its own child called `module` stays whole."""
    if wrapped_attribute(module) == "module":
        return getattr(module, "_modules", {}).get("module", module)
    return module


def user_path(root: Any, name: str) -> str:
    """`name`, a path under `root` as PyTorch spells it, without the wrappers' components."""
    if not name:
        return name
    kept, current = [], root
    for part in name.split("."):
        modules = getattr(current, "_modules", None)
        if modules is not None and wrapped_attribute(current) == part:
            current = modules.get(part)
            continue
        kept.append(part)
        current = modules.get(part) if modules is not None else None
    return ".".join(kept)


def user_named(root: Any, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(user's name, object) for PyTorch's (name, object) pairs under `root`:
    `user_named(model, model.named_parameters())`."""
    for name, obj in named:
        yield user_path(root, name), obj


def parameter_names(root: Any) -> dict[int, str]:
    """id(parameter) -> the user's qualified name, for every parameter under `root`."""
    return {id(p): n for n, p in user_named(root, root.named_parameters())}
