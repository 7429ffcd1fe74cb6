"""Repro bundles: a folder that reproduces a finding without the user's data pipeline.

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

`nanaudit replay DIR` re-runs the localization from a bundle. Everything is loaded with
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
nothing but those files, unchanged, is replaced. Any other existing folder (`--repro .`, a user's results folder)
receives the bundle in a new subfolder `repro-step<N>` (`-2`, `-3`, ... when that is taken).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanaudit.errors import ConfigError, NanauditError, Problem, UsageError, UserCodeError
from nanaudit.report.output import honour_umask
from nanaudit.run.batch import batch_structure, to_plain

BUNDLE_FILES = ("state.pt", "rng.pt", "batch.pt", "config.yaml", "meta.json", "report.json",
                "repro.py")
# A bundle of Sentinel or a callback: no config; older ones have no repro.py either.
RECORDED_FILES = ("state.pt", "rng.pt", "batch.pt", "meta.json")
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
    shutil.copyfile(_TEMPLATE, tmp / "repro.py")


def save_step(tmp: Path, model, optimizers, state, finding, batch_dim=None,
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


def rng_payload(rng) -> dict:
    """The step's RNG states as weights_only loads them: NumPy's key array as a tensor."""
    payload = {"torch_cpu": rng.torch_cpu, "cuda": rng.cuda, "python": plain_rng(rng.python)}
    state = getattr(rng, "numpy", None)
    if state is not None:
        name, keys, pos, has_gauss, cached = state[:5]
        payload["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")),
                            "pos": int(pos), "has_gauss": int(has_gauss),
                            "cached_gaussian": float(cached)}
    return payload


def _version() -> str:
    from nanaudit._version import __version__
    return __version__


def to_plain_cpu(tree: Any) -> Any:
    """Tensors to the CPU, containers to plain dict/list/tuple (what weights_only loads)."""
    return to_plain(tree, lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor)
                    else leaf)


def plain_rng(value: Any) -> Any:
    """Python's random state as nested lists (weights_only loads lists, ints and None)."""
    if isinstance(value, tuple):
        return [plain_rng(v) for v in value]
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

    @property
    def from_scan(self) -> bool:
        """Written by `scan` (a config names the model and loss), not by a training run."""
        return _source(self.meta) == "scan"

    def import_roots(self) -> list[Path]:
        from nanaudit.commands.repro_template import import_roots
        return [Path(r) for r in import_roots(self.meta)]


def load_bundle(folder: Path) -> Bundle:
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
    required = BUNDLE_FILES if meta is None or _source(meta) == "scan" else RECORDED_FILES
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise ConfigError(f"{folder} is not a complete nanaudit repro bundle: missing "
                          f"{', '.join(missing)}")
    try:
        state, rng, batch = (torch.load(folder / name, map_location="cpu", weights_only=True)
                             for name in ("state.pt", "rng.pt", "batch.pt"))
    except Exception as exc:
        raise ConfigError(f"cannot read the repro bundle {folder}: {exc}") from None
    return Bundle(folder, meta, state, rng, batch)


def _source(meta: dict) -> str:
    """Who wrote the bundle: `scan`, or a training run (bundles of the callbacks from before
    `source` was recorded have no config path)."""
    return meta.get("source") or ("scan" if "config_path" in meta else "training run")


def replay_bundle(bundle: Bundle, model: str | None = None, loss: str | None = None):
    """Rebuild the session and set up the bundle's step again: from its config for a `scan`
    bundle, from the recorded recipes (or `model` / `loss` entrypoints) for one written by
    Sentinel or a callback. Returns (session, ScanOutcome, notes) ready for `build_finding`;
    `notes` say what the replay could not rebuild as it was (a batch type kept plain). Call
    within `bundle_import_path`."""
    if bundle.from_scan:
        if model or loss:
            raise UsageError("--model and --loss are for bundles written by Sentinel or a "
                             "training callback; this bundle's config names the model and loss")
        session = _scan_session(bundle)
    else:
        session = _recorded_session(bundle, model, loss)
    from nanaudit.run.step import ScanOutcome, StepState, Trip
    meta = bundle.meta
    batch, notes = _batch(bundle, session.device)
    state = StepState(meta["step"], batch, rng_state(bundle.rng), meta.get("scale"),
                      batch_index=meta.get("batch_index"), micro_batch=meta.get("micro_batch"),
                      window=meta.get("window") or 1, halt_at=meta.get("halt_at"))
    trip = Trip(meta["step"], meta["check"], rank=meta.get("rank"), note=meta.get("note"),
                optimizer=meta.get("optimizer"), loss_name=meta.get("loss_name"),
                micro_batch=meta.get("micro_batch"))
    if trip.check not in ("input", "parameter", "optimizer", "loss", "gradient", "schedule"):
        raise ConfigError([Problem("meta.json", f"unknown check {trip.check!r}")])
    if trip.check == "optimizer" and not bundle.from_scan:
        raise UsageError(f"the bundle's finding is an optimizer update (step {trip.step}): "
                         f"the weights went non-finite in `optimizer.step()`, which replay does "
                         f"not re-run (it replays forward and backward); report.json holds the "
                         f"finding")
    outcome = ScanOutcome(steps_run=meta["step"] + 1, trip=trip, state=state)
    return session, outcome, notes


