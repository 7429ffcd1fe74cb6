"""Turn a config file into the schema's frozen `Config`: every problem is collected with its
key path (`optimizer.lr: expected a number, got 'fast'`) and raised together as one
ConfigError, so a user fixes the whole file in one pass.

Nothing here imports torch or the user's code: entrypoints are only parsed, not resolved
(validate.py resolves them). Command-line overrides replace their keys before parsing, so they
are validated the same way, and a problem names the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanaudit.config import sections, values
from nanaudit.config.reader import read_yaml
from nanaudit.config.schema import (
    FAIL_ON,
    PRECISIONS,
    SCHEMA_VERSION,
    SENTINEL_READS,
    TOP_LEVEL_KEYS,
    Config,
    OptimizerSpec,
    SchedulerSpec,
    UserCode,
)
from nanaudit.errors import ConfigError, Problem

_CODE_KEYS = ("model", "data", "loss", "step", "optimizer", "scheduler")


@dataclass(frozen=True)
class Draft:
    """What parsing made of a file: every value it could read and every problem it found. A
    draft with problems still names the user's code that parsed, so its problems can be
    reported with the rest of the file's."""

    path: Path
    values: Mapping[str, Any]
    problems: list[Problem]

    def config(self) -> Config:
        """The Config, or one ConfigError listing every problem."""
        if self.problems:
            raise ConfigError(self.problems, source=str(self.path))
        return Config(path=self.path.resolve(), **self.values)

    def clean(self, key: str) -> bool:
        """Has the key (or a key under it) no problem of its own?"""
        return not any(p.key == key or p.key.startswith(f"{key}.") for p in self.problems)

    def user_code(self) -> UserCode:
        """The entrypoints and builders whose keys have no problem of their own."""
        code = {key: self.values.get(key) for key in _CODE_KEYS if self.clean(key)}
        return UserCode(self.path.resolve().parent, **code)


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, parse and validate a config file; raise ConfigError listing every problem.

    `overrides` (command-line options such as --device) replace top-level keys before the
    validation, so they are checked exactly like the key; a problem names the option."""
    return load_draft(path, overrides).config()


def load_draft(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Draft:
    """The file's draft with `overrides` applied (see load_config); a file that cannot be read
    as a mapping raises ConfigError at once."""
    path = Path(path)
    raw = read_yaml(path)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    draft = draft_config({**raw, **given}, path)
    problems = [Problem(f"--{p.key.replace('_', '-')} (overrides `{p.key}`)", p.message)
                if p.key in given else p for p in draft.problems]
    return Draft(draft.path, draft.values, problems)


def parse_config(raw: Mapping[str, Any], path: Path) -> Config:
    return draft_config(raw, path).config()


def draft_config(raw: Mapping[str, Any], path: Path) -> Draft:
    problems: list[Problem] = []
    values.check_unknown(raw, TOP_LEVEL_KEYS, "", problems)
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        problems.append(Problem("schema_version", f"this nanaudit reads schema version "
                                f"{SCHEMA_VERSION}, the file says {version!r}"))
    own_step = raw.get("step") is not None
    if own_step and raw.get("loss") is not None:
        problems.append(Problem("step", "`step:` runs the user's whole step (forward, loss, "
                                "backward, update): give either `step:` or `loss:`, not both"))
    parsed: dict[str, Any] = {}
    for key in ("model", "data", "loss"):
        if key == "loss" and own_step:
            parsed[key] = None
        elif key not in raw:
            problems.append(Problem(key, "required key is missing (an entrypoint such as "
                                    "`mypkg.models:build_model` or `model.py:build_model`)"))
        else:
            parsed[key] = sections.entrypoint(raw[key], key, problems)
    parsed.update(_settings(raw, path, own_step, problems))
    problems += _conflicts(raw, parsed, own_step)
    return Draft(path, parsed, problems)


def _settings(raw: Mapping[str, Any], path: Path, own_step: bool,
              problems: list[Problem]) -> dict[str, Any]:
    """Every key but the model, data and loss, in the order their problems are listed."""
    def choice(key: str, default: str, choices: tuple[str, ...]) -> str:
        return values.choice(raw.get(key, default), key, choices, problems)
    return dict(
        optimizer=sections.builder(raw.get("optimizer"), "optimizer", OptimizerSpec, problems),
        scheduler=sections.builder(raw.get("scheduler"), "scheduler", SchedulerSpec, problems),
        accumulate=sections.accumulate(raw.get("accumulate", 1), problems),
        step=sections.entrypoint(raw["step"], "step", problems) if own_step else None,
        steps=values.positive_int(raw.get("steps"), "steps", problems),
        seed=sections.seed(raw.get("seed"), problems),
        checkpoint=sections.checkpoint(raw.get("checkpoint"), path, problems),
        device=sections.device(raw.get("device", "auto"), problems),
        grad_clip=values.positive_float(raw.get("grad_clip"), "grad_clip", problems),
        batch_dim=sections.batch_dim(raw.get("batch_dim"), problems),
        localize=sections.localize(raw.get("localize"), problems),
        precision=choice("precision", "fp32", PRECISIONS),
        amp=sections.amp(raw.get("amp"), problems),
        watch=sections.watch(raw.get("watch"), problems),
        fail_on=choice("fail_on", "nonfinite", FAIL_ON),
        distributed=sections.distributed(raw.get("distributed"), problems),
        sentinel_read=choice("sentinel_read", "auto", SENTINEL_READS),
        compile=sections.compile_options(raw.get("compile"), problems),
    )


def _conflicts(raw: Mapping[str, Any], parsed: Mapping[str, Any],
               own_step: bool) -> list[Problem]:
    """Keys that are each fine but do not go together."""
    problems = []
    if own_step and raw.get("optimizer") is None:
        problems.append(Problem("optimizer", "`step:` needs `optimizer:`: nanaudit builds the "
                                "optimizers, passes them to your step (a factory may return a "
                                "list or a dict of them) and checks each one before its update"))
    if raw.get("scheduler") is not None and raw.get("optimizer") is None:
        problems.append(Problem("scheduler", "a scheduler needs an `optimizer:` to schedule"))
    if own_step and parsed["grad_clip"] is not None:
        problems.append(Problem("grad_clip", "with `step:` your step makes the update: clip "
                                "there (torch.nn.utils.clip_grad_norm_ before "
                                "optimizer.step()); remove `grad_clip`"))
    if own_step and parsed["accumulate"] > 1:
        problems.append(Problem("accumulate", "with `step:` the user's step accumulates itself "
                                "(nanaudit checks each optimizer step it makes); remove "
                                "`accumulate`"))
    if raw.get("amp") is not None and parsed["precision"] == "fp32":
        problems.append(Problem("amp", "only used with `precision: fp16` or `bf16`; this run "
                                "is fp32"))
    return problems
