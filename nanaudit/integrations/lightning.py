"""A PyTorch Lightning callback running nanaudit's Sentinel on every optimizer step.

    from nanaudit.integrations.lightning import NanauditCallback
    trainer = lightning.Trainer(callbacks=[NanauditCallback()])

The batch is kept from `on_train_batch_start`, the loss from `on_before_backward`, and the
check runs in `on_before_optimizer_step` (gradients ready, weights not yet updated), so a
non-finite value stops training with `NonFiniteError(report)` before the bad update. The
replay calls the LightningModule's own `training_step`, so the op, module, line and samples are
named as in `nanaudit scan`. With `report_path`, the JSON report is written before raising.
Works with `lightning` and with the older `pytorch_lightning` package.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    from pytorch_lightning.callbacks import Callback


class NanauditCallback(Callback):
    def __init__(self, report_path: str | None = None, isolate_samples: bool = True):
        super().__init__()
        self.report_path = report_path
        self.isolate_samples = isolate_samples
        self._sentinel = None
        self._batch: Any = None
        self._loss = None

    def on_fit_start(self, trainer, pl_module) -> None:
        from nanaudit.sentinel import Sentinel

        def replay_loss(model, batch):
            # Replays call the module's own training_step, as Lightning's loop does.
            return model.training_step(batch, 0)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._sentinel = Sentinel(pl_module, optimizer, loss_fn=replay_loss,
                                  isolate_samples=self.isolate_samples)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._loss = loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from nanaudit.sentinel import NonFiniteError
        if self._sentinel is None or self._loss is None:
            return
        try:
            self._sentinel.check(trainer.global_step, self._batch, self._loss)
        except NonFiniteError as error:
            if self.report_path:
                from nanaudit.output import write_atomic
                from nanaudit.render import renderer_for
                write_atomic(self.report_path, renderer_for("json").render(error.report))
            raise