@contextlib.contextmanager
def bundle_import_path(bundle: Bundle, with_cwd: bool = False):
    """The folders the run imported the user's code from are importable during the replay
    (and the working folder for `--model` / `--loss`), then removed again."""
    from nanaudit.config.entrypoints import user_import_path
    roots = bundle.import_roots() + ([Path.cwd()] if with_cwd else [])
    with contextlib.ExitStack() as stack:
        for root in reversed(roots):
            stack.enter_context(user_import_path(root))
        yield


def _scan_session(bundle: Bundle):
    from nanaudit.config.parse import parse_config
    from nanaudit.config.reader import read_yaml
    from nanaudit.run.checkpoint import Checkpoint, apply_model_state
    from nanaudit.run.session import build_session, load_training_state
    meta = bundle.meta
    # Entrypoints resolve against the original config's folder, as in the original run.
    config = parse_config(read_yaml(bundle.folder / "config.yaml"), Path(meta["config_path"]))
    config = replace(config, checkpoint=None)
    session = build_session(config)
    apply_model_state(session.local_model, Checkpoint(bundle.state["model"], bundle.state,
                                                      str(bundle.folder)),
                      "repro bundle", str(bundle.folder / "state.pt"))
    session.local_model.to(session.device)
    load_training_state(bundle.state, session.optimizers, session.schedulers)
    if session.precision.scaler is not None and meta.get("scale"):
        session.precision.scale = float(meta["scale"])
    return session


class _RecordedLoss:
    """The loss a recorded bundle replays, named in findings as the training code named it
    (`Regressor.training_step`, `Trainer.compute_loss`, your loss_fn)."""

    def __init__(self, fn, label: str):
        self.fn, self.loss_label = fn, label

    def __call__(self, model, batch):
        return self.fn(model, batch)


class BundlePrecision:
    """The recorded run's autocast (`precision` in meta.json) and its loss scale."""

    def __init__(self, name: str | None, device):
        from nanaudit.run.precision import DTYPES
        self.name = name if name in DTYPES else "fp32"
        self.dtype = DTYPES[self.name]
        self.device_type = torch.device(device).type
        self.scaler = None
        self.scale = 1.0

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return loss * scale if scale is not None else loss


def _recorded_session(bundle: Bundle, model_target: str | None, loss_target: str | None):
    """A session over the model and loss a Sentinel or callback bundle records: built as its
    repro.py builds them (the same functions), with the saved weights loaded."""
    from nanaudit.commands import repro_template as recipes
    from nanaudit.run.checkpoint import Checkpoint, apply_model_state
    from nanaudit.run.session import Session
    meta = bundle.meta
    resolve = bundle_resolver(bundle)
    model = _build("building the model", recipes.build_model, meta, resolve, model_target)
    loss_fn = _build("setting up the loss", recipes.build_loss, meta, resolve, loss_target)
    apply_model_state(model, Checkpoint(bundle.state["model"], bundle.state, str(bundle.folder)),
                      "repro bundle", str(bundle.folder / "state.pt"))
    recorded = str(meta.get("device") or "cpu")
    device = torch.device(recorded if recorded.startswith("cuda") and torch.cuda.is_available()
                          else "cpu")
    model.to(device).train()
    label = loss_target or meta.get("loss_label") or "<recorded loss>"
    loss = _RecordedLoss(loss_fn, label)
    return Session.for_loop(model, None, loss.__call__, device, label=f"<{label}>",
                            precision=BundlePrecision(meta.get("precision"), device))


def _build(what: str, build, meta: dict, resolve, override):
    from nanaudit.commands.repro_template import Missing
    try:
        return build(meta, resolve, override)
    except Missing as missing:
        raise UsageError(f"cannot replay the bundle: {missing}") from None
    except NanauditError:
        raise
    except Exception as exc:
        raise UserCodeError(what, exc) from exc


def bundle_resolver(bundle: Bundle) -> Callable[[str], Any]:
    """`module:attr` / `file.py:attr` resolved as the config's entrypoints are (the first
    import root is the config's folder), so a type rebuilt here is the one the loss knows."""
    from nanaudit.config.entrypoints import resolve
    from nanaudit.config.schema import Entrypoint
    roots = bundle.import_roots()
    base = roots[0] if roots else Path.cwd()
    return lambda target: resolve(Entrypoint(target, "meta.json"), base)


def _batch(bundle: Bundle, device) -> tuple[Any, list]:
    """The saved batch on the device, with the user's container types rebuilt."""
    from nanaudit.commands.repro_template import rebuild_batch
    from nanaudit.run.batch import to_device
    plain = to_device(bundle.batch, device)
    return rebuild_batch(plain, bundle.meta.get("batch_structure"), bundle_resolver(bundle),
                         bundle.import_roots())


def rng_state(payload: dict):
    """The RngState a replay restores, from rng.pt (NumPy's state when it was saved)."""
    import dataclasses as dc

    from nanaudit.commands.repro_template import numpy_state
    from nanaudit.run.step import RngState
    fields = {
        "python": _tupled(payload["python"]), "torch_cpu": payload["torch_cpu"],
        "cuda": payload.get("cuda") if torch.cuda.is_available() else None}
    if payload.get("numpy") is not None and "numpy" in {f.name for f in dc.fields(RngState)}:
        fields["numpy"] = numpy_state(payload["numpy"])
    return RngState(**fields)


def default_folder(report_paths: list, step: int) -> Path:
    """Where a bundle goes without --repro: beside the first file report, else ./nanaudit-reports."""
    files = [Path(p) for p in report_paths if p and p != "-"]
    base = files[0].parent if files else Path("nanaudit-reports")
    return base / f"repro-step{step}"

