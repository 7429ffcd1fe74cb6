"""What an integration writes on a finding: the console, JSON, Markdown and HTML reports and
the step's repro bundle (weights, RNG state, batch, offending rows, repro.py), into one folder."""

from __future__ import annotations

import io
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nanaudit.report.model import Report
from nanaudit.report.output import write_atomic
from nanaudit.run.names import unwrapped

REPORT_FILES = {"json": "nanaudit.json", "markdown": "nanaudit.md", "html": "nanaudit.html",
                "console": "nanaudit.txt"}


def console_text(report: Report, color: bool = False, width: int = 100) -> str:
    """The console report, written beside the others (whose formats it does not suggest)."""
    from rich.console import Console

    from nanaudit.report.console import print_report
    buffer = io.StringIO()
    print_report(report, Console(file=buffer, width=width, force_terminal=color,
                                 color_system="standard" if color else None),
                 frozenset(REPORT_FILES) - {"console"})
    return buffer.getvalue()


def write_reports(report: Report, folder: str | Path, echo: bool = True) -> dict:
    """Write nanaudit.json, nanaudit.md, nanaudit.html and nanaudit.txt into `folder`; with
    `echo`, print the console report to stderr too. Returns {format: path}."""
    folder = Path(folder)
    from nanaudit.report.formats import renderer_for
    paths = {}
    for fmt, name in REPORT_FILES.items():
        text = console_text(report) if fmt == "console" else renderer_for(fmt).render(report)
        write_atomic(folder / name, text)
        paths[fmt] = str(folder / name)
    if echo:
        sys.stderr.write(console_text(report, color=sys.stderr.isatty()))
    return paths


def write_step_bundle(folder: str | Path, model: torch.nn.Module, optimizer: Any, trip: Any,
                      state: Any, finding: Any, report_json: str, meta: dict) -> Path:
    """The failing step as a repro bundle, written atomically: state.pt (model and optimizer
    state before the update), rng.pt, batch.pt, rows.pt (the offending rows), meta.json,
    report.json and repro.py. Everything loads with torch.load(weights_only=True).

    A training run has no config naming a model factory and a loss, so meta.json records what
    can honestly rebuild them without the training script (see `model_recipe`; `meta` brings
    the integration's loss: `loss` an importable function, or `loss_recipe`), and repro.py /
    `nanaudit replay` ask for `--model` / `--loss` where it cannot. The module itself is not
    pickled: the bundle stays loadable with weights_only=True."""
    from nanaudit.commands.bundle import BUNDLE_SCRIPT as _TEMPLATE
    from nanaudit.commands.bundle import bundle_folder, publish_bundle, save_step
    from nanaudit.run.batch import batch_structure
    # The same rules as `scan`'s bundles: never replace a folder nanaudit did not write.
    folder = bundle_folder(Path(folder), state.step)
    model = unwrapped(model)         # the user's module: its class, its state-dict keys
    recipe = model_recipe(model)
    structure = batch_structure(state.batch)
    targets = [recipe.get("class"), meta.get("loss"),
               (meta.get("loss_recipe") or {}).get("compute_loss_func")]
    roots = _roots(targets, structure)
    device = next((str(p.device) for p in model.parameters()), "cpu")

    def fill(tmp: Path) -> None:
        save_step(tmp, model, optimizer, state, finding)
        body = {"step": state.step, "check": trip.check, "scale": state.scale,
                "torch": torch.__version__, "device": device,
                "samples": list(finding.samples or []) if finding else [],
                "model_class": type(model).__name__, "model_recipe": recipe,
                "precision": "fp32", "import_roots": roots, "batch_structure": structure,
                **meta}
        (tmp / "meta.json").write_text(json.dumps(body, indent=2, default=str) + "\n",
                                       encoding="utf-8")
        (tmp / "report.json").write_text(report_json, encoding="utf-8")
        shutil.copyfile(_TEMPLATE, tmp / "repro.py")
    return publish_bundle(folder, fill)


