"""A float32 overflow that an optimizer's update made: the op read a parameter that the update
grew far past its size at the first check, and at that size the op could not have overflowed.

A learning rate too high (Adam at lr 1e20, a GAN's generator at 10.0) makes the weights it
updates enormous but finite in one step; the next forward that reads them overflows float32.
Where several optimizers take turns (a GAN), the trip's check reads only its own optimizer's
weights, and its timeline shows no growth: the overflowing op's own inputs are the evidence. The
script's ledger (or the session) says which optimizer holds each parameter, when it last
stepped, at what learning rate, and how large its weights were at their first read
(`WeightHistory`): this module decides from those values alone.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nanaudit.localize.causes import divergence_fix
from nanaudit.localize.ops import dtype_name, named_tensors, op_base
from nanaudit.localize.overflow import Bound, amax, overflow_bound
from nanaudit.localize.rules.registry import Reason
from nanaudit.report.vocabulary import Cause

# How far past its first read a weight must have grown before its growth is the story. A
# training step moves a weight by about the learning rate (Adam) or lr x gradient (SGD): with
# any learning rate a run survives, weights stay within a small multiple of their initial
# scale. Three orders of magnitude is no drift; below that, an overflow is the inputs' own.
GROWTH = 1e3


@dataclass(frozen=True)
class WeightUpdate:
    """Who last updated a parameter, and how large its weights were before any update."""

    name: str                 # the parameter's qualified name
    optimizer: str            # `Adam(lr=1e+20, ...)`, or "the script's own update"
    step: int | None          # the step of that optimizer's last update (None: not known)
    lr: float | None          # the learning rate of the parameter's group
    first: float              # an upper bound of its |values| at its first check (the norm
    #                           of the weights that check read: no |value| exceeds it)


class WeightHistory(Protocol):
    """What a checker knows of the parameters its script's optimizers update."""

    def update_of(self, parameter: torch.Tensor) -> WeightUpdate | None:
        """The update that last changed `parameter`; None when no optimizer has updated it."""


class OptimizersWeights:
    """The WeightHistory of a step loop that holds its optimizers (`scan`, Sentinel): each
    optimizer by its name, every one stepped at the step before the trip unless the user's own
    step decides (then which step is not known), and the model's weights' norm at the first
    step, read before any update (the timeline's first entry)."""

    def __init__(self, optimizers: dict[str, Any], names: dict[int, str], first: float | None,
                 last_step: int | None) -> None:
        self.optimizers, self.names = optimizers, names
        self.first, self.last_step = first, last_step

    def update_of(self, parameter: torch.Tensor) -> WeightUpdate | None:
        if self.first is None:
            return None
        for label, optimizer in self.optimizers.items():
            group = group_of(optimizer, parameter)
            if group is not None:
                name = self.names.get(id(parameter), f"<parameter {tuple(parameter.shape)}>")
                return WeightUpdate(name, f"{type(optimizer).__name__} `{label}`",
                                    self.last_step, lr_of(group), self.first)
        return None


def group_of(optimizer: Any, parameter: torch.Tensor) -> dict | None:
    """The param group of `optimizer` that holds `parameter` (by identity), else None."""
    return next((g for g in getattr(optimizer, "param_groups", ())
                 if any(p is parameter for p in g["params"])), None)


