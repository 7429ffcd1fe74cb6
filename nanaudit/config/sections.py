"""Parse each key and section of a config into its schema class: entrypoints, the optimizer
and scheduler builders, the run's numbers and paths, and the option sections (`localize:`,
`amp:`, `watch:`, `distributed:`). Each parser appends its problems and returns a usable
default, so the rest of the file is still checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nanaudit.config import values
from nanaudit.config.schema import (
    AMP_KEYS,
    BACKENDS,
    COMPILE_KEYS,
    COMPILE_MODES,
    DISTRIBUTED_KEYS,
    ENTRYPOINT_KEYS,
    FSDP_PARAM_DTYPES,
    LOCALIZE_KEYS,
    MESH_DIMS,
    WATCH_KEYS,
    AmpOptions,
    BuilderSpec,
    CompileOptions,
    DistributedOptions,
    Entrypoint,
    LocalizeOptions,
    WatchOptions,
)
from nanaudit.errors import Problem

Problems = values.Problems

_ENTRYPOINT_RE = re.compile(r"^[^:\s][^:]*:[A-Za-z_][A-Za-z0-9_.]*$")


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.manual_seed accepts


_EXAMPLE_CLASS = {"optimizer": "torch.optim.AdamW",
                  "scheduler": "torch.optim.lr_scheduler.OneCycleLR"}
# Keyword arguments that are always numbers, whatever the class.
_NUMERIC_KWARGS = ("lr", "eps", "weight_decay", "momentum", "max_lr", "gamma", "total_steps",
                   "step_size", "T_max", "eta_min", "warmup_steps")


def entrypoint(value: Any, key: str, problems: Problems) -> Entrypoint | None:
    """`module:attr`, or a mapping with `entrypoint` and `args`."""
    args: Mapping[str, Any] = {}
    if isinstance(value, dict):
        values.check_unknown(value, ENTRYPOINT_KEYS, f"{key}.", problems)
        args = value.get("args") or {}
        if not isinstance(args, dict):
            problems.append(Problem(f"{key}.args", f"expected a mapping of keyword arguments, "
                                    f"got {type(args).__name__}"))
            args = {}
        if "entrypoint" not in value:
            problems.append(Problem(f"{key}.entrypoint", "required key is missing"))
            return None
        value, key = value["entrypoint"], f"{key}.entrypoint"
    if not isinstance(value, str):
        problems.append(Problem(key, f"expected an entrypoint string `module:attr`, "
                                f"got {type(value).__name__} {value!r}"))
        return None
    if not _ENTRYPOINT_RE.match(value.strip()):
        problems.append(Problem(key, f"`{value}` is not an entrypoint: write `module.path:attr` "
                                f"or `relative/file.py:attr`"))
        return None
    return Entrypoint(target=value.strip(), key=key, args=args)


def builder(value: Any, key: str, spec_type: type[BuilderSpec],
            problems: Problems) -> BuilderSpec | None:
    """An optimizer or scheduler: a class path with keyword arguments, or an entrypoint."""
    if value is None:
        return None
    if isinstance(value, str) or (isinstance(value, dict) and "entrypoint" in value):
        factory = entrypoint(value, key, problems)
        return spec_type(key=key, factory=factory) if factory else None
    if not isinstance(value, dict):
        problems.append(Problem(key, "expected a mapping with `class` (and its keyword "
                                "arguments) or an entrypoint string"))
        return None
    class_path = value.get("class")
    if not isinstance(class_path, str) or "." not in class_path:
        problems.append(Problem(f"{key}.class", f"expected a class path such as "
                                f"`{_EXAMPLE_CLASS[key]}`, got {class_path!r}"))
        return None
    kwargs = {k: v for k, v in value.items() if k != "class"}
    for name, arg in kwargs.items():
        if name in _NUMERIC_KWARGS and not values.is_number(arg):
            problems.append(Problem(f"{key}.{name}", f"expected a "
                                    f"{values.finite_word(arg)}number, got {arg!r}"))
        elif values.has_nonfinite(arg):
            problems.append(Problem(f"{key}.{name}", f"holds a non-finite number: {arg!r}"))
    return spec_type(key=key, class_path=class_path, kwargs=kwargs)


def accumulate(value: Any, problems: Problems) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        problems.append(Problem("accumulate", f"expected the number of micro-batches per "
                                f"optimizer step, an integer from 1 to 65536, got {value!r}"))
        return 1
    return value


def seed(value: Any, problems: Problems) -> int | None:
    number = values.integer(value, "seed", problems, limit=None)
    if number is not None and not SEED_RANGE[0] <= number <= SEED_RANGE[1]:
        problems.append(Problem("seed", f"expected an integer from -2**63 to 2**64-1 (what "
                                f"torch.manual_seed accepts), got {number}"))
        return None
    return number


def checkpoint(value: Any, config_path: Path, problems: Problems) -> Path | None:
    """A file path, relative to the config's folder."""
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append(Problem("checkpoint", f"expected a file path, got {value!r}"))
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else (config_path.parent / path)


