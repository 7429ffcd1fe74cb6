"""Early warnings: near-overflow activations and growth on the timeline, before any NaN.

Three detectors, none of which adds a host sync:
  ActivationWatch  forward hooks take |max| of every module output on sampled steps; the maxima
                   ride along in the step's one readout and are compared on the host against
                   the output dtype's largest value (65504 in float16).
  UpdateWatch      every `update_every` steps, |theta_after - theta_before| / |theta_before|
                   (Cockpit's update-to-weight ratio); the snapshot is transient, taken and
                   freed within the step, and the norm is read with the next step's readout.
  GrowthWatch      host-only, over values the readout already brought back: loss spikes
                   against a running window (like Lightning's SpikeDetection) and a gradient
                   norm growing geometrically.
Each warning names the step it was seen at and the step its growth began. And, told by `run`
once a run each (`TimelineWarnings.once`): a step whose finite gradients a float32 reduction
of the script's tooling overflowed on, so that its update was dropped without any NaN
(`clip_grad_norm_`'s total norm, DeepSpeed's overflow check): a near-overflow of no module.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections import deque
from functools import partial
from typing import Any

import torch

from nanaudit.config.schema import WatchOptions
from nanaudit.report.model import EarlyWarning, TimelineEntry
from nanaudit.report.vocabulary import WarningKind
from nanaudit.run.checks import ParamPack, finite_norm
from nanaudit.run.names import user_named

MAX_WARNINGS = 50
_STEP = operator.attrgetter("step")
SQUARES_OVERFLOW = math.sqrt(torch.finfo(torch.float32).max)   # |x| whose square is inf


def clip_overflow_warning(step: int, clip: str = "`clip_grad_norm_`") -> EarlyWarning:
    """`clip_grad_norm_` returned a non-finite total for gradients it left finite: its float32
    sum of squares overflowed, its clip coefficient max_norm / inf is 0, so every gradient it
    scaled is 0 and the update moved nothing (plain SGD) or only by momentum."""
    return EarlyWarning(
        kind=WarningKind.NEAR_OVERFLOW, step=step, began=step, threshold=SQUARES_OVERFLOW,
        message=(f"{clip} returned a non-finite total norm at step {step} for "
                 f"gradients that were finite: a float32 sum of their squares overflowed (one "
                 f"gradient above {SQUARES_OVERFLOW:.3g} is enough), so it scaled every gradient "
                 f"to 0 and the step's update learned nothing from them"))


def zero_skip_warning(step: int, grad_norm: float) -> EarlyWarning:
    """DeepSpeed skipped a step whose gradients were finite (fp32, bf16 or a static scale): its
    overflow check sums each gradient partition in float32, which large finite values
    overflow."""
    return EarlyWarning(
        kind=WarningKind.NEAR_OVERFLOW, step=step, began=step, value=grad_norm,
        message=(f"DeepSpeed skipped the update of step {step}: its overflow check (a float32 "
                 f"sum of each gradient partition) came out non-finite, yet every gradient was "
                 f"finite (their norm {grad_norm:.4g}): gradients this large overflow a float32 "
                 f"sum, and the weights did not change"))


class ActivationWatch:
    """|max| of module outputs on every `every`-th step, against the output dtype's range."""

    def __init__(self, model: torch.nn.Module, every: int, fraction: float):
        self.every, self.fraction = every, fraction
        self.active = False
        self.maxima: list[torch.Tensor] = []
        self.labels: list[tuple[str, torch.dtype]] = []
        self._seen: dict[int, weakref.ref] = {}
        self.warned: set[str] = set()
        self.handles = []
        if every:
            root = type(model).__name__
            self.handles = [module.register_forward_hook(partial(self._hook, name or root))
                            for name, module in user_named(model, model.named_modules())]

    def begin(self, step: int) -> None:
        self.active = bool(self.every) and step % self.every == 0
        if self.active or self.maxima:
            self.maxima, self.labels, self._seen = [], [], {}

    def _hook(self, name: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self.active:
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            # A container returns its last child's tensor: measure each tensor once per step.
            # By identity through a weak reference, not by id alone: an output no backward
            # keeps (a norm's before a dropout) is freed within the forward, and a later
            # module's output may be given its id (which skipped it, by the heap's state).
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
                    and not self._measured(t)):
                self._seen[id(t)] = weakref.ref(t)
                self.maxima.append(t.detach().abs().amax().float())
                self.labels.append((name, t.dtype))

    def _measured(self, t: torch.Tensor) -> bool:
        ref = self._seen.get(id(t))
        return ref is not None and ref() is t

    def pending(self) -> torch.Tensor | None:
        """The step's maxima as one tensor for the readout (None when not sampled)."""
        self.active = False
        return torch.stack(self.maxima) if self.maxima else None

    def observe(self, step: int, values: list[float]) -> tuple[float | None, float | None, list]:
        """(largest |activation|, its fraction of its dtype's max, new warnings)."""
        best, best_ratio, warnings = None, None, []
        for (name, dtype), value in zip(self.labels, values):
            if not math.isfinite(value):
                continue   # a non-finite output is the sentinels' business, not a warning
            limit = torch.finfo(dtype).max
            ratio = value / limit
            if best_ratio is None or ratio > best_ratio:
                best, best_ratio = value, ratio
            if ratio >= self.fraction and name not in self.warned:
                self.warned.add(name)
                dtype_name = str(dtype).replace("torch.", "")
                warnings.append(EarlyWarning(
                    kind=WarningKind.NEAR_OVERFLOW, step=step, began=step, module=name,
                    value=value,
                    threshold=self.fraction * limit,
                    message=(f"the output of {name} reached |{value:.6g}|, {ratio:.0%} of "
                             f"{dtype_name}'s largest value {limit:.6g}")))
        return best, best_ratio, warnings

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class UpdateWatch:
    """The update-to-weight ratio on sampled steps, from a snapshot freed within the step."""

    def __init__(self, params: list[torch.Tensor], every: int, device: Any) -> None:
        self.params = [p.detach() for p in params if p.is_floating_point()]
        self.every, self.device = (every if self.params else 0), device
        # CUDA copies a tensor list in a few fused kernels; on the CPU, where a kernel per
        # tensor is what a small step feels, the small parameters are copied as one.
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        self._pack = ParamPack(self.params) if on_cpu and self.params else None
        self._snapshot: list[torch.Tensor] | None = None
        self._base = 0.0                  # the weights' norm before the sampled update
        self.pending_step: int | None = None
        self.pending_base = 0.0
        self.pending_norm: torch.Tensor | None = None

    def measure(self, step: int, apply: Any, weight_norm: Any) -> None:
        """Run the update (`apply()`); on a sampled step, between a snapshot of the weights
        and its difference. `weight_norm()`: their norm before it (computed only then)."""
        if not (self.every and step % self.every == 0):
            apply()
            return
        self.before_update(step, weight_norm())
        apply()
        self.after_update()

    def before_update(self, step: int, weight_norm: Any) -> None:
        # The parameters are detached aliases: no autograd bookkeeping to switch off.
        self._base = weight_norm
        self._snapshot = (self._pack.snapshot() if self._pack is not None
                          else list(torch._foreach_mul(self.params, 1.0)))
        self.pending_step = step

    def after_update(self) -> None:
        if self._snapshot is None:
            return
        # In place on the snapshot (before - after has the update's norm): one copy, not two.
        if self._pack is not None:
            self._pack.subtract_from(self._snapshot)
        else:
            torch._foreach_sub_(self._snapshot, self.params)
        self.pending_norm = finite_norm(self._snapshot, self.device)
        self.pending_base = self._base
        self._snapshot = None

    def take(self) -> tuple[int | None, torch.Tensor | None, float | torch.Tensor]:
        """The pending (step, update norm, weight norm before it) for the next readout."""
        step, norm, base = self.pending_step, self.pending_norm, self.pending_base
        self.pending_step = self.pending_norm = None
        return (step, norm, base) if norm is not None else (None, None, 0.0)