def model_recipe(model: torch.nn.Module) -> dict:
    """How to build the model again without the training script, when that can be known:
    a Hugging Face model from its class and config (`cls(config_class.from_dict(...))`), a
    LightningModule from the hyperparameters `save_hyperparameters()` recorded, a module whose
    constructor takes no arguments. Otherwise `why` says what is unknown (the constructor's
    arguments), and repro.py / `nanaudit replay` need `--model module:factory`."""
    from nanaudit.run.batch import type_path
    where = type_path(type(model))
    recipe = {"name": where["name"]}
    if where["type"] is None:
        recipe["why"] = f"its class cannot be imported: {where['why']}"
        return recipe
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if getattr(type(model), "config_class", None) is not None and callable(to_dict):
        as_json = _json_or_none(to_dict())
        if as_json is not None:
            return {**recipe, "kind": "transformers", "class": where["type"], "config": as_json}
    hparams = getattr(model, "hparams", None)
    if isinstance(hparams, Mapping) and hparams:
        as_json = _json_or_none(dict(hparams))
        if as_json is None:
            recipe["why"] = "its saved hyperparameters are not plain JSON values"
            return recipe
        return {**recipe, "kind": "hparams", "class": where["type"], "hparams": as_json}
    required = _constructor_arguments(type(model))
    if required is None:
        recipe["why"] = "its constructor's signature cannot be read"
    elif required:
        hint = (" (call self.save_hyperparameters() in its __init__ to record them)"
                if hparams is not None else "")
        recipe["why"] = (f"its constructor takes arguments ({', '.join(required)}) the "
                         f"training run did not record{hint}")
    else:
        return {**recipe, "kind": "hparams", "class": where["type"], "hparams": {}}
    return recipe


def callable_target(fn: Any) -> tuple[str | None, str | None]:
    """(`module:qualname`, None) for a function another process can import, else (None, why)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname:
        return None, f"{fn!r} has no importable name"
    if "<lambda>" in qualname or "<locals>" in qualname:
        return None, f"`{qualname}` is defined inside a function or is a lambda"
    if module == "__main__":
        return None, f"`{qualname}` is defined in the script run as __main__"
    if hasattr(fn, "__self__") and not isinstance(fn.__self__, type(sys)):
        return None, f"`{qualname}` is a bound method (replay calls fn(model, batch))"
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        return None, f"`{module}:{qualname}` does not name it"
    return f"{module}:{qualname}", None


def precision_name(mixed: str | None) -> str:
    """A trainer's precision setting as meta.json's `precision` (the replay's autocast)."""
    text = str(mixed or "")
    if text.startswith("bf16"):
        return "bf16"
    return "fp16" if text.startswith("16") else "fp32"


def _constructor_arguments(cls: Any) -> list[str] | None:
    import inspect
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return None
    # Any parameter counts, defaults and *args included: the run may have passed values.
    return [("*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else "")
            + p.name for p in list(parameters)[1:]]


def _json_or_none(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return None


def _roots(targets: list, structure: Any) -> list[str]:
    """The folders the user's modules named in the bundle were imported from (the folder above
    each top-level package), leaving out the interpreter's own library folders."""
    import sysconfig
    names = [t.split(":", 1)[0] for t in targets if t]
    stack = [structure]
    while stack:
        node = stack.pop()
        if node:
            if node.get("type"):
                names.append(node["type"].split(":", 1)[0])
            stack.extend(node.get("children") or [])
    system = {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib")
              if (p := sysconfig.get_paths().get(key))}
    roots: list[str] = []
    for name in names:
        source = getattr(sys.modules.get(name), "__file__", None)
        if not source:
            continue
        path = Path(source).resolve()
        depth = name.count(".") + (2 if path.name == "__init__.py" else 1)
        root = str(path.parents[depth - 1])
        if root not in system and root not in roots:
            roots.append(root)
    return roots


def write_sentinel_outputs(sentinel: Any, folder: str | Path) -> Path:
    """A Sentinel's trip: the repro bundle `repro-step<N>/` and the reports, into `folder`."""
    from nanaudit.integrations.sentinel_replay import named_optimizers
    from nanaudit.report.formats import renderer_for
    report = sentinel.report
    trip, state = sentinel.tripped
    finding = report.finding
    target, why = (callable_target(sentinel.loss_fn) if sentinel.loss_fn is not None
                   else (None, "Sentinel was given no loss_fn"))
    meta = {"source": "sentinel",
            "batch_index": finding.batch_index if finding is not None else None}
    if target is not None:
        meta.update(loss=target, loss_label=target)
    else:
        meta["loss_recipe"] = {"why": f"the loss_fn cannot be imported: {why}"}
    bundle = write_step_bundle(Path(folder) / f"repro-step{trip.step}", sentinel.model,
                               named_optimizers(sentinel.optimizers), trip, state, finding,
                               renderer_for("json").render(report), meta)
    report.repro = str(bundle)
    write_reports(report, folder, echo=False)
    return bundle
