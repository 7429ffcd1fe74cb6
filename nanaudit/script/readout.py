"""The one host read of a `nanaudit run` step, kept to a handful of kernels: a tiny step must
not pay for nanaudit more than the step loop of `scan` makes it pay.

Between two checks the hooks leave what they collect on the device (`StepInbox`): each loss
that reached backward, detached as it is, and for each outermost module call the min and the
max of each data input (one `aminmax`: both finite exactly when every element is, and never an
overflow, which a sum of squares can be; read as they are, not folded into one |value| on the
device, which costs two more kernels a step). The check adds the optimizer's weights and
gradients as per-tensor norms from one fused `_foreach_norm` (small CPU tensors flattened into
one first, as the step loop packs them below run/checks.PACK_BELOW), stacks everything and
reads it with ONE `.tolist()`; the host combines the norms (`math.hypot`) and the losses
(step_values.window_loss). All of it is float32 in the common case, so the stack converts
nothing (a stack of mixed dtypes costs it three times as much). Which tensors an optimizer
holds is worked out once (`WeightsScope`) and reused while its param groups hold the same
parameters. The model's floating buffers (the check core's scope, run/check/scope.py) join the
read, in the weights' fused call when their dtypes allow. Under FSDP2 the norms are of this rank's
own shards (an op on a DTensor would be a collective), and under torchrun every rank's flags
join the same read (`exchange`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.run.checks import PackLayout, dense_values, finite_norms, peak
from nanaudit.run.deepspeed_zero import (
    Spans,
    narrow_parts,
    valid_gradients,
    valid_spans,
    zero_flats,
)
from nanaudit.run.sharded import local_shards
from nanaudit.script.step_values import loss_factor, window_loss

_SAFE = (torch.float32, torch.float16, torch.bfloat16)     # float32 holds their values exactly
_READ_EXACTLY = (*_SAFE, torch.float64)                    # a loss stacked in these stays exact
_FLOAT32_OR_64 = (torch.float32, torch.float64)
_GRAD, _LAYOUT = operator.attrgetter("grad"), operator.attrgetter("layout")
_IS_SET = functools.partial(operator.is_not, None)
_DENSE = {torch.strided}
_PARAMS = operator.itemgetter("params")


def input_peaks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors, one per input that has elements: its largest |value| (checks.peak: finite
    exactly when every element is, never an overflow), in float32 unless the input is float64."""
    peaks = [peak(t) for t in tensors if t.numel()]
    return [p if p.dtype in _FLOAT32_OR_64 else p.float() for p in peaks]