SPIKE_SIGMAS = 6.0     # a jump inside the loss's own noise is not a spike
SPIKE_FLOOR = 1e-3     # ... nor one below this fraction of the loss's starting magnitude


def _mean(values: Any) -> float:
    return math.fsum(values) / len(values)


def _noise(values: Any) -> float:
    """The standard deviation of the values' noise, from successive differences (von Neumann),
    so that a steady trend (a loss still falling, or growing geometrically) is not noise."""
    diffs = [b - a for a, b in zip(values, list(values)[1:])]
    if len(diffs) < 2:
        return 0.0
    # Plain floats: statistics.pstdev is exact (Fractions) and costs 0.2 ms a step here.
    mean = math.fsum(diffs) / len(diffs)
    return math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / len(diffs)) / math.sqrt(2)


class GrowthWatch:
    """Loss spikes and geometric gradient growth, from the timeline's values (host only)."""

    def __init__(self, options: WatchOptions):
        self.options = options
        self.losses: deque = deque(maxlen=options.spike_window)
        self._reference: list[float] = []   # |loss| over the first window: its own scale
        self._in_spike = False
        self._run_start: tuple[int, float] = (0, 0.0)   # set at the first gradient norm
        self._run = 0
        self._prev_gnorm: float | None = None
        self._warned_run = False
        self._update_high = False

    def observe(self, step: int, loss: float | None, grad_norm: float | None) -> list:
        spikes = self._spike(step, loss) if loss is not None and math.isfinite(loss) else []
        if grad_norm is not None and math.isfinite(grad_norm):
            growth = self._growth(step, grad_norm)
            return spikes + growth if growth else spikes
        return spikes

    def _spike(self, step: int, loss: float) -> list:
        """A loss above the window's level by more than its own noise and scale allow.

        Lightning's SpikeDetection compares the jump with `rtol * mean` only, which calls any
        noise a spike when the mean is near zero (its users add an `atol` by hand). Here the
        jump must exceed `rtol` times the level, SPIKE_SIGMAS standard deviations of the
        window's noise, and SPIKE_FLOOR of the loss's starting magnitude (a change that small
        cannot diverge). A positive loss is judged on a log scale, where its noise is
        multiplicative: a loss near zero that wanders by factors of two is noise, not a spike."""
        rtol = self.options.loss_spike
        found: list[EarlyWarning] = []
        if len(self._reference) < self.options.spike_window:
            self._reference.append(abs(loss))
        if rtol and len(self.losses) >= min(5, self.options.spike_window):
            # The threshold is never below the window's minimum (times 1 + rtol for a
            # positive loss, judged on its log scale): a loss under that bound is no spike,
            # which spares most steps the noise estimate.
            low = min(self.losses)
            if loss <= (low * (1 + rtol) if low > 0 else low):
                self._in_spike = False
                self.losses.append(loss)
                return found
            threshold = self._spike_threshold(rtol)
            spiking = loss > threshold
            if spiking and not self._in_spike:
                mean = _mean(self.losses)
                found.append(EarlyWarning(
                    kind=WarningKind.LOSS_SPIKE, step=step, began=step, value=loss,
                    threshold=threshold,
                    message=(f"the loss jumped to {loss:.6g} against a mean of {mean:.6g} over "
                             f"the last {len(self.losses)} steps (above {threshold:.6g}, the "
                             f"window's level plus its noise)")))
            self._in_spike = spiking
        self.losses.append(loss)
        return found

    def _spike_threshold(self, rtol: float) -> float:
        floor = SPIKE_FLOOR * max(self._reference)
        if min(self.losses) > 0:
            logs = [math.log(v) for v in self.losses]
            level = _mean(logs)
            jump = max(math.log1p(rtol), SPIKE_SIGMAS * _noise(logs))
            return max(math.exp(level + jump), math.exp(level) + floor)
        mean = _mean(self.losses)
        return mean + max(rtol * abs(mean), SPIKE_SIGMAS * _noise(self.losses), floor)

    def _growth(self, step: int, gnorm: float) -> list:
        factor = self.options.grad_growth
        if self._prev_gnorm is not None and gnorm > self._prev_gnorm:
            self._run += 1
        else:
            self._run, self._run_start, self._warned_run = 0, (step, gnorm), False
        self._prev_gnorm = gnorm
        start_step, start_value = self._run_start
        grew = gnorm / max(start_value, 1e-30)
        if (factor and not self._warned_run and self._run >= self.options.growth_steps
                and grew >= factor):
            self._warned_run = True
            return [EarlyWarning(
                kind=WarningKind.GRAD_GROWTH, step=step, began=start_step, value=gnorm,
                threshold=factor,
                message=(f"the gradient norm grew {grew:.3g}x over {self._run} steps in a row, "
                         f"from {start_value:.4g} at step {start_step} to {gnorm:.4g}"))]
        return []

    def observe_update(self, step: int, ratio: float, lr: float | None = None,
                       norms: tuple[float, float] | None = None) -> list:
        """The update-ratio warning, once as the ratio rises above `update_ratio` (not every
        step it stays there); `lr` and `norms` as `update_ratio_warning` takes them."""
        limit = self.options.update_ratio
        high = bool(limit) and math.isfinite(ratio) and ratio > limit
        warn = high and not self._update_high
        self._update_high = high
        if not warn:
            return []
        return [update_ratio_warning(step, ratio, limit, lr, norms)]


