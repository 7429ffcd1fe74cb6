"""A repro bundle on disk: write one atomically, recognise our own, read one back. A bundle is a
folder that reproduces a finding without the user's data pipeline.

    state.pt     the model (and optimizer) state before the failing step
    rng.pt       the RNG states captured before the step's forward (torch, Python, NumPy)
    batch.pt     the step's batch as plain containers; rows.pt the offending rows alone
    config.yaml  a copy of the config (`scan` bundles); meta.json what the step needs
                 (entrypoints or the recorded recipes, precision, loss scale, the folders the
                 run imported from, the batch's own container types)
    report.json  the report
    repro.py     plain PyTorch, no nanaudit import: builds the model, loads the files with
                 `weights_only=True`, runs the step and prints the non-finite values (exit 1
                 when they reproduce, 2 when it needs `--model` / `--loss`)

`nanaudit replay DIR` re-runs the localization from a bundle (bundle_session.py sets its step
up again; bundle_script.py is the standalone repro.py). Everything is loaded with
`torch.load(..., weights_only=True)`, and the bundle is written to a temporary folder first
and renamed into place, so a bundle is complete or absent.

Bundles of `scan` build the model and loss from the config's entrypoints. Bundles written by
`Sentinel` and the Trainer and Lightning callbacks (`integrations/_output.py`) have no config:
they record what can honestly rebuild the step without the training script (a Hugging Face
model's class and config, a LightningModule's saved hyperparameters and `training_step`, the
Trainer's loss, an importable `loss_fn`) and, for what they cannot (a plain module's
constructor arguments), `repro.py` and `replay` take `--model module:factory` and
`--loss module:fn` and say which is needed (exit 2). No module is pickled: a bundle attached
to a bug report loads with `weights_only=True` and runs no code of its own but `repro.py`.

nanaudit never deletes what it did not create: a bundle carries a manifest
(`nanaudit-bundle.json`: the tool version and each file's SHA-256), and only a folder holding
nothing but those files, unchanged, is replaced. Any other existing folder (`--repro .`, a
user's results folder) receives the bundle in a new subfolder `repro-step<N>` (`-2`, `-3`, ...
when that is taken).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanaudit._version import __version__
from nanaudit.errors import ConfigError, Problem
from nanaudit.report.output import honour_umask, in_flight
from nanaudit.run.batch import batch_structure, to_plain

BUNDLE_FILES = ("state.pt", "rng.pt", "batch.pt", "config.yaml", "meta.json", "report.json",
                "repro.py")
# A bundle of Sentinel or a callback: no config; older ones have no repro.py either.
RECORDED_FILES = ("state.pt", "rng.pt", "batch.pt", "meta.json")
OPTIONAL_FILES = ("rows.pt",)
MANIFEST = "nanaudit-bundle.json"
BUNDLE_SCRIPT = Path(__file__).with_name("bundle_script.py")
"""The standalone script every bundle carries as repro.py."""


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


def write_bundle(folder: Path, session: Any, state: Any, trip: Any, finding: Any,
                 report_json: str) -> Path:
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
    with in_flight(tmp):
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
    (folder / MANIFEST).write_text(json.dumps({"tool": "nanaudit", "version": __version__,
                                               "files": files}, indent=2) + "\n",
                                   encoding="utf-8")
    for path in folder.iterdir():
        honour_umask(path)


def _fill(tmp: Path, session: Any, state: Any, trip: Any, finding: Any, report_json: str) -> None:
    config = session.config
    save_step(tmp, session.local_model, session.optimizers, state, finding, config.batch_dim,
              schedulers=session.schedulers)
    (tmp / "config.yaml").write_text(config.path.read_text(encoding="utf-8"), encoding="utf-8")
    meta = {
        "source": "scan", "step": state.step, "check": trip.check, "rank": trip.rank,
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
        "batch_structure": batch_structure(state.batch),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    (tmp / "report.json").write_text(report_json, encoding="utf-8")
    shutil.copyfile(BUNDLE_SCRIPT, tmp / "repro.py")


def save_step(tmp: Path, model: torch.nn.Module, optimizers: Any, state: Any, finding: Any,
              batch_dim: Any = None,
              schedulers: dict | None = None) -> None:
    """state.pt, rng.pt, batch.pt and rows.pt of the failing step (every bundle has them).
    `optimizers`: one optimizer, or a dict name -> optimizer (each one's state is kept), and
    `schedulers` by name."""
    weights = to_plain_cpu(model.state_dict())
    # Buffers the forward changed (BatchNorm's running stats) go back to their pre-step value.
    before = {id(live): value for live, value in (getattr(state, "buffers", None) or [])}
    for name, buffer in model.named_buffers():
        if id(buffer) in before and name in weights:
            weights[name] = before[id(buffer)].detach().cpu().clone()
    named = optimizers if isinstance(optimizers, dict) else {"optimizer": optimizers}
    saved = {name: to_plain_cpu(opt.state_dict()) for name, opt in named.items()
             if opt is not None and hasattr(opt, "state_dict")}
    body = {"model": weights, "optimizer": next(iter(saved.values()), None)}
    if len(saved) > 1:
        body["optimizers"] = saved
    if schedulers:
        body["schedulers"] = {name: to_plain_cpu(s.state_dict()) for name, s in schedulers.items()}
    torch.save(body, tmp / "state.pt")
    torch.save(rng_payload(state.rng), tmp / "rng.pt")
    torch.save(to_plain_cpu(state.batch), tmp / "batch.pt")
    if finding is not None and finding.samples and state.batch is not None:
        from nanaudit.run.batch import infer_layout, select_rows
        layout = infer_layout(state.batch, batch_dim)
        torch.save(to_plain_cpu(select_rows(state.batch, layout, list(finding.samples))),
                   tmp / "rows.pt")


def rng_payload(rng: Any) -> dict:
    """The step's RNG states as weights_only loads them: NumPy's key array as a tensor."""
    payload = {"torch_cpu": rng.torch_cpu, "cuda": rng.cuda, "python": plain_rng(rng.python)}
    state = getattr(rng, "numpy", None)
    if state is not None:
        name, keys, pos, has_gauss, cached = state[:5]
        payload["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")),
                            "pos": int(pos), "has_gauss": int(has_gauss),
                            "cached_gaussian": float(cached)}
    return payload


def to_plain_cpu(tree: Any) -> Any:
    """Tensors to the CPU, containers to plain dict/list/tuple (what weights_only loads)."""
    return to_plain(tree, lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor)
                    else leaf)


def plain_rng(value: Any) -> Any:
    """Python's random state as nested lists (weights_only loads lists, ints and None)."""
    if isinstance(value, tuple):
        return [plain_rng(v) for v in value]
    return value


# --- reading a bundle -----------------------------------------------------------------------

@dataclass
class Bundle:
    """A bundle read back: its folder, meta.json, and the state, RNG and batch it saved."""

    folder: Path
    meta: dict
    state: dict
    rng: dict
    batch: Any

    @property
    def from_scan(self) -> bool:
        """Written by `scan` (a config names the model and loss), not by a training run."""
        return self.source == "scan"

    @property
    def source(self) -> str:
        return bundle_source(self.meta)

    def import_roots(self) -> list[Path]:
        from nanaudit.commands.bundle_script import import_roots
        return [Path(r) for r in import_roots(self.meta)]


def load_bundle(folder: Path) -> Bundle:
    """The bundle in `folder`; ConfigError (exit 3) when it is incomplete or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"repro bundle not found: {folder} is not a folder")
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        meta = None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the repro bundle {folder}: meta.json: {exc}") from None
    if meta is not None and not isinstance(meta, dict):
        raise ConfigError(f"cannot read the repro bundle {folder}: meta.json holds a "
                          f"{type(meta).__name__}, not an object")
    if meta is not None and (problems := _meta_problems(meta)):
        raise ConfigError(problems, source=str(folder / "meta.json"))
    required = BUNDLE_FILES if meta is None or bundle_source(meta) == "scan" else RECORDED_FILES
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise ConfigError(f"{folder} is not a complete nanaudit repro bundle: missing "
                          f"{', '.join(missing)}")
    try:
        state, rng, batch = (torch.load(folder / name, map_location="cpu", weights_only=True)
                             for name in ("state.pt", "rng.pt", "batch.pt"))
    except Exception as exc:
        raise ConfigError(f"cannot read the repro bundle {folder}: {exc}") from None
    assert meta is not None, "meta.json is in every list of required files"
    return Bundle(folder, meta, state, rng, batch)


_META_KEYS = {"step": (int, True), "check": (str, True), "config_path": (str, False),
              "window": (int, False), "halt_at": (int, False), "batch_index": (int, False),
              "micro_batch": (int, False), "rank": (int, False), "scale": (float, False)}
"""meta.json's keys a replay computes with: (type, required); an optional one may be null."""


def _meta_problems(meta: dict) -> list[Problem]:
    """meta.json's missing or mistyped keys (an edited or damaged bundle), each named."""
    problems = []
    for key, (kind, required) in _META_KEYS.items():
        value = meta.get(key)
        if value is None:
            if required or (key == "config_path" and bundle_source(meta) == "scan"):
                problems.append(Problem(key, "missing"))
            continue
        numbers = (int, float) if kind is float else (kind,)
        if isinstance(value, bool) or not isinstance(value, numbers) or (
                isinstance(value, int) and value < 0):
            what = "a non-negative integer" if kind is int else (
                "a number" if kind is float else "a string")
            problems.append(Problem(key, f"expected {what}, got {value!r}"))
    return problems


def bundle_source(meta: dict) -> str:
    """Who wrote the bundle: `scan`, or a training run (bundles of the callbacks from before
    `source` was recorded have no config path)."""
    return meta.get("source") or ("scan" if "config_path" in meta else "training run")


def default_folder(report_paths: list, step: int) -> Path:
    """Where a bundle goes without --repro: beside the first file report, else under
    ./nanaudit-reports."""
    files = [Path(p) for p in report_paths if p and p != "-"]
    base = files[0].parent if files else Path("nanaudit-reports")
    return base / f"repro-step{step}"