def lr_of(group: dict) -> float | None:
    """A param group's learning rate as a number (a 0-dim tensor's too), else None."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        return float(lr)
    return float(lr) if isinstance(lr, (int, float)) else None


def _parameter(t: Any) -> torch.Tensor | None:
    """The leaf `t` is or views (`weight.t()` in a linear's addmm), else None. Not asked to
    require grad: Lightning's `toggle_optimizer` turns it off for the other optimizers'
    weights while one trains, and the history says whether an optimizer holds it."""
    if not isinstance(t, torch.Tensor):
        return None
    root = t._base if t._base is not None else t
    return root if root.is_leaf else None


def _grown_update(t: Any, weights: WeightHistory) -> tuple[WeightUpdate, float] | None:
    """(its update, its largest |value|) when `t` is a parameter an optimizer grew GROWTH-fold
    past its first read; else None."""
    parameter = _parameter(t)
    update = weights.update_of(parameter) if parameter is not None else None
    if update is None:
        return None
    peak = amax(t)
    if not (math.isfinite(update.first) and peak > 0 and peak >= GROWTH * update.first):
        return None
    return update, peak


def _grown_local(t: Any, weights: WeightHistory) -> tuple[WeightUpdate, float] | None:
    """`_grown_update` of a plain tensor; None for a tensor subclass (a DTensor: reading its
    peak is a collective, or has no sharding strategy, inside a traced op)."""
    return _grown_update(t, weights) if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def grown_weight(event: Any, bound: Bound, out_dtype: torch.dtype | None,
                 weights: WeightHistory | None) -> Reason | None:
    """`divergence` when one of the overflowing op's inputs is a parameter an optimizer grew
    GROWTH-fold past its first read, and with that input back at its first size the op's
    result (written in `out_dtype`, None: the inputs' own) could not have reached the dtype's
    range; else the same asked of the activations an op reading such a parameter made
    (`grown_upstream`); else None."""
    if weights is None or event.args is None:
        return None
    for arg_name, t in named_tensors(event.arg_names, event.args, event.kwargs):
        grown = _grown_update(t, weights)
        if grown is None:
            continue
        update, peak = grown
        at_first = _bound_at(event, {id(t): update.first / peak}, out_dtype)
        if at_first is not None and at_first < bound.limit:
            return _reason(event, bound, f"its {arg_name} is the parameter {update.name}", peak,
                           at_first, update)
    return grown_upstream(event, bound, out_dtype, weights)


def _bound_at(event: Any, scales: dict[int, float],
              out_dtype: torch.dtype | None) -> float | None:
    """The op's largest |result| had each input `t` with id in `scales` been that many times
    its size."""
    def scaled(a: Any) -> Any:
        return a.detach() * scales[id(a)] if isinstance(a, torch.Tensor) and id(a) in scales \
            else a
    args = tuple(scaled(a) for a in event.args)
    kwargs = {k: scaled(v) for k, v in (event.kwargs or {}).items()}
    found = overflow_bound(event.op, args, kwargs, out_dtype)
    return found.bound if found is not None else None


# --- an activation a grown weight made -----------------------------------------------------------

# Ops whose every |result| is at most the largest |input| (the path's one tensor input): had
# that input been smaller, so would their result. An overflow downstream of one is weighed
# through it as if the op were not there. Dropout (1 / (1 - p)) and norms are not among them.
CONTRACTIONS = frozenset({"relu", "relu_", "leaky_relu", "leaky_relu_", "tanh", "tanh_",
                          "hardtanh", "hardtanh_", "relu6", "gelu", "gelu_", "silu", "silu_",
                          "mish", "mish_", "hardswish", "hardswish_", "max_pool1d", "max_pool2d",
                          "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                          "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool2d",
                          "_adaptive_avg_pool2d", "adaptive_max_pool2d"})
# How many ops back from the overflowing op's input the walk looks for the op that read the
# grown weight: an activation and a pooling between two layers, with room to spare.
DEPTH = 6


class GrownWeights:
    """Which forward ops read a parameter an update grew (asked of each op the tracer records,
    on replay; a parameter's answer is read once, one host read per parameter). `trace`: its
    `weights` say who updated what (set when the tracer is made, or when it is armed)."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self._known: dict[int, bool] = {}
        self.seen = False         # has any op read one? (else no path is looked for)

    @property
    def weights(self) -> WeightHistory | None:
        return self.trace.weights

    def read_by(self, inputs: list) -> bool:
        """Does an op with these tensor inputs read a grown parameter?"""
        if self.weights is None:
            return False
        found = False
        for t in inputs:
            parameter = _parameter(t)
            if parameter is None:
                continue
            if id(parameter) not in self._known:
                self._known[id(parameter)] = _grown_local(parameter, self.weights) is not None
            found = found or self._known[id(parameter)]
        self.seen = self.seen or found
        return found

    def paths(self, arg_names: tuple, args: tuple, kwargs: dict) -> tuple:
        """(name, input, grown_makers path) of each input of a forward op that went bad which
        an op reading a grown parameter made; () when no op read one."""
        if not self.seen:
            return ()
        found = []
        for name, t in named_tensors(arg_names, args, kwargs):
            path = grown_makers(self.trace, t)    # a parameter itself has no maker: None
            if path is not None:
                found.append((name, t, path))
        return tuple(found)


def grown_makers(trace: Any, t: torch.Tensor) -> tuple | None:
    """The forward records from an op that read a grown parameter (its inputs kept: the tracer
    keeps them for such an op) to the one that made `t`, through CONTRACTIONS only, at most
    DEPTH of them; None when no such op made `t`'s values."""
    record, path = trace.maker_of(t), list[Any]()
    while record is not None and len(path) < DEPTH:
        path.insert(0, record)
        if record.args is not None and trace.weights is not None and any(
                _grown_local(a, trace.weights) is not None
                for _, a in named_tensors(record.arg_names, record.args, record.kwargs)):
            return tuple(path)
        if op_base(record.op) not in CONTRACTIONS or not record.input_makers:
            return None
        record = trace.record_at(record.input_makers[0])
    return None


def grown_upstream(event: Any, bound: Bound, out_dtype: torch.dtype | None,
                   weights: WeightHistory) -> Reason | None:
    """`divergence` when an input of the overflowing op was made (through CONTRACTIONS) by an
    op that read parameters an optimizer grew, and with those parameters back at their first
    size, that op's result, hence this input, could not have made this op reach the range."""
    for arg_name, x, path in getattr(event, "grown_paths", ()):
        maker, grown = path[0], _grown_args(path[0], weights)
        made_at_first = _bound_at(maker, {id(t): u.first / peak for t, u, peak in grown}, None)
        largest = amax(x)
        if made_at_first is None or largest <= 0 or made_at_first >= largest:
            continue
        at_first = _bound_at(event, {id(x): made_at_first / largest}, out_dtype)
        if at_first is not None and at_first < bound.limit:
            # a layer's weight names it before its bias (both grew with one update)
            _, update, peak = max(grown, key=lambda g: (g[0].numel(), g[2]))
            return _reason(event, bound, _made_by(arg_name, largest, path, made_at_first, update),
                           peak, at_first, update)
    return None


def _grown_args(record: Any, weights: WeightHistory) -> list:
    """(tensor, update, peak) of each grown parameter a forward record read."""
    found = []
    for _, a in named_tensors(record.arg_names, record.args, record.kwargs):
        grown = _grown_local(a, weights)
        if grown is not None:
            found.append((a, *grown))
    return found


def _made_by(arg_name: str, largest: float, path: tuple, made_at_first: float,
             update: WeightUpdate) -> str:
    """How the overflowing op's input came from the grown parameter, for the explanation."""
    maker = path[0]
    where = (f" at {os.path.basename(maker.source.file)}:{maker.source.line}"
             if maker.source is not None else "")
    through = "".join(f" and {op_base(r.op)}" for r in path[1:])
    return (f"its {arg_name} (largest |value| {largest:.4g}) was made by {op_base(maker.op)}"
            f"{where}{through}, which could reach only {made_at_first:.4g} with its weights at "
            f"their first size; that op read the parameter {update.name}")


def _reason(event: Any, bound: Bound, subject: str, peak: float, at_first: float,
            update: WeightUpdate) -> Reason:
    """`subject`: how the op's input is the grown parameter (`its mat2 is the parameter w`) or
    was made from it; `peak`: that parameter's largest |value|."""
    base, name = op_base(event.op), dtype_name(bound.dtype)
    lr = f"lr {update.lr:.4g}" if update.lr is not None else "its learning rate"
    by = update.optimizer or "the script's own update"
    when = f" at step {update.step}" if update.step is not None else " before this step"
    grown = (f"at least {peak / update.first:.3g}x its size at the first check"
             if update.first > 0 else "all zeros at the first check")
    text = (f"{base} overflowed {name} from finite inputs: the largest |input| was "
            f"{bound.largest_input:.4g}, {name} max is {bound.limit:.6g} ({bound.how} can reach "
            f"{bound.bound:.4g}); {subject}, whose largest |value| was {peak:.4g}, {grown} (the "
            f"weights read there had a norm of {update.first:.4g}): {by} last updated it{when}, "
            f"at {lr} for its group. At its first size the result could reach only "
            f"{at_first:.4g}: the update made the weights diverge")
    fix = divergence_fix(f"{by}, {lr} for the group of {update.name}",
                         "the optimizer whose update grew these weights")
    return Reason(Cause.DIVERGENCE, text, fix=fix)
