"""Repro bundles: a folder that reproduces a finding without the user's data pipeline.

    state.pt     the model (and optimizer) state before the failing step
    rng.pt       the RNG states captured before the step's forward
    batch.pt     the step's batch; rows.pt the offending rows alone (when isolated)
    config.yaml  a copy of the config; meta.json what the step needs (entrypoints, precision,
                 loss scale, the config's folder)
    report.json  the report
    repro.py     plain PyTorch, no nanaudit import: rebuilds the model from the user's own
                 factory, loads the files with `weights_only=True`, runs the step and prints
                 the non-finite values (exit 1 when they reproduce)

`nanaudit replay DIR` re-runs the localization from a bundle. Everything is loaded with
`torch.load(..., weights_only=True)`, and the bundle is written to a temporary folder first
and renamed into place, so a bundle is complete or absent.

nanaudit never deletes what it did not create: a bundle carries a manifest
(`nanaudit-bundle.json`: the tool version and each file's SHA-256), and only a folder holding
nothing but those files, unchanged, is replaced. Any other existing folder (`--repro .`, a user's results folder)
receives the bundle in a new subfolder `repro-step<N>` (`-2`, `-3`, ... when that is taken).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from nanaudit.errors import ConfigError, Problem
from nanaudit.report.output import honour_umask
from nanaudit.run.batch import to_plain

BUNDLE_FILES = ("state.pt", "rng.pt", "batch.pt", "config.yaml", "meta.json", "report.json",
                "repro.py")
OPTIONAL_FILES = ("rows.pt",)
MANIFEST = "nanaudit-bundle.json"
_TEMPLATE = Path(__file__).with_name("repro_template.py")


def bundle_folder(requested: Path, step: int) -> Path:
    """Where a bundle asked for at `requested` may go without touching anything else:
    `requested` itself when it is absent or an earlier bundle, else a fresh subfolder."""
    requested = Path(requested)
    if not requested.exists() or is_bundle(requested):
        return requested
    base = requested / f"repro-step{step}"
    candidate, n = base, 1
    while candidate.exists() and not is_bundle(candidate):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def is_bundle(folder: Path) -> bool:
    """An earlier bundle of ours, untouched since: a real folder holding regular files only,
    each listed in the manifest with the same SHA-256. A user's file added to it, an edited
    repro.py or a symlink makes it the user's, and it is never replaced."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return False
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        digests = manifest["files"]
        if manifest.get("tool") != "nanaudit" or not isinstance(digests, dict):
            return False
        for path in folder.iterdir():
            if path.name == MANIFEST:
                continue
            if path.is_symlink() or not path.is_file() or digests.get(path.name) != _sha256(path):
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_bundle(folder: Path, session, state, trip, finding, report_json: str) -> Path:
    """Write the bundle for `state` (the failing step) into `folder` (from `bundle_folder`)."""
    return publish_bundle(folder, lambda tmp: _fill(tmp, session, state, trip, finding,
                                                    report_json))


def publish_bundle(folder: Path, fill: Callable[[Path], None]) -> Path:
    """Fill a temporary folder, add the manifest, and rename it into place atomically.

    `folder` is absent or an earlier, unchanged bundle of ours. That one is moved aside first
    and checked again once aside (filling can take minutes: a user may have edited it
    meanwhile); only then is the new bundle renamed in and the old one's listed files deleted.
    If the check fails, the old folder is put back untouched and the write fails."""
    folder = Path(folder)
    if folder.exists() and not is_bundle(folder):
        raise FileExistsError(f"{folder} exists and is not a nanaudit repro bundle; "
                              f"nothing in it was touched")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    aside = None
    try:
        honour_umask(tmp, directory=True)
        fill(tmp)
        _write_manifest(tmp)
        if folder.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            os.replace(folder, aside / folder.name)
            aside_bundle = aside / folder.name
            if not is_bundle(aside_bundle):
                os.replace(aside_bundle, folder)
                raise FileExistsError(f"{folder} changed while the new bundle was written; "
                                      f"it was left as it is")
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not any(aside.iterdir()):
            aside.rmdir()
        raise
    if aside is not None:
        _remove_bundle(aside / folder.name)
        aside.rmdir()
    return folder


def _remove_bundle(folder: Path) -> None:
    """Delete an earlier bundle: only the files its manifest lists, then the empty folder."""
    listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    for name in [*listed, MANIFEST]:      # names only: a listed "../x" stays inside
        target = folder / Path(name).name
        if target.is_file() and not target.is_symlink():
            target.unlink()
    folder.rmdir()


def _write_manifest(folder: Path) -> None:
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir())}
    (folder / MANIFEST).write_text(json.dumps({"tool": "nanaudit", "version": _version(),
                                               "files": files}, indent=2) + "\n",
                                   encoding="utf-8")
    for path in folder.iterdir():
        honour_umask(path)