def input_extremes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors, two per input that has elements: its min and its max (NaN propagates
    through `aminmax`; -inf is the min, inf the max), so all are finite exactly when every
    element is; in float32 unless the input is float64. The step's read takes them as they
    are: one kernel an input (input_peaks folds them into one |value|, two kernels more)."""
    extremes = [e for t in tensors if t.numel()
                for e in torch.aminmax(t.detach() if t.requires_grad else t)]
    return [e if e.dtype in _FLOAT32_OR_64 else e.float() for e in extremes]


@dataclass(slots=True)
class StepInbox:
    """What the hooks collected since the last check, on the device (no read yet)."""

    losses: list = field(default_factory=list)       # 0-dim losses that reached backward
    factors: list = field(default_factory=list)      # what each was divided by, or None
    input_peaks: list = field(default_factory=list)  # all finite iff each call's inputs are
    inputs: list = field(default_factory=list)       # each call's [(name, tensor)], in order
    clip_norms: list = field(default_factory=list)   # what each `clip_grad_norm_` returned
    scale: Any = None            # the loss scale a GradScaler's `step` ran with (a tensor)

    def add_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach()
        if value.dim():
            value = value.reshape(())
        self.losses.append(value if value.dtype in _READ_EXACTLY else value.to(torch.float64))
        self.factors.append(loss_factor(loss))

    def add_inputs(self, inputs: list[tuple[str, torch.Tensor]]) -> None:
        self.inputs.append(inputs)
        self.input_peaks.extend(input_extremes([t for _, t in inputs]))

    def add_clip(self, total_norm: Any) -> None:
        """The total norm `clip_grad_norm_` returned (before it clipped): read with the step.
        A plain 0-dim tensor only (an FSDP2 DTensor's would need a collective to read)."""
        if type(total_norm) is not torch.Tensor or total_norm.dim():
            return
        # computed under no_grad: kept as it is, no op (a float32 norm needs no conversion)
        value = total_norm.detach() if total_norm.requires_grad else total_norm
        self.clip_norms.append(value if value.dtype in _FLOAT32_OR_64 else value.float())

    def __bool__(self) -> bool:
        return bool(self.losses or self.input_peaks)


class WeightsScope:
    """An optimizer's parameters as the check reads them: their device, and which are packed
    (small CPU tensors); valid while its param groups hold the same tensors. The parameters are
    read live each step, never through aliases made once: a script may give one new storage
    (`p.data = p.data * mask`), which an alias would not follow."""

    def __init__(self, params: list[torch.Tensor], source: list[torch.Tensor] | None = None,
                 spans: Spans | None = None):
        self.params = params
        # what the optimizer's groups hold: `params` unless only parts of them are valid
        # (DeepSpeed ZeRO-3's padded partitions, run/deepspeed_zero.valid_spans), and where
        # those parts lie (their gradients are the same parts of the groups' gradients); set
        # for every ZeRO optimizer, whose gradients are read where DeepSpeed holds them
        self.source = source if source is not None else params
        self.spans = spans
        self.device = params[0].device
        self.device_name = str(self.device)
        self.sharded = any(s is not p for s, p in zip(local_shards(params), params))
        self.fused = not self.sharded and all(t.dtype in _SAFE and t.device == self.device
                                              for t in params)
        # Small CPU tensors packed as the step loop packs them (the layout keeps places only).
        self._layout = (PackLayout(params) if self.fused and self.device.type == "cpu"
                        else None)

    @staticmethod
    def params_of(optimizer: Any) -> list[torch.Tensor]:
        """The optimizer's parameters, every group in order (walked in C: this runs per step)."""
        return list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))

    def local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's own values of `tensors` (their local shards under FSDP2)."""
        return local_shards(tensors) if self.sharded else tensors

    def holds(self, params: list[torch.Tensor]) -> bool:
        return len(params) == len(self.source) and all(map(operator.is_, params, self.source))

    def grads(self) -> list[torch.Tensor]:
        """The gradients that are set, each as a dense tensor of its values (a sparse one's
        coalesced values)."""
        if self.spans is not None:       # ZeRO: the valid parts of each group's gradient
            return valid_gradients(self.source, self.spans)
        grads = list(filter(_IS_SET, map(_GRAD, self.params)))
        if set(map(_LAYOUT, grads)) <= _DENSE:
            return grads
        return [dense_values(g) for g in grads]

    def norm_parts(self, grads: list[torch.Tensor], buffers: list[torch.Tensor],
                   join_buffers: bool = True) -> tuple[list, list, list]:
        """(the weights' norms, the gradients' norms, the buffers' norms) on the device, whose
        hypot is each group's norm: per tensor from one fused call, or one per group when
        dtypes or devices are mixed. Gradients are packed like their parameters when every one
        has a gradient (otherwise their places do not line up). The buffers join the fused
        call when they can (their L2 norms: a non-finite one is confirmed element-wise, as a
        weight's is); otherwise (or not `join_buffers`) their peaks are read apart."""
        # Live parameters, so no graph of our norms: grad mode off, set directly (the
        # `no_grad` context manager costs four times as much, on every step).
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if not self.fused:
                state_norm, grad_norm = finite_norms([self.local(self.params),
                                                      self.local(grads)], self.device)
                return [state_norm], [grad_norm], buffer_peaks(buffers) if buffers else []
            joined = join_buffers and (not buffers or all(
                b.dtype in _SAFE and b.device == self.device for b in buffers))
            state, layout = self.params, self._layout
            if layout is not None:
                state, grads = layout.pack(state), layout.pack(grads)
            norms = torch._foreach_norm(state + grads + (buffers if joined else []), 2.0,
                                        dtype=torch.float32)
            apart = [] if joined or not buffers else buffer_peaks(buffers)
        finally:
            torch._C._set_grad_enabled(enabled)
        end = len(state) + len(grads)
        return list(norms[:len(state)]), list(norms[len(state):end]), list(norms[end:]) + apart


class OptimizerScopes:
    """Each optimizer's WeightsScope, made again only when its param groups change."""

    def __init__(self) -> None:
        self._scopes: dict[int, WeightsScope] = {}     # id(optimizer) -> its scope

    def of(self, optimizer: Any) -> WeightsScope | None:
        """The optimizer's tensors as the check reads them (None: it holds none)."""
        # A ZeRO torch optimizer holds one group (ZeRO-3: sub-group) at a time inside
        # DeepSpeed's step: its step reads them all
        params = zero_flats(optimizer) or WeightsScope.params_of(optimizer)
        scope = self._scopes.get(id(optimizer))
        if scope is None or not scope.holds(params):
            scope = _scope_of(optimizer, params) if params else None
            if scope is not None:
                self._scopes[id(optimizer)] = scope
        return scope

    def forget(self, key: int) -> None:
        """The optimizer `key` named was let go: its tensors are not kept alive for it."""
        self._scopes.pop(key, None)


def _scope_of(optimizer: Any, params: list[torch.Tensor]) -> WeightsScope:
    """The scope of `params`, an optimizer's: a ZeRO optimizer's flats (only their valid parts
    where some are padded), whose gradients DeepSpeed holds apart until its step sets them."""
    spans = valid_spans(optimizer, params)
    if spans is None:
        return WeightsScope(params)
    return WeightsScope(narrow_parts(list(params), spans), params, spans)


