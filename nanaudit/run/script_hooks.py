"""The checks `nanaudit run` installs in an unmodified script through PyTorch's global hooks.

Nothing in the script changes. These global hooks, all removed on exit:

* an optimizer step pre-hook: the step's check (the gradients of the parameters this optimizer
  is about to update, its parameters as the previous update left them, the losses that reached
  `backward` and the first module call's floating inputs since the last step) in ONE host read;
  for an optimizer stepped with a closure (Lightning, LBFGS) forward and backward run inside
  `step()`, so the closure is wrapped and the check runs each time it returns, still before the
  update (LBFGS evaluates it up to `max_iter` times a step: the step's timeline entry is its
  first evaluation, and any evaluation may trip, named with its index);
* an optimizer step post-hook: counts the step (the step is the optimizer step, so gradient
  accumulation's micro-batches belong to the step they feed);
* a module forward pre-hook, registered only while waiting for a step's first module call (the
  outermost one) and removed in it, so the rest of the forward keeps PyTorch's hook-free fast
  path;
* `torch.autograd.backward` wrapped (`Tensor.backward` calls it): the scalar reaching it is the
  loss, kept on the device until the step's read;
* `GradScaler.scale` and `GradScaler.step` wrapped: the loss is recorded unscaled, and a step
  the scaler skips (inf gradients) is not a step: its losses and inputs are checked (a NaN
  loss is still a finding, as under `scan`) and dropped;
* `Optimizer.__init__` wrapped to count the optimizers the script builds: a script that builds
  none updates its weights by hand (`p.data.add_(p.grad, alpha=-lr)`), and each backward is
  then its step, checked when backward returns, before the script's own update.

A non-finite value raises ScriptStopped from inside the hook, before the optimizer applies the
update: it unwinds the user's script up to the driver. On a re-run (`rerun_step=N`) the OpTracer
is armed from the outermost module call after step N-1's update to step N's check.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.report.model import TimelineEntry
from nanaudit.run.batch import nonfinite_rows
from nanaudit.run.checks import confirm_nonfinite, exact_norm, finite_norms, value_kind


class ScriptStopped(BaseException):
    """Unwinds the user's script at a non-finite value. A BaseException, so that the script's
    own `except Exception:` does not swallow it (frameworks re-raise BaseExceptions)."""


@dataclass
class ScriptTrip:
    """What the first run saw at the step that tripped (sync allowed: it happens once)."""

    step: int
    check: str                          # input | loss | gradient | optimizer | parameter
    loss: float | None = None
    grad_norm: float | None = None
    value: str = "nan"
    tensors: list = field(default_factory=list)    # bad parameters, or the bad input names
    rows: list | None = None            # input trips: the rows holding the non-finite values
    input_shapes: list = field(default_factory=list)
    optimizer: str = ""                 # the optimizer's class and hyper-parameters
    rank: int | None = None
    skipped: bool = False               # the GradScaler skipped this step's update
    optimizers: int = 1                 # how many optimizers the script stepped so far
    manual: bool = False                # the script updates its weights itself (no optimizer)
    evaluation: int = 0                 # which call of the step's closure (LBFGS: several)
    error: str = ""                     # the script's exception after the value, first line
    where: str = ""                     # error trips: raised in forward or in backward


class ManualUpdate:
    """The script's own update, for a script that builds no torch.optim optimizer: the
    parameters of the modules it called, as one group, in place of an optimizer's."""

    def __init__(self):
        self.param_groups: list = [{"params": []}]


@dataclass
class Armed:
    """The re-run's traced window: the tracer and what the localizer needs from it."""

    tracer: Any
    model: torch.nn.Module
    batch_size: int | None
    sinks: list = field(default_factory=list)       # the loss tensors that reached backward
    closed: bool = False