def update_ratio_warning(step: int, ratio: float, limit: float, lr: float | None = None,
                         norms: tuple[float, float] | None = None) -> EarlyWarning:
    """The warning of an update that changed the weights by `ratio` of their norm (above
    `limit`). `norms`: the weights' norm (before, after) when that is all there is to go on
    (`nanaudit run`'s timeline): `ratio` is then | |w'| - |w| | / |w|, which bounds
    |w' - w| / |w| from below; `lr`: the step's learning rate, shown with them."""
    if norms is None:
        message = (f"the optimizer step changed the weights by {ratio:.3g} of their norm "
                   f"(|update| / |weights| > {limit:g}); healthy training is near 1e-3")
    else:
        rate = f" (lr {lr:.4g})" if lr is not None else ""
        message = (f"the update of step {step}{rate} took the weights' norm from "
                   f"{norms[0]:.4g} to {norms[1]:.4g}: |update| / |weights| >= {ratio:.3g} "
                   f"(> {limit:g}); healthy training is near 1e-3")
    return EarlyWarning(kind=WarningKind.UPDATE_RATIO, step=step, began=step, value=ratio,
                        threshold=limit, message=message)


class TimelineWarnings:
    """`timeline_warnings` one entry at a time, for a run whose timeline does not keep every
    step (`nanaudit run`'s, run/timeline.py): `observe` each entry once it is final, in step
    order; `warnings` holds the first MAX_WARNINGS found."""

    def __init__(self, options: WatchOptions | None = None):
        self.options = options if options is not None else WatchOptions()
        self.growth = GrowthWatch(self.options)
        self.warnings: list[EarlyWarning] = []
        self._previous: TimelineEntry | None = None
        self._told: set[str] = set()

    def once(self, key: str, warning: EarlyWarning) -> None:
        """`warning`, unless one of its `key` was told this run, in step order among the rest."""
        if key in self._told or len(self.warnings) >= MAX_WARNINGS:
            return
        self._told.add(key)
        self._add([warning])

    def _add(self, found: list[EarlyWarning]) -> None:
        """Kept in step order: `once` tells a step's warning before the entry before it is
        final (a sort is stable: the order found within a step stays)."""
        self.warnings.extend(found[:MAX_WARNINGS - len(self.warnings)])
        self.warnings.sort(key=_STEP)

    def observe(self, entry: TimelineEntry) -> None:
        """Each entry holds the norm as the previous update left it, and
        | |w'| - |w| | <= |w' - w|, so the norms bound |update| / |weights| from below."""
        if entry.skipped:
            return
        found = self.growth.observe(entry.step, entry.loss, entry.grad_norm)
        norm, previous, options = entry.param_norm, self._previous, self.options
        if (previous is not None and previous.param_norm and norm is not None
                and math.isfinite(norm) and math.isfinite(previous.param_norm)
                and options.update_ratio):
            before = previous.param_norm
            change = abs(norm - before) / before
            found += self.growth.observe_update(previous.step, change, previous.lr,
                                                (before, norm))
        self._previous = entry
        if found and len(self.warnings) < MAX_WARNINGS:
            self._add(found)


def timeline_warnings(timeline: list, options: WatchOptions | None = None) -> list:
    """Early warnings from a finished run's timeline, on the host (`nanaudit run`, whose
    script nanaudit does not step itself): loss spikes and gradient growth, and an update
    that changed the weights' norm by more than `update_ratio` of it (TimelineWarnings)."""
    watch = TimelineWarnings(options)
    for entry in timeline:
        watch.observe(entry)
    return watch.warnings
