"""A PyTorch Lightning callback running nanaudit's Sentinel on every optimizer step.

    from nanaudit.integrations.lightning import NanauditCallback
    trainer = lightning.Trainer(callbacks=[NanauditCallback()])

Each batch's RNG state is taken in `on_train_batch_start`, each backward's loss is recorded
from `on_before_backward` (no host read), and the check runs in `on_before_optimizer_step`
(gradients accumulated and unscaled, weights not yet updated, before `gradient_clip_val`
clips): one host read per optimizer step, covering the whole `accumulate_grad_batches` window.
A non-finite value stops training with `NonFiniteError(report)` before the bad update.

- Step numbers: the finding's `step` is `trainer.global_step` at the check (the 0-based
  optimizer step, the CLI's step when nothing accumulates); `batch_index` is the `batch_idx`
  your `training_step` received, `micro_batch` its place in the accumulation window.
- Mixed precision: the precision plugin's GradScaler (`16-mixed`) is the Sentinel's scaler: a
  step it skips is not a finding unless the scale collapses; a NaN input or loss still is.
  Replays run `training_step` inside the plugin's autocast context, at the step's loss scale.
- Manual optimization: each `optimizer.step()` checks the gradients of that optimizer's
  parameters; the replay runs `training_step` with `manual_backward` recording the loss (the
  k-th call's, as in the step that tripped) and the optimizers' `step`/`zero_grad` disabled.
- With `output_dir`, the console, JSON and Markdown reports and the step's repro bundle
  (weights, RNG state, batch, offending rows, repro.py) are written there before raising;
  `report_path` writes the JSON alone. The bundle replays `training_step` without a Trainer
  (`nanaudit replay`), the module rebuilt from its `save_hyperparameters()`. Works with
  `lightning` and with the older `pytorch_lightning` package.
- `on_finding="skip"` (with `max_bad_steps`, default 10): a bad step's update is left out and
  training goes on (the gradients of that optimizer step are dropped, so the torch optimizer
  updates nothing and its state does not move; the buffers are put back). Lightning runs its
  schedulers and counts `global_step` as for a step its GradScaler skipped. Every bad step is
  a finding of `callback.report` (`findings`), written to `report_path` / `output_dir` when
  training ends; when skipping cannot help it raises `NonFiniteError` as "raise" does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    from pytorch_lightning.callbacks import Callback

from nanaudit.report.bad_steps import MAX_BAD_STEPS

if TYPE_CHECKING:
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from nanaudit.integrations.sentinel import NonFiniteError, Sentinel
    from nanaudit.report.model import Report


class NanauditCallback(Callback):
    def __init__(self, report_path: str | None = None, output_dir: str | None = None,
                 isolate_samples: bool = True, max_skipped: int = 10, scale_floor: float = 1.0,
                 echo: bool = True, on_finding: str = "raise",
                 max_bad_steps: int = MAX_BAD_STEPS) -> None:
        super().__init__()
        if on_finding not in ("raise", "skip"):
            raise ValueError(f"on_finding must be 'raise' or 'skip', not {on_finding!r}")
        self.on_finding, self.max_bad_steps = on_finding, max_bad_steps
        self.report_path = report_path
        self.output_dir = output_dir
        self.isolate_samples = isolate_samples
        self.max_skipped, self.scale_floor = max_skipped, scale_floor
        self.echo = echo
        self.sentinel: Sentinel | None = None    # built at fit start
        self.report: Report | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._backward_calls = 0       # manual_backward calls in this batch so far
        self._call_of: dict = {}       # id(micro-batch record) -> its manual_backward call

    # --- setup ------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from nanaudit.integrations.sentinel import Sentinel
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.sentinel = Sentinel(pl_module, list(trainer.optimizers), loss_fn=self._replay_loss,
                                 scaler=scaler, isolate_samples=self.isolate_samples,
                                 max_skipped=self.max_skipped, scale_floor=self.scale_floor,
                                 on_finding=self.on_finding, max_bad_steps=self.max_bad_steps)
        self._trainer = trainer
        cls = type(pl_module)
        # What a finding names for ops outside every submodule: the user's step, not ours.
        self.loss_label = f"{cls.__module__}:{cls.__qualname__}.training_step"

    def _replay_loss(self, model: torch.nn.Module, batch: Any) -> Any:
        """The replay's loss: the module's own training_step, under the precision plugin's
        autocast; under manual optimization the k-th manual_backward's loss, nothing stepped."""
        trainer = self._trainer
        assert self.sentinel is not None, "a replay runs after on_fit_start"
        module = cast("LightningModule", model)     # the Sentinel replays pl_module
        micro = self.sentinel.replaying
        batch_idx = micro.index if micro is not None else self._batch_idx
        with trainer.precision_plugin.train_step_context():
            if module.automatic_optimization:
                return module.training_step(batch, batch_idx)
            with _manual_replay(module, trainer) as losses:
                module.training_step(batch, batch_idx)
            call = self._call_of.get(id(micro), len(losses) - 1)
            return losses[call] if 0 <= call < len(losses) else None

    # --- recording --------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.sentinel is None:
            return
        self.sentinel.capture_rng()
        self._batch, self._batch_idx = batch, batch_idx
        self._backward_calls = 0

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule,
                           loss: torch.Tensor) -> None:
        if self.sentinel is None or self._batch is None:
            return
        scaler = self.sentinel.scaler
        value = loss.detach()
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            value = value / scaler._scale      # the hook sees the scaled loss (device op)
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            value = value * trainer.accumulate_grad_batches    # Lightning divided it
        record = self.sentinel.micro_batch(self._batch, value, index=self._batch_idx)
        if len(self._call_of) > 1024:
            self._call_of.clear()               # only the open window's records are needed
        self._call_of[id(record)] = self._backward_calls
        self._backward_calls += 1

    # --- the check --------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        from nanaudit.integrations.sentinel import NonFiniteError
        if self.sentinel is None:
            return
        inner = getattr(optimizer, "optimizer", optimizer)      # a LightningOptimizer
        scoped = inner if len(trainer.optimizers) > 1 else None
        try:
            applied = self.sentinel.check_update(trainer.global_step, optimizer=scoped)
        except NonFiniteError as error:
            self._on_finding(trainer, pl_module, inner, error)
            raise
        if not applied:
            self._hold_back(trainer, inner)

    def _hold_back(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        """on_finding="skip": this step's update is left out. The hook runs inside Lightning's
        closure, inside `optimizer.step(closure)` (or before its GradScaler's step), so the
        call itself cannot be left out: its gradients are dropped instead, and a torch
        optimizer skips every parameter whose `grad` is None (no update, no state change, no
        step count). The Sentinel put the buffers back; Lightning goes on as after a step its
        GradScaler skipped (the schedulers and `global_step` as it runs them)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        assert self.sentinel is not None
        self.report = self.sentinel.report
        if self.echo:
            finding = self.report.findings[-1] if self.report is not None else None
            cause = f": {finding.cause}" if finding is not None else ""
            sys.stderr.write(f"nanaudit: skipped the update of step {trainer.global_step}"
                             f"{cause}\n")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """on_finding="skip": the report of every bad step skipped (none raised)."""
        if self.sentinel is None or self.sentinel.bad_steps is None or \
                not self.sentinel.bad_steps.count or self.sentinel.bad_steps.stopped:
            return
        self.report = report = self.sentinel.make_report("nonfinite")
        self._describe(trainer, report)
        self._write(report, None)

    def _describe(self, trainer: Trainer, report: Report) -> None:
        report.config = {"path": None, "api": "lightning.NanauditCallback",
                         "precision": str(trainer.precision),
                         "accumulate_grad_batches": trainer.accumulate_grad_batches,
                         "gradient_clip_val": trainer.gradient_clip_val,
                         "epoch": trainer.current_epoch}

    def _write(self, report: Report, bundle: Callable[[str], Path] | None) -> None:
        """The JSON at `report_path`; the reports in `output_dir`, after `bundle(text)` wrote
        the step's repro bundle there (None: no bundle, the weights have moved on)."""
        from nanaudit.report.formats import renderer_for
        from nanaudit.report.output import write_atomic
        text = renderer_for("json").render(report)
        if self.report_path:
            write_atomic(self.report_path, text)
        if self.output_dir:
            from nanaudit.integrations._output import write_reports
            if bundle is not None:
                report.repro = str(bundle(text))
            write_reports(report, self.output_dir, echo=self.echo)

    def _on_finding(self, trainer: Trainer, pl_module: LightningModule,
                    optimizer: torch.optim.Optimizer, error: NonFiniteError) -> None:
        report = error.report
        finding = report.finding
        self.report = report
        self._describe(trainer, report)
        if finding is not None and finding.batch_index is not None:
            finding.qualify(f"epoch {trainer.current_epoch}, batch_idx {finding.batch_index}, "
                            f"trainer.global_step {trainer.global_step}")
        self._write(report, lambda text: self._bundle(trainer, pl_module, optimizer, report,
                                                      text))

    def _bundle(self, trainer: Trainer, pl_module: LightningModule,
                optimizer: torch.optim.Optimizer, report: Report, text: str) -> Path:
        """The repro bundle of the step the Sentinel stopped at, in `output_dir`."""
        from nanaudit.integrations._output import precision_name, write_step_bundle
        finding = report.finding
        assert self.output_dir is not None, "a bundle is written in output_dir"
        assert self.sentinel is not None and self.sentinel.tripped is not None, \
            "a NonFiniteError comes from the sentinel's trip"
        trip, state = self.sentinel.tripped
        batch_idx = finding.batch_index if finding and finding.batch_index is not None \
            else self._batch_idx
        # Replayed without a Trainer: training_step alone computes the loss, unless it
        # steps the optimizers itself.
        loss = ({"kind": "training_step", "batch_idx": batch_idx}
                if pl_module.automatic_optimization else
                {"why": "training_step steps the optimizers itself (manual optimization), "
                        "which needs the Trainer"})
        return write_step_bundle(
            Path(self.output_dir) / f"repro-step{trip.step}", pl_module, optimizer, trip,
            state, finding, text,
            {"source": "lightning", "module": type(pl_module).__qualname__,
             "batch_index": batch_idx, "loss_label": self.loss_label, "loss_recipe": loss,
             "precision": precision_name(trainer.precision)})


@contextlib.contextmanager
def _manual_replay(model: LightningModule, trainer: Trainer
                   ) -> Iterator[list[torch.Tensor]]:
    """During a manual-optimization replay: `manual_backward` records its loss instead of
    backpropagating, and the optimizers neither step nor zero their gradients."""
    losses: list[torch.Tensor] = []
    model.manual_backward = (   # patched for the replay only
        lambda loss, *args, **kwargs: losses.append(loss))
    wrappers = model.optimizers(use_pl_optimizer=True)
    wrappers = wrappers if isinstance(wrappers, list) else [wrappers]
    patched = []
    for optimizer in list(trainer.optimizers) + wrappers:
        for name in ("step", "zero_grad"):
            patched.append((optimizer, name, optimizer.__dict__.get(name)))
            setattr(optimizer, name, lambda *args, **kwargs: None)
    try:
        yield losses
    finally:
        del model.manual_backward          # back to the class's method
        for optimizer, name, original in patched:
            if original is None:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, original)