def device(value: Any, problems: Problems) -> str:
    if not isinstance(value, str) or not _DEVICE_RE.match(value):
        problems.append(Problem("device", f"expected auto, cpu, cuda or cuda:N, got {value!r}"))
        return "auto"
    return value


def batch_dim(value: Any, problems: Problems) -> dict[str, int]:
    """`batch_dim: 1` for every leaf, or `{"[0]": 1, "['mask']": 0}` per batch path."""
    if value is None:
        return {}

    def is_dim(v: Any) -> bool:   # a tensor has at most 64 dimensions
        return isinstance(v, int) and not isinstance(v, bool) and -64 <= v < 64
    if is_dim(value):
        return {"*": value}
    if isinstance(value, dict) and all(is_dim(v) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    problems.append(Problem("batch_dim", "expected a dimension (an integer from -64 to 63), or "
                            "a mapping from batch path (such as `[0]` or `[\"audio\"]`) to one"))
    return {}


def localize(value: Any, problems: Problems) -> LocalizeOptions:
    if value is None:
        return LocalizeOptions()
    if not isinstance(value, dict):
        problems.append(Problem("localize", f"expected a mapping, got {value!r}"))
        return LocalizeOptions()
    values.check_unknown(value, LOCALIZE_KEYS, "localize.", problems)
    samples = value.get("samples", True)
    if not isinstance(samples, bool):
        problems.append(Problem("localize.samples", f"expected true or false, got {samples!r}"))
        samples = True
    max_replays = values.positive_int(value.get("max_replays", 64), "localize.max_replays",
                                      problems)
    return LocalizeOptions(samples=samples, max_replays=max_replays or 64)


def amp(value: Any, problems: Problems) -> AmpOptions:
    raw = values.mapping(value, "amp", AMP_KEYS, problems)
    d = AmpOptions()

    def number(name: str, integral: bool = False) -> Any:
        return values.positive_field(raw, "amp", name, d, problems, integral)
    return AmpOptions(
        grad_scaler=values.boolean(raw.get("grad_scaler"), "amp.grad_scaler", problems),
        init_scale=number("init_scale"), growth_interval=number("growth_interval", True),
        scale_floor=number("scale_floor"), max_skipped=number("max_skipped", True))


def watch(value: Any, problems: Problems) -> WatchOptions:
    raw = values.mapping(value, "watch", WATCH_KEYS, problems)
    d = WatchOptions()
    activations = raw.get("activations", d.activations)
    if activations != "auto":
        activations = values.every(activations, "watch.activations", problems, 0)
    near = values.positive_field(raw, "watch", "near_overflow", d, problems)
    if near > 1:
        problems.append(Problem("watch.near_overflow", f"expected a fraction of the dtype's "
                                f"largest value in (0, 1], got {near}"))

    def threshold(name: str) -> Any:
        default = getattr(d, name)
        return values.threshold(raw.get(name, default), f"watch.{name}", problems, default)
    return WatchOptions(
        activations=activations, near_overflow=min(near, 1.0),
        loss_spike=threshold("loss_spike"),
        spike_window=values.positive_field(raw, "watch", "spike_window", d, problems, True),
        grad_growth=threshold("grad_growth"),
        growth_steps=values.positive_field(raw, "watch", "growth_steps", d, problems, True),
        update_ratio=threshold("update_ratio"),
        update_every=values.every(raw.get("update_every", d.update_every),
                                  "watch.update_every", problems, d.update_every))


def distributed(value: Any, problems: Problems) -> DistributedOptions:
    raw = values.mapping(value, "distributed", DISTRIBUTED_KEYS, problems)
    d = DistributedOptions()
    ddp = values.boolean(raw.get("ddp", d.ddp), "distributed.ddp", problems)
    unused = values.boolean(raw.get("find_unused_parameters", d.find_unused_parameters),
                            "distributed.find_unused_parameters", problems)
    return DistributedOptions(
        backend=values.choice(raw.get("backend", d.backend), "distributed.backend", BACKENDS,
                              problems),
        ddp=d.ddp if ddp is None else ddp,
        timeout_s=values.positive_field(raw, "distributed", "timeout_s", d, problems),
        find_unused_parameters=bool(unused),
        fsdp=bool(values.boolean(raw.get("fsdp", d.fsdp), "distributed.fsdp", problems)),
        fsdp_param_dtype=values.choice(raw.get("fsdp_param_dtype", d.fsdp_param_dtype),
                                       "distributed.fsdp_param_dtype", FSDP_PARAM_DTYPES,
                                       problems),
        mesh=mesh_dims(raw.get("mesh"), problems),
        **tensor_parallel(raw, problems))


def tensor_parallel(raw: Mapping[str, Any], problems: Problems) -> dict[str, Any]:
    """`distributed.tp: 2` with `distributed.parallelize: module:fn`: the user's plan
    (torchtitan's `parallelize_module` with ColwiseParallel / RowwiseParallel, which no config key
    could name for every model) is applied on the TP sub-mesh before FSDP2 shards the rest."""
    tp = values.positive_int(raw.get("tp", 1), "distributed.tp", problems) or 1
    plan = raw.get("parallelize")
    if plan is not None and (not isinstance(plan, str) or ":" not in plan):
        problems.append(Problem("distributed.parallelize", "expected `module.path:function` or "
                                f"`file.py:function`, got {plan!r}"))
        plan = None
    if tp > 1 and plan is None and "parallelize" not in raw:
        problems.append(Problem("distributed.parallelize", f"distributed.tp is {tp}: name the "
                                "tensor-parallel plan, a function `fn(model, tp_mesh)` that "
                                "calls parallelize_module"))
    return {"tp": tp, "parallelize": plan}


def mesh_world_problems(dims: Mapping[str, int] | None, tp: int,
                        world_size: int) -> list[Problem]:
    """The mesh (`distributed.mesh` x `distributed.tp`) covers the ranks torchrun started;
    the problem names the key that made the product (tp when set, else the mesh)."""
    sizes = {**(dims or {}), **({"tp": tp} if tp > 1 else {})}
    ranks = math.prod(sizes.values())
    key = "distributed.tp" if tp > 1 else "distributed.mesh"
    if dims and ranks != world_size:
        named = " x ".join(f"{name} {size}" for name, size in sizes.items())
        return [Problem(key, f"{named} is {ranks} ranks, but torchrun started {world_size}")]
    if not dims and world_size % tp:
        return [Problem(key, f"tp {tp} does not divide the {world_size} ranks torchrun "
                        "started (the data-parallel ranks are world size / tp)")]
    return []


def mesh_dims(value: Any, problems: Problems) -> dict | None:
    """`distributed.mesh: {dp_replicate: 2, dp_shard: 2}`: HSDP's mesh, both sizes positive
    integers, in MESH_DIMS order (absent: FSDP2 over one dimension)."""
    if value is None:
        return None
    raw = values.mapping(value, "distributed.mesh", MESH_DIMS, problems)
    sizes = {name: values.positive_int(raw[name], f"distributed.mesh.{name}", problems)
             for name in MESH_DIMS if name in raw}
    if isinstance(value, dict) and set(raw) != set(MESH_DIMS):
        missing = ", ".join(name for name in MESH_DIMS if name not in raw)
        problems.append(Problem("distributed.mesh", f"expected both {' and '.join(MESH_DIMS)}; "
                                f"missing {missing}"))
    if len(sizes) != len(MESH_DIMS) or None in sizes.values():
        return None
    return sizes


def compile_options(value: Any, problems: Problems) -> CompileOptions | None:
    """`compile: true`, or `compile: {backend: inductor, mode: max-autotune}`; false or absent:
    the model runs as its factory built it."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if not isinstance(value, dict):
        problems.append(Problem("compile", f"expected true, false or a mapping of torch.compile "
                                f"arguments ({', '.join(COMPILE_KEYS)}), got {value!r}"))
        return None
    values.check_unknown(value, COMPILE_KEYS, "compile.", problems)
    d = CompileOptions()
    backend = value.get("backend", d.backend)
    if not isinstance(backend, str) or not backend:
        problems.append(Problem("compile.backend", f"expected a backend name (inductor, "
                                f"aot_eager, ...), got {backend!r}"))
        backend = d.backend
    mode = value.get("mode", d.mode)
    if mode is not None:
        mode = values.choice(mode, "compile.mode", COMPILE_MODES, problems)
    fullgraph = values.boolean(value.get("fullgraph", d.fullgraph), "compile.fullgraph",
                               problems)
    dynamic = values.boolean(value.get("dynamic"), "compile.dynamic", problems)
    return CompileOptions(backend=backend, mode=mode, fullgraph=bool(fullgraph),
                          dynamic=dynamic)
