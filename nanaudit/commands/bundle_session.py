"""Set a repro bundle's step up again for `nanaudit replay`: the session (from the bundle's
config for a `scan` bundle; from the recorded recipes, or `--model` / `--loss`, for one written
by Sentinel or a training callback), the batch with the user's container types, the RNG state
and the trip, ready for `build_finding`. The model, loss and batch are rebuilt with the very
functions of the bundle's standalone repro.py (bundle_script.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nanaudit.commands.bundle import Bundle
from nanaudit.errors import (
    USER_FAILURES,
    ConfigError,
    NanauditError,
    Problem,
    UsageError,
    UserCodeError,
)


def replay_bundle(bundle: Bundle, model: str | None = None, loss: str | None = None) -> Any:
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
    from nanaudit.report.vocabulary import Check
    from nanaudit.run.step import ScanOutcome, StepState, Trip
    meta = bundle.meta
    batch, notes = _batch(bundle, session.device)
    state = StepState(meta["step"], batch, rng_state(bundle.rng), meta.get("scale"),
                      batch_index=meta.get("batch_index"), micro_batch=meta.get("micro_batch"),
                      window=meta.get("window") or 1, halt_at=meta.get("halt_at"))
    # A scan's bundle holds a sentinel's check or the schedule's; an error trip is the script's.
    if meta["check"] not in tuple(Check) or meta["check"] == Check.ERROR:
        raise ConfigError([Problem("meta.json", f"unknown check {meta['check']!r}")])
    trip = Trip(meta["step"], Check(meta["check"]), rank=meta.get("rank"), note=meta.get("note"),
                optimizer=meta.get("optimizer"), loss_name=meta.get("loss_name"),
                micro_batch=meta.get("micro_batch"))
    if trip.check == Check.OPTIMIZER and not bundle.from_scan:
        raise UsageError(f"the bundle's finding is an optimizer update (step {trip.step}): "
                         f"the weights went non-finite in `optimizer.step()`, which replay does "
                         f"not re-run (it replays forward and backward); report.json holds the "
                         f"finding")
    outcome = ScanOutcome(steps_run=meta["step"] + 1, trip=trip, state=state)
    return session, outcome, notes


@contextlib.contextmanager
def bundle_import_path(bundle: Bundle, with_cwd: bool = False) -> Any:
    """The folders the run imported the user's code from are importable during the replay
    (and the working folder for `--model` / `--loss`), then removed again."""
    from nanaudit.config.entrypoints import user_import_path
    roots = bundle.import_roots() + ([Path.cwd()] if with_cwd else [])
    with contextlib.ExitStack() as stack:
        for root in reversed(roots):
            stack.enter_context(user_import_path(root))
        yield


def _scan_session(bundle: Bundle) -> Any:
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

    def __init__(self, fn: Any, label: str) -> None:
        self.fn, self.loss_label = fn, label

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        return self.fn(model, batch)


class BundlePrecision:
    """The recorded run's autocast (`precision` in meta.json) and its loss scale."""

    def __init__(self, name: str | None, device: Any) -> None:
        from nanaudit.run.precision import DTYPES
        self.name = name if name in DTYPES else "fp32"
        self.dtype = DTYPES[self.name]
        self.device_type = torch.device(device).type
        self.scaler = None
        self.scale = 1.0

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return loss * scale if scale is not None else loss


def _recorded_session(bundle: Bundle, model_target: str | None, loss_target: str | None) -> Any:
    """A session over the model and loss a Sentinel or callback bundle records: built as its
    repro.py builds them (the same functions), with the saved weights loaded."""
    from nanaudit.commands import bundle_script as recipes
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


def _build(what: str, build: Any, meta: dict, resolve: Any, override: Any) -> Any:
    from nanaudit.commands.bundle_script import Missing
    try:
        return build(meta, resolve, override)
    except Missing as missing:
        raise UsageError(f"cannot replay the bundle: {missing}") from None
    except NanauditError:
        raise
    except USER_FAILURES as exc:
        raise UserCodeError(what, exc) from exc


def bundle_resolver(bundle: Bundle) -> Callable[[str], Any]:
    """`module:attr` / `file.py:attr` resolved as the config's entrypoints are (the first
    import root is the config's folder), so a type rebuilt here is the one the loss knows."""
    from nanaudit.config.entrypoints import resolve
    from nanaudit.config.schema import Entrypoint
    roots = bundle.import_roots()
    base = roots[0] if roots else Path.cwd()
    return lambda target: resolve(Entrypoint(target, "meta.json"), base)


def _batch(bundle: Bundle, device: Any) -> tuple[Any, list]:
    """The saved batch on the device, with the user's container types rebuilt."""
    from nanaudit.commands.bundle_script import rebuild_batch
    from nanaudit.run.batch import to_device
    plain = to_device(bundle.batch, device)
    return rebuild_batch(plain, bundle.meta.get("batch_structure"), bundle_resolver(bundle),
                         bundle.import_roots())


def rng_state(payload: dict) -> Any:
    """The RngState a replay restores, from rng.pt (NumPy's state when it was saved)."""
    import dataclasses as dc

    from nanaudit.commands.bundle_script import numpy_state
    from nanaudit.run.step import RngState
    fields = {
        "python": _tupled(payload["python"]), "torch_cpu": payload["torch_cpu"],
        "cuda": payload.get("cuda") if torch.cuda.is_available() else None}
    if payload.get("numpy") is not None and "numpy" in {f.name for f in dc.fields(RngState)}:
        fields["numpy"] = numpy_state(payload["numpy"])
    return RngState(**fields)


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value
