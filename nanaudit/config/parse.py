"""Read and parse the YAML config into the schema's frozen dataclasses.

Every problem is collected with its key path (`optimizer.lr: expected a number, got 'fast'`)
and raised together as one ConfigError, so a user fixes the whole file in one pass.
Nothing here imports torch or the user's code: entrypoints are only parsed, not resolved.

Hostile input is bounded before it is built: a file over MAX_CONFIG_BYTES, or YAML whose
aliases expand past MAX_YAML_NODES (a "billion laughs" bomb) or refer to themselves, is a
config error, because every report and repro bundle later copies the config's values out.
Numbers must be finite: `.nan` and `.inf` are YAML floats, never a sensible setting.
Command-line overrides replace their keys before parsing, so they are validated the same way.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from nanaudit.config.schema import (
    AMP_KEYS,
    BACKENDS,
    DISTRIBUTED_KEYS,
    ENTRYPOINT_KEYS,
    FAIL_ON,
    LOCALIZE_KEYS,
    PRECISIONS,
    SCHEMA_VERSION,
    SENTINEL_READS,
    TOP_LEVEL_KEYS,
    WATCH_KEYS,
    AmpOptions,
    Config,
    DistributedOptions,
    Entrypoint,
    LocalizeOptions,
    OptimizerSpec,
    SchedulerSpec,
    WatchOptions,
)
from nanaudit.errors import ConfigError, Problem

_ENTRYPOINT_RE = re.compile(r"^[^:\s][^:]*:[A-Za-z_][A-Za-z0-9_.]*$")


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


MAX_CONFIG_BYTES = 1 << 20        # a config is a page of keys, never a data set


MAX_YAML_NODES = 100_000          # nodes after expanding aliases


SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.manual_seed accepts


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, parse and validate a config file; raise ConfigError listing every problem.

    `overrides` (command-line options such as --device) replace top-level keys before the
    validation, so they are checked exactly like the key; a problem names the option."""
    path = Path(path)
    raw = read_yaml(path)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        return parse_config({**raw, **given}, path)
    except ConfigError as exc:
        if not given:
            raise
        problems = [Problem(f"--{p.key.replace('_', '-')} (overrides `{p.key}`)", p.message)
                    if p.key in given else p for p in exc.problems]
        raise ConfigError(problems, source=exc.source) from None


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a folder, not a file: {path}")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"the file is {size} bytes; a config is at most "
                              f"{MAX_CONFIG_BYTES} bytes (put data in the data factory)",
                              source=str(path))
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        _check_expansion(yaml.compose(text, Loader=yaml.SafeLoader))
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(exc), source=str(path)) from None
    except _YamlTooLarge as exc:
        raise ConfigError(str(exc), source=str(path)) from None
    except RecursionError:
        raise ConfigError("the YAML nests too deeply (thousands of levels of [ or {); a config "
                          "is a page of keys", source=str(path)) from None
    if raw is None:
        raise ConfigError("the file is empty: it needs at least `model`, `data` and `loss`",
                          source=str(path))
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a mapping of keys, got {type(raw).__name__}",
                          source=str(path))
    return raw


class _YamlTooLarge(Exception):
    pass


