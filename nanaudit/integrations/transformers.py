"""A Hugging Face `transformers` TrainerCallback running nanaudit's Sentinel on every step.

    from nanaudit.integrations.transformers import NanauditCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[NanauditCallback()])
    trainer.train()            # raises nanaudit.NonFiniteError(report) before a bad update

What the callback API does not expose, it takes with one reversible wrap: at `on_train_begin`
it finds the Trainer (the frame that called the hook) and wraps that instance's
`compute_loss`, so each micro-batch's inputs (after `_prepare_inputs`, as a dict), the RNG
state right before its forward, `num_items_in_batch` and the loss are recorded without a host
read. `on_pre_optimizer_step` (after the Trainer's `max_grad_norm` clipping and, under fp16,
its unscaling; before `optimizer.step()`) runs one check over the whole
`gradient_accumulation_steps` window: one host read per optimizer step. `on_train_end`
removes the wrap.

On a trip the step is replayed through the Trainer's own `compute_loss` (your override or
`compute_loss_func` included) with the batch, RNG state and weights of that step, under its
autocast; the console, JSON and Markdown reports and the step's repro bundle (weights, RNG
state, batch, offending rows, repro.py; the model rebuilt from its class and config, the loss
as the Trainer's default computes it) go to `<args.output_dir>/nanaudit/`. Then, with
`on_finding="raise"` (the default), `NonFiniteError` propagates out of `trainer.train()`; with
`"stop"`, the step's gradients are dropped (the optimizer step updates nothing),
`control.should_training_stop` ends training, and `callback.report` / `callback.exit_code` (1)
tell the caller.

Step numbers: `step` is `state.global_step` at the check (the 0-based optimizer step);
`batch_index` counts the micro-batches fed to training since `train()` began (0-based);
`micro_batch` is the position in the accumulation window. Under fp16 the accelerator's
GradScaler is the Sentinel's scaler: a skipped step is not a finding unless the scale collapses.

With `on_finding="skip"` (and `max_bad_steps`, default 10) a bad step is skipped and training
goes on: the Sentinel localizes it and puts the buffers back, and the Trainer's one
`optimizer.step()` of that step does nothing (held_step.py). The Trainer then handles it as
it handles a step its GradScaler skipped: the learning-rate scheduler is not stepped (as
DeepSpeed and Megatron do for a skipped step), `global_step` still counts it, the gradients
are zeroed as usual. Each bad step is a finding of `callback.report` (`findings`), written to
`<output_dir>/nanaudit/` at the end of training (exit_code 1). When skipping cannot help
(`max_bad_steps` reached, or weights already non-finite) that step is held back too and
training stops, as with "stop".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from nanaudit.errors import delegates
from nanaudit.integrations.held_step import HeldStep
from nanaudit.report.bad_steps import MAX_BAD_STEPS
from nanaudit.run.compiled import find_compiled

if TYPE_CHECKING:
    from nanaudit.integrations.sentinel import Sentinel
    from nanaudit.report.model import Report


class NanauditCallback(TrainerCallback):
    def __init__(self, output_dir: str | None = None, on_finding: str = "raise",
                 isolate_samples: bool = True, max_skipped: int = 10, scale_floor: float = 1.0,
                 echo: bool = True, trainer: Trainer | None = None,
                 max_bad_steps: int = MAX_BAD_STEPS):
        if on_finding not in ("raise", "stop", "skip"):
            raise ValueError(f"on_finding must be 'raise', 'stop' or 'skip', not {on_finding!r}")
        self.output_dir = output_dir
        self.on_finding = on_finding
        self.max_bad_steps = max_bad_steps
        self._held: HeldStep | None = None
        self.isolate_samples = isolate_samples
        self.max_skipped, self.scale_floor = max_skipped, scale_floor
        self.echo = echo
        self.trainer = trainer
        self.sentinel: Sentinel | None = None
        self.report: Any = None
        self.exit_code = 0
        self._batches_seen = 0
        self._num_items: Any = None
        self._loss_model: torch.nn.Module | None = None
        self._original: Callable[..., Any] | None = None

    # --- setup ------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        from nanaudit.integrations.sentinel import Sentinel
        trainer = _calling_trainer() or self.trainer
        if trainer is None:
            raise RuntimeError("NanauditCallback: no transformers.Trainer called on_train_begin; "
                               "pass it as NanauditCallback(trainer=trainer)")
        self.trainer = trainer
        # What a finding names for ops outside every submodule: the Trainer's loss computation.
        self.loss_label = f"{type(trainer).__qualname__}.compute_loss"
        # `torch_compile=True`: the compiled model, so that a step finite eagerly is replayed
        # compiled too (the Trainer's own names are the user's either way).
        wrapped = getattr(trainer, "model_wrapped", None)
        model = wrapped if find_compiled(wrapped) is not None else trainer.model
        assert model is not None, "a Trainer that calls on_train_begin holds its model"
        self.sentinel = Sentinel(model, trainer.optimizer, loss_fn=self._replay_loss,
                                 scaler=getattr(trainer.accelerator, "scaler", None),
                                 isolate_samples=self.isolate_samples,
                                 max_skipped=self.max_skipped, scale_floor=self.scale_floor,
                                 on_finding="skip" if self.on_finding == "skip" else "raise",
                                 max_bad_steps=self.max_bad_steps)
        self._batches_seen = 0
        self._wrap_compute_loss(trainer)

    def _unwrap(self) -> None:
        if self.trainer is not None and "compute_loss" in self.trainer.__dict__:
            del self.trainer.compute_loss        # back to the class's method

    def _wrap_compute_loss(self, trainer: Trainer) -> None:
        self._unwrap()
        original = trainer.compute_loss          # the bound method (a user override included)
        self._original = original
        callback = self

        @delegates
        def compute_loss(model: torch.nn.Module, inputs: dict[str, Any], *args: Any,
                         **kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                return original(model, inputs, *args, **kwargs)      # evaluation
            batch = dict(inputs)                 # BatchEncoding -> dict; compute_loss pops labels
            callback._num_items = kwargs.get("num_items_in_batch")
            callback._loss_model = model
            sentinel = callback.sentinel
            assert sentinel is not None, "compute_loss is wrapped in on_train_begin"
            sentinel.capture_rng()
            out = original(model, inputs, *args, **kwargs)
            loss = out[0] if isinstance(out, tuple) else out
            sentinel.micro_batch(batch, loss, index=callback._batches_seen)
            callback._batches_seen += 1
            return out
        # An instance attribute shadows the class's method: the wrap `_unwrap` deletes.
        trainer.compute_loss = compute_loss

    def _replay_loss(self, model: torch.nn.Module, batch: Any) -> Any:
        """The Trainer's own compute_loss on the recorded inputs, under its autocast."""
        trainer = self.trainer
        assert trainer is not None and self._original is not None, \
            "a replay runs after on_train_begin"
        kwargs = {}
        if self._num_items is not None:
            kwargs["num_items_in_batch"] = self._num_items
        with trainer.compute_loss_context_manager():
            loss_model = self._loss_model if self._loss_model is not None else model
            return self._original(loss_model, dict(batch), **kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._unwrap()
        if self.sentinel is None or self.report is not None:
            return
        from nanaudit.integrations._output import write_reports
        bad = self.sentinel.bad_steps
        if bad is not None and bad.count:
            # Every bad step was skipped: the report lists them; no bundle (the weights have
            # moved on since those steps).
            self._write(args, state, self.sentinel.make_report("nonfinite"), with_bundle=False)
        else:
            write_reports(self.sentinel.make_report("clean"), self._folder(args), echo=False)

    # --- the check --------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        from nanaudit.integrations.sentinel import NonFiniteError
        if self.sentinel is None:
            return
        assert self.trainer is not None and self.trainer.model is not None
        try:
            if not self.sentinel.check_update(state.global_step):
                # Skipped (on_finding="skip"): the Sentinel put the buffers back.
                self._held = HeldStep.hold(self.trainer)
        except NonFiniteError as error:
            self._write(args, state, error.report)
            if self.on_finding == "raise":
                self._unwrap()                   # on_train_end does not run after a raise
                raise
            if self.on_finding == "skip":
                self._held = HeldStep.hold(self.trainer)    # skipping cannot help: stop
            else:
                for p in self.trainer.model.parameters():
                    p.grad = None                # the optimizer step updates nothing
            control.should_training_stop = True
            if self.echo:
                sys.stderr.write(f"nanaudit: training stopped before the update of step "
                                 f"{state.global_step}; see {self._folder(args)}\n")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._held is not None:
            self._held.release()         # the Trainer has read that the step was skipped
            self._held = None

    def _folder(self, args: TrainingArguments) -> Path:
        # TrainingArguments.__post_init__ always sets output_dir (default "trainer_output").
        return Path(self.output_dir or cast(str, args.output_dir)) / "nanaudit"

    def _write(self, args: TrainingArguments, state: TrainerState, report: Report,
               with_bundle: bool = True) -> None:
        from nanaudit.integrations._output import write_reports, write_step_bundle
        from nanaudit.report.formats import renderer_for
        self.report, self.exit_code = report, 1
        report.config = {"path": None, "api": "transformers.NanauditCallback",
                         "gradient_accumulation_steps": args.gradient_accumulation_steps,
                         "fp16": args.fp16, "bf16": args.bf16,
                         "max_grad_norm": args.max_grad_norm, "epoch": state.epoch}
        folder = self._folder(args)
        if not with_bundle:
            write_reports(report, folder, echo=self.echo)
            return
        trainer, sentinel = self.trainer, self.sentinel
        assert trainer is not None and trainer.model is not None, "on_train_begin found it"
        assert sentinel is not None and sentinel.tripped is not None, \
            "a report is written for a step the Sentinel tripped on"
        trip, step_state = sentinel.tripped
        bundle = write_step_bundle(
            folder / f"repro-step{trip.step}", trainer.model, trainer.optimizer, trip,
            step_state, report.finding, renderer_for("json").render(report),
            {"source": "transformers", "loss_label": self.loss_label,
             "loss_recipe": _loss_recipe(trainer, self._num_items),
             "precision": "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
             "num_items_in_batch": _plain_number(self._num_items),
             "batch_index": getattr(report.finding, "batch_index", None)})
        report.repro = str(bundle)
        write_reports(report, folder, echo=self.echo)


def _loss_recipe(trainer: Trainer, num_items: torch.Tensor | int | None) -> dict[str, Any]:
    """How the bundle computes the loss without the Trainer: Trainer.compute_loss's default
    path (the model's loss, or your importable `compute_loss_func`), else why it cannot."""
    from nanaudit.integrations._output import callable_target
    if type(trainer).compute_loss is not Trainer.compute_loss:
        return {"why": f"{type(trainer).__qualname__} overrides compute_loss"}
    if trainer.label_smoother is not None:
        return {"why": "the Trainer smooths the labels (label_smoothing_factor)"}
    target = None
    if trainer.compute_loss_func is not None:
        target, why = callable_target(trainer.compute_loss_func)
        if target is None:
            return {"why": f"the Trainer's compute_loss_func cannot be imported: {why}"}
    return {"kind": "hf-trainer", "compute_loss_func": target,
            "model_accepts_loss_kwargs": bool(getattr(trainer, "model_accepts_loss_kwargs",
                                                      False)),
            "num_items_in_batch": _plain_number(num_items)}


def _calling_trainer() -> Trainer | None:
    """The Trainer whose training loop called the hook (found once, at on_train_begin)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _plain_number(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