def _data_inputs(args, kwargs) -> list:
    """The data among a forward's arguments: the floating tensors of the first positional
    argument (a tensor, or a batch dict / tuple) and the floating keyword tensors, leaving out
    masks (a float attention mask holds -inf on purpose)."""
    leaves = tree_flatten(args[0])[0] if args else []
    named = [("input[0]" + (f"[{i}]" if len(leaves) > 1 else ""), t)
             for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    named += [(k, t) for k, t in kwargs.items()
              if isinstance(t, torch.Tensor) and "mask" not in k.lower()]
    return [(n, t) for n, t in named if t.is_floating_point()]


def _caller_kwargs() -> dict:
    """The keyword arguments of the module call running this hook (`model(**batch)`, as the
    Trainer calls it): PyTorch passes global pre-hooks only the positional ones, and this runs
    once per step, not per module."""
    frame = sys._getframe(2)
    if frame is not None and frame.f_code.co_name in ("_call_impl", "inner"):
        kwargs = frame.f_locals.get("kwargs")
        return kwargs if isinstance(kwargs, dict) else {}
    return {}


def _leading_size(args, kwargs) -> int | None:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def _loss_factor(loss: torch.Tensor) -> float | None:
    """The Python number the loss was divided by (or multiplied by the inverse of) just before
    backward, as `loss / accumulation_steps` does; None otherwise. Read from the autograd node's
    saved scalar (a CPU number), never from the device."""
    node = loss.grad_fn
    name = type(node).__name__ if node is not None else ""
    if name not in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        return None
    other = getattr(node, "_saved_other", None)
    if isinstance(other, torch.Tensor):
        if other.numel() != 1 or other.device.type != "cpu" or other.requires_grad:
            return None
        other = float(other)
    if not isinstance(other, (int, float)) or not other or not math.isfinite(other):
        return None
    return float(other) if name.startswith("Div") else 1.0 / float(other)


def window_loss(losses: list, factors: list) -> torch.Tensor:
    """The loss of one optimizer step from the losses that reached backward: their mean, or,
    when each was divided by the number of micro-batches in the window (gradient accumulation
    as nanoGPT, Accelerate, Lightning and the Trainer normalize it), their sum: the micro-
    batches' mean loss as the script computed it before dividing."""
    stacked = torch.stack(losses)
    count = len(losses)
    if count > 1 and all(f is not None and math.isclose(f, count, rel_tol=1e-6)
                         for f in factors):
        return stacked.sum()
    return stacked.mean()


def same_value(a, b) -> bool:
    """Two runs' losses agree: NaN equals NaN, and 1e-4 relative allows a GPU kernel's
    reduction order (a run seeded differently is off by far more)."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-12)


def _kind(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def _hyper(optimizer) -> str:
    if isinstance(optimizer, ManualUpdate):
        return ""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    hyper = ", ".join(f"{k}={group[k]:.4g}" for k in ("lr", "eps", "momentum", "weight_decay")
                      if isinstance(group.get(k), (int, float)))
    return f"{type(optimizer).__name__}({hyper})"


class ScriptAuditor:
    """The hooks of one script run; `install()` / `remove()` (see the module docstring)."""

    def __init__(self, rerun_step: int | None = None, rank: int | None = None,
                 expected_losses: list | None = None, tracer=None, rerun_evaluation: int = 0):
        self.step = 0                    # optimizer steps completed
        # The re-run's instrument (localize's OpTracer), handed in: the cheap path never
        # imports the expensive one.
        self.tracer = tracer
        self.timeline: list[TimelineEntry] = []
        self.trip: ScriptTrip | None = None
        self.rank = rank
        self.rerun_step = rerun_step
        self.rerun_evaluation = rerun_evaluation   # the closure call of step N to trace
        self._evaluation = 0             # closure calls checked in the current step
        self.expected_losses = expected_losses   # the first run's, to stop a re-run that left it
        self.armed: Armed | None = None
        self.localized = None            # set by the re-run at step N: (auditor, optimizer)
        self.host_reads = 0
        self.device = ""
        self._losses: list = []          # 0-dim float64 device tensors since the last check
        self._factors: list = []         # what each was divided by (accumulation), or None
        self._scaled: dict = {}          # id(GradScaler.scale's output) -> (output, its input)
        self._stepped = 0                # optimizer steps taken (post-hook calls), every one
        self.skipped = 0                 # steps a GradScaler skipped (not steps)
        self._scaler_methods: dict = {}  # the GradScaler methods replaced, to restore
        self._original_optimizer_init = None
        self._inputs: list = []          # (name, tensor) of the outermost call's float inputs
        self._input_flags: list = []
        self._names: dict = {}           # id(parameter) -> qualified name
        self._roots: dict = {}           # id -> the modules called first (outermost)
        self._optimizers_made = 0        # torch.optim optimizers the script built
        self._manual = ManualUpdate()    # each backward's step when it built none
        self._optimizers: dict = {}      # id -> optimizer, for the final check
        self._updated_at: dict = {}      # id(optimizer) -> the step of its last update
        self._handles: list = []
        self._forward_handle = None
        self._original_backward = None
        self._in_backward = False
        self._last_check = time.perf_counter()

    # --- installation ------------------------------------------------------------------------

    def install(self) -> ScriptAuditor:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        self._handles = [register_optimizer_step_pre_hook(self._pre_step),
                         register_optimizer_step_post_hook(self._post_step)]
        self._original_backward = torch.autograd.backward
        torch.autograd.backward = self._backward
        self._wrap_grad_scaler()
        self._wrap_optimizer_init()
        self._await_forward()
        return self

    def _wrap_optimizer_init(self) -> None:
        import functools

        from torch.optim import Optimizer
        original_init, auditor = Optimizer.__init__, self

        @functools.wraps(original_init)
        def init(optimizer, *args, **kwargs):
            auditor._optimizer_built()
            return original_init(optimizer, *args, **kwargs)
        self._original_optimizer_init = original_init
        Optimizer.__init__ = init

    def _wrap_grad_scaler(self) -> None:
        """`scale` remembers the unscaled loss; `step` notices a step it skipped. The class's
        methods are replaced (every scaler, `torch.cuda.amp`'s subclass included) and put back
        by remove()."""
        from torch.amp import GradScaler
        original_scale, original_step = GradScaler.scale, GradScaler.step
        auditor = self

        def scale(scaler, outputs):
            scaled = original_scale(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor):
                auditor._scaled[id(scaled)] = (scaled, outputs)
            return scaled

        def step(scaler, optimizer, *args, **kwargs):
            before = auditor._stepped
            result = original_step(scaler, optimizer, *args, **kwargs)
            if auditor._stepped == before and scaler.is_enabled():
                auditor._skipped_step(optimizer, scaler)
            return result
        self._scaler_methods = {"scale": original_scale, "step": original_step}
        GradScaler.scale, GradScaler.step = scale, step

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        if self._original_backward is not None:
            torch.autograd.backward = self._original_backward
            self._original_backward = None
        if self._original_optimizer_init is not None:
            from torch.optim import Optimizer
            Optimizer.__init__ = self._original_optimizer_init
            self._original_optimizer_init = None
        if self._scaler_methods:
            from torch.amp import GradScaler
            GradScaler.scale = self._scaler_methods["scale"]
            GradScaler.step = self._scaler_methods["step"]
            self._scaler_methods = {}
        self._scaled.clear()
        self._disarm()

    def _await_forward(self) -> None:
        if self._forward_handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook
            self._forward_handle = register_module_forward_pre_hook(self._first_call)

    # --- hooks --------------------------------------------------------------------------------

    def _first_call(self, module, args):
        """The first module call after a step or a backward: the outermost one of a forward.
        A call without autograd (an evaluation under `no_grad` or `inference_mode` between two
        steps) is not the training forward: keep waiting, so that neither the input check nor
        the re-run's traced window is spent on it. Nor is a module without parameters: a data
        transform the DataLoader calls on each sample (torchvision's `Normalize` is an
        nn.Module) runs before the model, on one sample, and trains nothing."""
        if not torch.is_grad_enabled() or next(module.parameters(), None) is None:
            return
        kwargs = _caller_kwargs()
        self._forward_handle.remove()
        self._forward_handle = None
        if id(module) not in self._roots:
            self._roots[id(module)] = module
            for name, p in module.named_parameters():
                self._names.setdefault(id(p), name)
        if self.armed is None and self._at_rerun_step():
            self._arm(module, args, kwargs)
            return
        if self.armed is not None:
            return
        inputs = _data_inputs(args, kwargs)
        if inputs:
            self._inputs = inputs
            self._input_flags.append(torch.stack([torch.isfinite(t).all()
                                                  for _, t in inputs]).all())

    def _backward(self, tensors, *args, **kwargs):
        loss = tensors if isinstance(tensors, torch.Tensor) else None
        scaled, self._scaled = self._scaled, {}
        if loss is not None and loss.numel() == 1 and loss.is_floating_point():
            # `scaler.scale(loss).backward()`: the loss, not loss x the loss scale.
            unscaled = scaled.get(id(loss), (None, loss))[1]
            if self.armed is not None:
                self.armed.sinks.append(unscaled)   # no ops of ours inside the traced window
            else:
                self._losses.append(unscaled.detach().reshape(()).to(torch.float64))
                self._factors.append(_loss_factor(unscaled))
        if self.armed is not None:
            self.armed.tracer.start_backward()
        self._in_backward = True
        try:
            result = self._original_backward(tensors, *args, **kwargs)
            self._in_backward = False     # left set when backward raises: where it raised
        finally:
            if self.armed is not None:
                # Gradient accumulation: the next micro-batch's forward is a forward again.
                self.armed.tracer.phase = "forward"
            self._await_forward()
        if not self._optimizers_made and self._roots:
            self._check_manual()
        return result

    def _check_manual(self) -> None:
        """A script without an optimizer: this backward was its step; check it before the
        script applies its own update, then count the step as an optimizer's post-hook does."""
        seen, params = set(), []
        for module in self._roots.values():
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self._manual.param_groups[0]["params"] = params
        self._check(self._manual)
        self._post_step(self._manual, (), {})

    def _optimizer_built(self) -> None:
        """An optimizer after backward calls already checked as steps: those were not training
        steps of an optimizer (a warm-up, a gradient-based init): number the steps afresh."""
        self._optimizers_made += 1
        if self._optimizers_made == 1 and self.step and self.trip is None and self.armed is None:
            self.step, self._stepped = 0, 0
            self.timeline.clear()
            self._updated_at.clear()
            self._optimizers.pop(id(self._manual), None)

    def _at_rerun_step(self) -> bool:
        return (self.rerun_step is not None and self.step == self.rerun_step
                and self._evaluation == self.rerun_evaluation)

    def _pre_step(self, optimizer, args, kwargs):
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        self._evaluation = 0
        if closure is None:
            self._check(optimizer)
            return None

        def checked_closure(*c_args, **c_kwargs):
            result = closure(*c_args, **c_kwargs)
            evaluation = self._evaluation
            self._check(optimizer, evaluation)
            self._evaluation = evaluation + 1
            return result
        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked_closure}
        return (args[0], checked_closure, *args[2:]), kwargs

    def _post_step(self, optimizer, args, kwargs):
        self._stepped += 1
        self._updated_at[id(optimizer)] = self.step
        self.step += 1
        self._await_forward()

    # --- the check ----------------------------------------------------------------------------

    def _check(self, optimizer, evaluation: int = 0) -> None:
        """One host read: [inputs finite, parameter norm, mean loss, gradient norm]. A closure's
        later evaluations in the same step (LBFGS) are checked but add no timeline entry."""
        self._optimizers[id(optimizer)] = optimizer
        if self._at_rerun_step():
            self._disarm()
            self.localized = optimizer
            raise ScriptStopped()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            return
        device = params[0].device
        self.device = str(device)
        grads = [p.grad.detach() for p in params if p.grad is not None]
        state, gnorm = finite_norms([[p.detach() for p in params], grads], device)
        loss = (window_loss([v.to(device) for v in self._losses], self._factors) if self._losses
                else torch.zeros((), dtype=torch.float64, device=device))
        inputs_ok = (torch.stack([f.to(device) for f in self._input_flags]).all()
                     if self._input_flags else torch.ones((), dtype=torch.bool, device=device))
        ok, norm, loss_value, grad_norm = torch.stack(
            [inputs_ok.to(torch.float64), state, loss, gnorm]).tolist()
        self.host_reads += 1
        had_loss = bool(self._losses)
        self._losses, self._factors, self._input_flags = [], [], []
        inputs, self._inputs = self._inputs, []
        if not math.isfinite(grad_norm) and not confirm_nonfinite(grads):
            grad_norm = exact_norm(grads)      # a float32 sum of squares overflowed: finite
        if not math.isfinite(norm) and not confirm_nonfinite(params):
            norm = exact_norm(params)
        now = time.perf_counter()
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        entry = TimelineEntry(
            step=self.step, loss=loss_value if had_loss else None, grad_norm=grad_norm,
            param_norm=norm, lr=float(lr) if isinstance(lr, (int, float)) else None,
            time_ms=round((now - self._last_check) * 1000, 3))
        if evaluation == 0:
            self.timeline.append(entry)
            self._last_check = now
            if self._left_first_run(loss_value if had_loss else None):
                raise ScriptStopped()      # a re-run that already differs: no use going on
        trip = self._classify(optimizer, ok, norm, loss_value if had_loss else 0.0, grad_norm,
                              params, inputs)
        if trip is not None:
            trip.evaluation = evaluation
            if evaluation:
                self.timeline[-1] = entry  # the step shows the evaluation that went bad
            self.trip = trip
            raise ScriptStopped()

    def _skipped_step(self, optimizer, scaler) -> None:
        """The GradScaler skipped this step's update (its gradients held inf or NaN): not a
        step and not a finding, unless the loss or the inputs were non-finite already (then
        the forward made the value, not the loss scale, and every later step would be skipped
        too). One host read, on skipped steps only; the step's losses and inputs are dropped."""
        if self.armed is not None:
            # The re-run inside step N's window: this try of step N is the bad one if its loss
            # is; a clean skip is traced again from the next forward.
            self._disarm()
            if any(not bool(torch.isfinite(s.detach()).all()) for s in self.armed.sinks):
                self.localized = optimizer
                raise ScriptStopped()
            self.armed = None
            self._await_forward()
            return
        self._optimizers[id(optimizer)] = optimizer
        self.skipped += 1
        losses, factors, flags = self._losses, self._factors, self._input_flags
        inputs = self._inputs
        self._losses, self._factors, self._input_flags, self._inputs = [], [], [], []
        if not losses and not flags:
            return
        device = (losses or flags)[0].device
        loss = (window_loss([v.to(device) for v in losses], factors) if losses
                else torch.zeros((), dtype=torch.float64, device=device))
        inputs_ok = (torch.stack([f.to(device) for f in flags]).all() if flags
                     else torch.ones((), dtype=torch.bool, device=device))
        ok, loss_value = torch.stack([inputs_ok.to(torch.float64), loss]).tolist()
        self.host_reads += 1
        if ok >= 1.0 and math.isfinite(loss_value):
            return
        if self.rerun_step is not None and self.step == self.rerun_step:
            self.localized = optimizer         # step N reached, but nothing was armed
            raise ScriptStopped()
        now = time.perf_counter()
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        self.timeline.append(TimelineEntry(
            step=self.step, loss=loss_value if losses else None, grad_norm=None,
            param_norm=None, lr=float(lr) if isinstance(lr, (int, float)) else None,
            time_ms=round((now - self._last_check) * 1000, 3), skipped=True,
            scale=float(scaler.get_scale())))
        self._last_check = now
        if ok < 1.0:
            trip = self._input_trip(inputs, loss_value, None)
        else:
            trip = self._trip("loss", _kind(loss_value), [], loss=loss_value)
        trip.skipped = True
        trip.optimizer = _hyper(optimizer)
        self.trip = trip
        raise ScriptStopped()

    def _left_first_run(self, loss) -> bool:
        expected = self.expected_losses
        if expected is None or self.step >= len(expected):
            return False
        return not same_value(expected[self.step], loss)

    def _classify(self, optimizer, ok, norm, loss, grad_norm, params, inputs):
        step, name = self.step, self._name
        if ok < 1.0:
            return self._input_trip(inputs, loss, grad_norm)
        if not math.isfinite(norm):
            bad = [p for p in params if not bool(torch.isfinite(p).all())]
            updated = self._updated_at.get(id(optimizer))
            check = "optimizer" if updated is not None else "parameter"
            trip = self._trip(check, value_kind(bad[0]), [name(p) for p in bad])
            trip.step = updated if updated is not None else step
            trip.optimizer = _hyper(optimizer)
            return trip
        bad = [p for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        trip = None
        if not math.isfinite(loss):
            trip = self._trip("loss", _kind(loss), [name(p) for p in bad], loss=loss,
                              grad_norm=grad_norm)
        elif not math.isfinite(grad_norm):
            trip = self._trip("gradient", value_kind(bad[0].grad), [name(p) for p in bad],
                              loss=loss, grad_norm=grad_norm)
        if trip is not None:
            trip.optimizer = _hyper(optimizer)
        return trip

    def _input_trip(self, inputs, loss, grad_norm) -> ScriptTrip:
        bad = [(n, t) for n, t in inputs if not bool(torch.isfinite(t).all())]
        rows = sorted({r for _, t in bad for r in nonfinite_rows(t, 0 if t.dim() else None)})
        return self._trip("input", value_kind(bad[0][1]) if bad else "nan",
                          [n for n, _ in bad], rows=rows, loss=loss, grad_norm=grad_norm,
                          input_shapes=[list(t.shape) for _, t in bad])

    def _trip(self, check, value, tensors, **fields) -> ScriptTrip:
        return ScriptTrip(step=self.step, check=check, value=value, tensors=tensors,
                          rank=self.rank, optimizers=len(self._optimizers),
                          manual=not self._optimizers_made, **fields)

    def _name(self, p) -> str:
        return self._names.get(id(p), f"<parameter {tuple(p.shape)}>")

    def finish(self) -> None:
        """After the script returned: the parameters the last updates left (one read)."""
        tensors = [p for opt in self._optimizers.values()
                   for group in opt.param_groups for p in group["params"]]
        if not tensors:
            return
        self.host_reads += 1
        if math.isfinite(finite_norms([[p.detach() for p in tensors]], tensors[0].device)[0]
                         .item()) or not confirm_nonfinite(tensors):
            return
        for opt in self._optimizers.values():
            bad = [p for group in opt.param_groups for p in group["params"]
                   if not bool(torch.isfinite(p).all())]
            if bad:
                self.trip = self._trip("optimizer", value_kind(bad[0]),
                                       [self._name(p) for p in bad])
                self.trip.step = self._updated_at.get(id(opt), self.step - 1)
                self.trip.optimizer = _hyper(opt)
                return

    def after_error(self, exc: BaseException) -> ScriptTrip | None:
        """The script raised: was a non-finite value behind it? First the parameters the last
        updates left (an update to NaN that a later op then refused), then the tensors in the
        exception's frames (BCELoss refusing a NaN input, a distribution's argument check, the
        script's own `if loss.isnan(): raise`). Once, at the error: a read per tensor is fine."""
        if self.trip is not None or self.armed is not None:
            return self.trip
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.finish()
        if self.trip is not None:
            self.trip.error = f"{type(exc).__name__}: {first}"
            return self.trip
        bad = nonfinite_locals(exc)
        if not bad:
            return None
        self.trip = self._trip("error", bad[0][1], [name for name, _ in bad],
                               error=f"{type(exc).__name__}: {first}",
                               where="backward" if self._in_backward else "forward")
        return self.trip

    # --- the re-run's traced window -------------------------------------------------------------

    def _arm(self, module, args, kwargs) -> None:
        tracer = self.tracer(module)
        self.armed = Armed(tracer, module, _leading_size(args, kwargs))
        tracer.__enter__()

    def _disarm(self) -> None:
        if self.armed is not None and not self.armed.closed:
            self.armed.closed = True
            self.armed.tracer.__exit__(None, None, None)

    @property
    def optimizer_count(self) -> int:
        """The optimizers the script stepped (its own update counts as one)."""
        return len(self._optimizers)

    def parameter_name(self, p) -> str:
        return self._name(p)


def nonfinite_locals(exc: BaseException, limit: int = 32) -> list:
    """[(description, kind)] of the floating tensors holding NaN or Inf among the local
    variables of the frames an exception passed through, innermost first (the op that raised
    is closest to the bad value), nanaudit's own frames left out; at most `limit` checked."""
    import os
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen, bad, checked = set(), [], 0
    for frame in reversed(frames):
        path = frame.f_code.co_filename
        if os.path.abspath(path).startswith(ours + os.sep):
            continue
        for name, value in frame.f_locals.items():
            if (not isinstance(value, torch.Tensor) or id(value) in seen or value.is_sparse
                    or value.device.type == "meta" or not value.numel()
                    or not (value.is_floating_point() or value.is_complex())):
                continue
            seen.add(id(value))
            if checked >= limit:
                return bad
            checked += 1
            if not bool(torch.isfinite(value.detach()).all()):
                where = f"{frame.f_code.co_name} ({os.path.basename(path)}:{frame.f_lineno})"
                bad.append((f"`{name}` in {where}", value_kind(value.detach())))
    return bad