def _check_expansion(root) -> None:
    """Count the nodes the document expands to (aliases counted at every use), memoised per
    node so a bomb is measured in the time of its short text, and refuse cycles."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _YamlTooLarge("a YAML alias refers to the node that contains it (a "
                                "recursive structure); write the values out")
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        open_nodes.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise _YamlTooLarge(f"the YAML expands to more than {MAX_YAML_NODES} values through "
                                f"its aliases (&anchor / *alias); a config this large is refused")
        return total
    if root is not None:
        size(root)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"YAML syntax error: {what}"
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {what}"


def parse_config(raw: Mapping[str, Any], path: Path) -> Config:
    problems: list[Problem] = []
    _check_unknown(raw, TOP_LEVEL_KEYS, "", problems)
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        problems.append(Problem("schema_version", f"this nanaudit reads schema version "
                                f"{SCHEMA_VERSION}, the file says {version!r}"))
    entries = {}
    own_step = raw.get("step") is not None
    if own_step and raw.get("loss") is not None:
        problems.append(Problem("step", "`step:` runs the user's whole step (forward, loss, "
                                "backward, update): give either `step:` or `loss:`, not both"))
    for key in ("model", "data", "loss"):
        if key == "loss" and own_step:
            entries[key] = None
        elif key not in raw:
            problems.append(Problem(key, "required key is missing (an entrypoint such as "
                                    "`mypkg.models:build_model` or `model.py:build_model`)"))
        else:
            entries[key] = _entrypoint(raw[key], key, problems)
    values = dict(
        optimizer=_builder(raw.get("optimizer"), "optimizer", OptimizerSpec, problems),
        scheduler=_builder(raw.get("scheduler"), "scheduler", SchedulerSpec, problems),
        accumulate=_accumulate(raw.get("accumulate", 1), problems),
        step=_entrypoint(raw["step"], "step", problems) if own_step else None,
        steps=_positive_int(raw.get("steps"), "steps", problems),
        seed=_seed(raw.get("seed"), problems),
        checkpoint=_checkpoint(raw.get("checkpoint"), path, problems),
        device=_device(raw.get("device", "auto"), problems),
        grad_clip=_positive_float(raw.get("grad_clip"), "grad_clip", problems),
        batch_dim=_batch_dim(raw.get("batch_dim"), problems),
        localize=_localize(raw.get("localize"), problems),
        precision=_choice(raw.get("precision", "fp32"), "precision", PRECISIONS, problems),
        amp=_amp(raw.get("amp"), problems),
        watch=_watch(raw.get("watch"), problems),
        fail_on=_choice(raw.get("fail_on", "nonfinite"), "fail_on", FAIL_ON, problems),
        distributed=_distributed(raw.get("distributed"), problems),
        sentinel_read=_choice(raw.get("sentinel_read", "auto"), "sentinel_read",
                              SENTINEL_READS, problems),
    )
    if own_step and raw.get("optimizer") is None:
        problems.append(Problem("optimizer", "`step:` needs `optimizer:`: nanaudit builds the "
                                "optimizers, passes them to your step (a factory may return a "
                                "list or a dict of them) and checks each one before its update"))
    if raw.get("scheduler") is not None and raw.get("optimizer") is None:
        problems.append(Problem("scheduler", "a scheduler needs an `optimizer:` to schedule"))
    if own_step and values["grad_clip"] is not None:
        problems.append(Problem("grad_clip", "with `step:` your step makes the update: clip "
                                "there (torch.nn.utils.clip_grad_norm_ before "
                                "optimizer.step()); remove `grad_clip`"))
    if own_step and values["accumulate"] > 1:
        problems.append(Problem("accumulate", "with `step:` the user's step accumulates itself "
                                "(nanaudit checks each optimizer step it makes); remove "
                                "`accumulate`"))
    if raw.get("amp") is not None and values["precision"] == "fp32":
        problems.append(Problem("amp", "only used with `precision: fp16` or `bf16`; this run "
                                "is fp32"))
    if problems:
        raise ConfigError(problems, source=str(path))
    return Config(path=path.resolve(), **entries, **values)


def _check_unknown(mapping: Mapping, known, prefix: str, problems: list[Problem]) -> None:
    for key in mapping:
        if key in known:
            continue
        where = f"{prefix}{key}"
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else f"; known keys: {', '.join(known)}"
        problems.append(Problem(where, f"unknown key{hint}"))


def _entrypoint(value: Any, key: str, problems: list[Problem]) -> Entrypoint | None:
    args: Mapping[str, Any] = {}
    if isinstance(value, dict):
        _check_unknown(value, ENTRYPOINT_KEYS, f"{key}.", problems)
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


_EXAMPLE_CLASS = {"optimizer": "torch.optim.AdamW",
                  "scheduler": "torch.optim.lr_scheduler.OneCycleLR"}
# Keyword arguments that are always numbers, whatever the class.
_NUMERIC_KWARGS = ("lr", "eps", "weight_decay", "momentum", "max_lr", "gamma", "total_steps",
                   "step_size", "T_max", "eta_min", "warmup_steps")


def _builder(value: Any, key: str, spec_type, problems: list[Problem]):
    """An optimizer or scheduler: a class path with keyword arguments, or an entrypoint."""
    if value is None:
        return None
    if isinstance(value, str) or (isinstance(value, dict) and "entrypoint" in value):
        factory = _entrypoint(value, key, problems)
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
        if name in _NUMERIC_KWARGS and not _is_number(arg):
            problems.append(Problem(f"{key}.{name}", f"expected a {_finite_word(arg)}number, "
                                    f"got {arg!r}"))
        elif _has_nonfinite(arg):
            problems.append(Problem(f"{key}.{name}", f"holds a non-finite number: {arg!r}"))
    return spec_type(key=key, class_path=class_path, kwargs=kwargs)


def _accumulate(value: Any, problems: list[Problem]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        problems.append(Problem("accumulate", f"expected the number of micro-batches per "
                                f"optimizer step, an integer from 1 to 65536, got {value!r}"))
        return 1
    return value


def _is_number(value: Any) -> bool:
    """A finite int or float (YAML's `.nan` and `.inf` are floats, but never a setting)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _finite_word(value: Any) -> str:
    """'finite ' when the value is a number that is NaN or infinite, for the message."""
    return "finite " if isinstance(value, float) and not math.isfinite(value) else ""


def _has_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_has_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nonfinite(v) for v in value.values())
    return False