def _fill(tmp: Path, session, state, trip, finding, report_json: str) -> None:
    from nanaudit.run.session import training_state
    config = session.config
    model = session.local_model
    state.rewind()          # the buffers (and a user step's earlier updates) as before the step
    torch.save(to_plain_cpu({"model": model.state_dict(), "optimizer": None,
                             **training_state(session)}), tmp / "state.pt")
    rng = state.rng
    torch.save({"torch_cpu": rng.torch_cpu, "cuda": rng.cuda,
                "python": plain_rng(rng.python), "numpy": plain_rng(rng.numpy)},
               tmp / "rng.pt")
    torch.save(to_plain_cpu(state.batch), tmp / "batch.pt")
    if finding is not None and finding.samples:
        from nanaudit.run.batch import infer_layout, select_rows
        layout = infer_layout(state.batch, config.batch_dim)
        torch.save(to_plain_cpu(select_rows(state.batch, layout, list(finding.samples))),
                   tmp / "rows.pt")
    (tmp / "config.yaml").write_text(config.path.read_text(encoding="utf-8"), encoding="utf-8")
    meta = {
        "step": state.step, "check": trip.check, "rank": trip.rank,
        "optimizer": trip.optimizer, "loss_name": trip.loss_name, "note": trip.note,
        "config_path": str(config.path), "base_dir": str(config.base_dir),
        "model": config.model.target, "model_args": dict(config.model.args),
        "loss": config.loss.target if config.loss else None,
        "loss_args": dict(config.loss.args) if config.loss else {},
        "step_fn": config.step.target if config.step else None,
        "batch_index": state.batch_index, "micro_batch": state.micro_batch,
        "window": state.window, "halt_at": state.halt_at,
        "precision": config.precision, "scale": state.scale, "device": str(session.device),
        "torch": torch.__version__, "samples": list(finding.samples or []) if finding else [],
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    (tmp / "report.json").write_text(report_json, encoding="utf-8")
    shutil.copyfile(_TEMPLATE, tmp / "repro.py")


def _version() -> str:
    from nanaudit._version import __version__
    return __version__


def to_plain_cpu(tree: Any) -> Any:
    """Tensors to the CPU, containers to plain dict/list/tuple (what weights_only loads)."""
    return to_plain(tree, lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor)
                    else leaf)


def plain_rng(value: Any) -> Any:
    """Python's and NumPy's random states as nested lists (weights_only loads lists, ints,
    floats and None)."""
    if isinstance(value, tuple):
        return [plain_rng(v) for v in value]
    if type(value).__module__ == "numpy":        # NumPy's key array and scalars
        return value.tolist()
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


# --- reading a bundle -----------------------------------------------------------------------

@dataclass
class Bundle:
    folder: Path
    meta: dict
    state: dict
    rng: dict
    batch: Any


def load_bundle(folder: Path) -> Bundle:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"repro bundle not found: {folder} is not a folder")
    missing = [name for name in BUNDLE_FILES if not (folder / name).exists()]
    if missing:
        raise ConfigError(f"{folder} is not a complete nanaudit repro bundle: missing "
                          f"{', '.join(missing)}")
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        state, rng, batch = (torch.load(folder / name, map_location="cpu", weights_only=True)
                             for name in ("state.pt", "rng.pt", "batch.pt"))
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
        raise ConfigError(f"cannot read the repro bundle {folder}: {exc}") from None
    return Bundle(folder, meta, state, rng, batch)


def replay_bundle(bundle: Bundle):
    """Rebuild the session from a loaded bundle's config and set up its step again.
    Returns (session, ScanOutcome) ready for `build_finding`."""
    from nanaudit.config.parse import parse_config, read_yaml
    from nanaudit.run.batch import to_device
    from nanaudit.run.checkpoint import Checkpoint, apply_model_state
    from nanaudit.run.session import build_session, load_training_state
    from nanaudit.run.step import RngState, ScanOutcome, StepState, Trip
    meta = bundle.meta
    # Entrypoints resolve against the original config's folder, as in the original run.
    config = parse_config(read_yaml(bundle.folder / "config.yaml"), Path(meta["config_path"]))
    config = replace(config, checkpoint=None)
    session = build_session(config)
    model = session.local_model
    apply_model_state(model, Checkpoint(bundle.state["model"], bundle.state, str(bundle.folder)),
                      "repro bundle",
                      str(bundle.folder / "state.pt"))
    model.to(session.device)
    load_training_state(bundle.state, session.optimizers, session.schedulers)
    if session.precision.scaler is not None and meta.get("scale"):
        session.precision.scale = float(meta["scale"])
    rng = RngState(_tupled(bundle.rng["python"]), bundle.rng["torch_cpu"],
                   bundle.rng.get("cuda") if torch.cuda.is_available() else None,
                   _numpy_state(bundle.rng.get("numpy")))
    state = StepState(meta["step"], to_device(bundle.batch, session.device), rng, meta["scale"],
                      batch_index=meta.get("batch_index"), micro_batch=meta.get("micro_batch"),
                      window=meta.get("window") or 1, halt_at=meta.get("halt_at"))
    trip = Trip(meta["step"], meta["check"], rank=meta.get("rank"), note=meta.get("note"),
                optimizer=meta.get("optimizer"), loss_name=meta.get("loss_name"),
                micro_batch=meta.get("micro_batch"))
    if trip.check not in ("input", "parameter", "optimizer", "loss", "gradient", "schedule"):
        raise ConfigError([Problem("meta.json", f"unknown check {trip.check!r}")])
    outcome = ScanOutcome(steps_run=meta["step"] + 1, trip=trip, state=state)
    return session, outcome


def _numpy_state(saved):
    """NumPy's global RNG state as `set_state` takes it (the bundle keeps it as lists)."""
    if saved is None:
        return None
    import numpy
    kind, keys, pos, has_gauss, cached = saved
    return (kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)


def default_folder(report_paths: list, step: int) -> Path:
    """Where a bundle goes without --repro: beside the first file report, else ./nanaudit-reports."""
    files = [Path(p) for p in report_paths if p and p != "-"]
    base = files[0].parent if files else Path("nanaudit-reports")
    return base / f"repro-step{step}"