@dataclass(frozen=True, slots=True)
class StepRead:
    """What the host read of a step says: its data inputs finite, its loss (None: no loss
    reached backward), the weights' and the gradients' norms (None: not read)."""

    inputs_ok: bool
    loss: float | None
    norm: float | None = None
    grad_norm: float | None = None
    table: tuple = ()            # under torchrun: every rank's flags, read with the rest
    buffers_ok: bool = True      # the model's floating buffers finite (as the forward left them)
    clip_norm: float | None = None   # the last total norm `clip_grad_norm_` returned, if any
    scale: float | None = None       # the GradScaler's loss scale of the step, if any


def buffer_peaks(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim float32 tensors, one per buffer: its largest |value| (NaN propagates; never an
    overflow), from one fused call when every buffer's dtype converts exactly."""
    if all(b.dtype in _SAFE for b in buffers):
        return list(torch._foreach_norm(buffers, math.inf, dtype=torch.float32))
    return input_peaks(buffers)


def step_summary(values: torch.Tensor, n_loss: int, n_in: int, n_state: int,
                 n_grads: int) -> torch.Tensor:
    """[inputs finite, weights' norm, loss, gradients' norm, buffers' peak] on the device from
    the stacked read (the buffers' peaks last), for the ranks' exchange (whose flags only ask
    which of them are finite): sums in float64, so no finite set of norms overflows."""
    v = values.to(torch.float64)
    start = n_loss + n_in
    inputs_ok = torch.isfinite(v[n_loss:start]).all().to(torch.float64)
    grads = start + n_state
    return torch.stack([inputs_ok, v[start:grads].sum(), v[:n_loss].sum(),
                        v[grads:grads + n_grads].sum(), v[grads + n_grads:].sum()])


def read_step(inbox: StepInbox, scope: WeightsScope | None = None,
              grads: list[torch.Tensor] | None = None,
              exchange: Callable[[torch.Tensor], torch.Tensor] | None = None,
              buffers: list[torch.Tensor] | None = None) -> StepRead:
    """ONE host read of the inbox and, with `scope`, of its weights', `grads`' and `buffers`'
    norms; `exchange` (torchrun): every rank's flags from the step's summary,
    read with the rest."""
    buffers = buffers or []
    # Under torchrun the buffers' flags are exchanged before any rank could confirm an L2 norm
    # that overflowed: their peaks, which a finite buffer never overflows, are read instead.
    state, grad_parts, buffer_parts = (scope.norm_parts(grads or [], buffers,
                                                        join_buffers=exchange is None)
                                       if scope is not None else ([], [], []))
    n_buf = len(buffer_parts)
    extra = inbox.losses + inbox.input_peaks
    device = scope.device if scope is not None else extra[0].device
    parts = [t if t.device == device else t.to(device) for t in extra + buffer_parts]
    # The buffers' last: [losses, input peaks, weights, gradients, buffers].
    ahead = len(parts) - n_buf
    # The norm the script's last `clip_grad_norm_` returned and the GradScaler's scale ride
    # along last (no summary reads them): [losses, input peaks, weights, gradients, buffers,
    # clip, scale].
    clips = [c if c.device == device else c.to(device) for c in inbox.clip_norms[-1:]]
    scales = [inbox.scale.reshape(()).to(device, torch.float32)] if isinstance(
        inbox.scale, torch.Tensor) else []
    stacked = torch.stack(parts[:ahead] + state + grad_parts + parts[ahead:] + clips + scales)
    body = len(stacked) - len(clips) - len(scales)
    n_loss, n_in = len(inbox.losses), len(inbox.input_peaks)
    start = n_loss + n_in
    if exchange is not None:
        flags = exchange(step_summary(stacked[:body], n_loss, n_in, len(state),
                                      len(grad_parts)))
        values = torch.cat([stacked.to(torch.float64), flags]).tolist()
        table = tuple(values[len(stacked):])
        values = values[:len(stacked)]
    else:
        values, table = stacked.tolist(), ()
    clip_norm = values[body] if clips else None
    scale = values[-1] if scales else None
    values = values[:body]
    loss = window_loss(values[:n_loss], inbox.factors) if n_loss else None
    inputs_ok = all(map(math.isfinite, values[n_loss:start]))
    buffers_ok = all(map(math.isfinite, values[len(values) - n_buf:])) if n_buf else True
    if scope is None:
        return StepRead(inputs_ok, loss, table=table, buffers_ok=buffers_ok,
                        clip_norm=clip_norm, scale=scale)
    return StepRead(inputs_ok, loss, math.hypot(*values[start:start + len(state)]),
                    math.hypot(*values[start + len(state):len(values) - n_buf]), table,
                    buffers_ok, clip_norm, scale)