def _seed(value: Any, problems: list[Problem]) -> int | None:
    seed = _int(value, "seed", problems, limit=None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        problems.append(Problem("seed", f"expected an integer from -2**63 to 2**64-1 (what "
                                f"torch.manual_seed accepts), got {seed}"))
        return None
    return seed


def _int(value: Any, key: str, problems: list[Problem], limit: int | None = 2**63 - 1):
    """An integer; within +-limit, the largest count or interval torch and Python's
    containers take (a larger one fails deep inside them, not here)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        problems.append(Problem(key, f"expected an integer, got {value!r}"))
        return None
    if limit is not None and abs(value) > limit:
        problems.append(Problem(key, f"expected an integer below 2**63, got {value}"))
        return None
    return value


def _positive_int(value: Any, key: str, problems: list[Problem]) -> int | None:
    number = _int(value, key, problems)
    if number is not None and number < 1:
        problems.append(Problem(key, f"expected a positive integer, got {number}"))
        return None
    return number


def _positive_float(value: Any, key: str, problems: list[Problem]) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or value <= 0:
        problems.append(Problem(key, f"expected a positive {_finite_word(value)}number, "
                                f"got {value!r}"))
        return None
    return float(value)


def _checkpoint(value: Any, config_path: Path, problems: list[Problem]) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append(Problem("checkpoint", f"expected a file path, got {value!r}"))
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else (config_path.parent / path)


def _device(value: Any, problems: list[Problem]) -> str:
    if not isinstance(value, str) or not _DEVICE_RE.match(value):
        problems.append(Problem("device", f"expected auto, cpu, cuda or cuda:N, got {value!r}"))
        return "auto"
    return value


def _batch_dim(value: Any, problems: list[Problem]) -> dict[str, int]:
    """`batch_dim: 1` for every leaf, or `{"[0]": 1, "['mask']": 0}` per batch path."""
    if value is None:
        return {}
    def is_dim(v):   # a tensor has at most 64 dimensions
        return isinstance(v, int) and not isinstance(v, bool) and -64 <= v < 64
    if is_dim(value):
        return {"*": value}
    if isinstance(value, dict) and all(is_dim(v) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    problems.append(Problem("batch_dim", "expected a dimension (an integer from -64 to 63), or "
                            "a mapping from batch path (such as `[0]` or `[\"audio\"]`) to one"))
    return {}


def _localize(value: Any, problems: list[Problem]) -> LocalizeOptions:
    if value is None:
        return LocalizeOptions()
    if not isinstance(value, dict):
        problems.append(Problem("localize", f"expected a mapping, got {value!r}"))
        return LocalizeOptions()
    _check_unknown(value, LOCALIZE_KEYS, "localize.", problems)
    samples = value.get("samples", True)
    if not isinstance(samples, bool):
        problems.append(Problem("localize.samples", f"expected true or false, got {samples!r}"))
        samples = True
    max_replays = _positive_int(value.get("max_replays", 64), "localize.max_replays", problems)
    return LocalizeOptions(samples=samples, max_replays=max_replays or 64)


def _choice(value: Any, key: str, choices, problems: list[Problem]) -> str:
    if value not in choices:
        problems.append(Problem(key, f"expected one of {', '.join(choices)}, got {value!r}"))
        return choices[0]
    return value


def _section(value: Any, key: str, known, problems: list[Problem]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(Problem(key, f"expected a mapping, got {value!r}"))
        return {}
    _check_unknown(value, known, f"{key}.", problems)
    return {k: v for k, v in value.items() if k in known}


def _bool(value: Any, key: str, problems: list[Problem]) -> bool | None:
    if value is not None and not isinstance(value, bool):
        problems.append(Problem(key, f"expected true or false, got {value!r}"))
        return None
    return value


def _positive(raw: Mapping, section: str, name: str, defaults, problems: list[Problem],
              integer: bool = False):
    """raw[name] as a positive number (the section's default when absent or wrong)."""
    default = getattr(defaults, name)
    parse = _positive_int if integer else _positive_float
    value = parse(raw.get(name, default), f"{section}.{name}", problems)
    return default if value is None else value


def _amp(value: Any, problems: list[Problem]) -> AmpOptions:
    raw = _section(value, "amp", AMP_KEYS, problems)
    d = AmpOptions()
    return AmpOptions(
        grad_scaler=_bool(raw.get("grad_scaler"), "amp.grad_scaler", problems),
        init_scale=_positive(raw, "amp", "init_scale", d, problems),
        growth_interval=_positive(raw, "amp", "growth_interval", d, problems, integer=True),
        scale_floor=_positive(raw, "amp", "scale_floor", d, problems),
        max_skipped=_positive(raw, "amp", "max_skipped", d, problems, integer=True))


def _threshold(value: Any, key: str, problems: list[Problem], default):
    """A positive number, or false to turn the detector off."""
    if value is False:
        return False
    if value is True:
        return default
    return _positive_float(value, key, problems) or default


def _every(value: Any, key: str, problems: list[Problem], default):
    """Every N steps: an integer >= 0 (0 or false: off; true: every step)."""
    if value is False:
        return 0
    if value is True:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        problems.append(Problem(key, f"expected a step interval (0 for off), got {value!r}"))
        return default
    return value


def _watch(value: Any, problems: list[Problem]) -> WatchOptions:
    raw = _section(value, "watch", WATCH_KEYS, problems)
    d = WatchOptions()
    activations = raw.get("activations", d.activations)
    if activations != "auto":
        activations = _every(activations, "watch.activations", problems, 0)
    near = _positive(raw, "watch", "near_overflow", d, problems)
    if near > 1:
        problems.append(Problem("watch.near_overflow", f"expected a fraction of the dtype's "
                                f"largest value in (0, 1], got {near}"))
    return WatchOptions(
        activations=activations, near_overflow=min(near, 1.0),
        loss_spike=_threshold(raw.get("loss_spike", d.loss_spike), "watch.loss_spike",
                              problems, d.loss_spike),
        spike_window=_positive(raw, "watch", "spike_window", d, problems, integer=True),
        grad_growth=_threshold(raw.get("grad_growth", d.grad_growth), "watch.grad_growth",
                               problems, d.grad_growth),
        growth_steps=_positive(raw, "watch", "growth_steps", d, problems, integer=True),
        update_ratio=_threshold(raw.get("update_ratio", d.update_ratio), "watch.update_ratio",
                                problems, d.update_ratio),
        update_every=_every(raw.get("update_every", d.update_every), "watch.update_every",
                            problems, d.update_every))


def _distributed(value: Any, problems: list[Problem]) -> DistributedOptions:
    raw = _section(value, "distributed", DISTRIBUTED_KEYS, problems)
    d = DistributedOptions()
    ddp = _bool(raw.get("ddp", d.ddp), "distributed.ddp", problems)
    unused = _bool(raw.get("find_unused_parameters", d.find_unused_parameters),
                   "distributed.find_unused_parameters", problems)
    return DistributedOptions(
        backend=_choice(raw.get("backend", d.backend), "distributed.backend", BACKENDS, problems),
        ddp=d.ddp if ddp is None else ddp,
        timeout_s=_positive(raw, "distributed", "timeout_s", d, problems),
        find_unused_parameters=bool(unused))
