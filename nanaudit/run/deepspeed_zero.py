"""DeepSpeed ZeRO (stages 1, 2 and 3) as the checks of `nanaudit run` see it.

A DeepSpeed engine (`deepspeed.initialize`, or the HF Trainer's `deepspeed=` config) owns the
step: `engine.backward(loss)` reduces the gradients into each rank's partition as they are
made (ZeRO-2/3 from hooks inside backward, ZeRO-1 right after it), and `engine.step()` asks the
ZeRO optimizer to step, which all-reduces one overflow flag and, when any rank's gradients held
inf or NaN, prints "OVERFLOW! Skipping step" and never calls the torch optimizer that the
checks hook. What follows from that is here:

* whose value it was: once reduced, a NaN made in one rank's backward sits in every rank's
  partition (and the overflow flag is one bit for the world), so each trained parameter's
  gradient is noted on the device as autograd makes it, before DeepSpeed's own hooks reduce it
  (`flag_own_gradients`, into the same flags as FSDP's reduce-scatter inputs: one more entry in
  the step's one read, no host read here). Under ZeRO-3 the gradient autograd makes is this
  rank's own, full-sized, while the parameter itself is gathered only for its module's forward
  and backward: the hook reads the gradient, never the parameter.
* what is valid under ZeRO-3: each rank's partition of a parameter (`ds_tensor`) is padded to
  an equal size, and the padding of the last rank's is `torch.empty`, never written: whatever
  memory held (a NaN at times). The optimizer's flat fp32 groups are those partitions end to
  end, so the step's read takes only their valid parts (`valid_spans`), never the padding, and
  the same parts of each group's gradient (`narrow_parts`: a view has no `.grad` of its own, so
  reading the parts' own gradients found none, and the gradient norm read 0).
* the step: each ZeRO optimizer's `step()` hands the torch optimizer one part at a time:
  ZeRO-1/2 one param group per call (`_optimizer_step(i)`, its `param_groups` set to that one
  group: the HF Trainer builds two, decay and no-decay), ZeRO-3 one sub-group of
  `sub_group_size` elements (its param groups hold that one flat, empty between), each flat's
  gradient set only for its own turn, all after DeepSpeed's overflow all-reduce, and none on a
  step it skips. A check on the torch optimizer's step would run once per part, each reading
  one part, too late to name the rank, and never on a skipped step. So for every stage the
  ZeRO optimizer's `step` is the step (`wrap_zero_step`): one check at its entry, before that
  all-reduce, over every part's flat fp32 partition (`zero_flats`:
  `single_partition_of_fp32_groups` under ZeRO-1/2, `fp32_partitioned_groups_flat` under
  ZeRO-3) and the valid parts of its gradient wherever DeepSpeed holds it then
  (`valid_gradients`: the flat's own `.grad` when offloaded, else the reduced partitions of the
  backward's epilogue, `averaged_gradients`); the torch steps inside count as one step.
* fp16's dynamic loss scale (`loss_scale_of`): the gradients at the step's entry are the
  scaled ones (the timeline divides their norm by the scale in effect), and a step DeepSpeed
  skips while the scale calibrates is its normal course, as a GradScaler's skip is
  (script/zero_steps.py says what the checks make of it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from nanaudit.errors import delegates
from nanaudit.run.sharded import PreReduceFlags


def dropped_deepspeed(model: Any) -> str | None:
    """Why the run is not the DeepSpeed run its user asked for, or None: Accelerate was told to
    use DeepSpeed (`ACCELERATE_USE_DEEPSPEED=true`, which a Trainer's `deepspeed=` config and
    `accelerate launch --use_deepspeed` set) but the model trains without a DeepSpeed engine.
    Accelerate on CPU (`--cpu`, `use_cpu=True`) drops DeepSpeed without a word and trains with
    DDP: the report says so rather than pretend it audited ZeRO."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or is_engine(model):
        return None
    return (f"DeepSpeed was asked for (ACCELERATE_USE_DEEPSPEED=true: a Trainer's `deepspeed=` "
            f"or `accelerate launch --use_deepspeed`) but the model trains as "
            f"`{type(model).__name__}`, not a DeepSpeed engine: Accelerate dropped DeepSpeed "
            f"(as it does on CPU), so this run was audited as it trained, without ZeRO")


def is_engine(module: Any) -> bool:
    """A DeepSpeed engine (once deepspeed is imported; no engine exists before)."""
    engine = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine, "DeepSpeedEngine", None)
    return cls is not None and isinstance(module, cls)


def zero_optimizer(engine: Any) -> Any | None:
    """The engine's ZeRO optimizer (stages 1-3), or None: without ZeRO the engine steps a torch
    optimizer itself, which the optimizer hooks already hear."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return None
    return optimizer if hasattr(getattr(optimizer, "optimizer", None), "param_groups") else None


def zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def flag_own_gradients(engine: Any, flags: PreReduceFlags) -> list:
    """Note each trained parameter's gradient in `flags` as autograd makes it on this rank,
    before DeepSpeed reduces it (see the module docstring). Returns the hooks' handles."""
    def note(grad: torch.Tensor) -> None:
        flags.note(grad.detach())
    return [p.register_hook(note) for p in engine.module.parameters() if p.requires_grad]


def wrap_zero_step(zero: Any, entered: Callable[[], None],
                   left: Callable[[bool], None]) -> Callable[[], None]:
    """Wrap a ZeRO optimizer's `step` on the instance (any stage): `entered()` before DeepSpeed
    reads any gradient, `left(updated)` once it returns (`updated`: DeepSpeed stepped the torch
    optimizer, for at least one group or sub-group; False for a step it skipped). Returns what
    undoes it."""
    original = zero.step
    torch_optimizer = zero.optimizer
    calls = [0]

    def count(optimizer: Any, args: tuple, kwargs: dict) -> None:
        calls[0] += 1

    @delegates
    def step(*args: Any, **kwargs: Any) -> Any:
        entered()
        before = calls[0]
        handle = torch_optimizer.register_step_post_hook(count)
        try:
            result = original(*args, **kwargs)
        finally:
            handle.remove()
        left(calls[0] > before)
        return result
    return _on_instance(zero, step)


def _on_instance(zero: Any, step: Callable[..., Any]) -> Callable[[], None]:
    """`step` set on the ZeRO optimizer instance; returns what takes it off (if still ours)."""
    zero.step = step

    def undo() -> None:
        if zero.__dict__.get("step") is step:
            del zero.step
    return undo


def dynamic_loss_scale(zero: Any) -> float | None:
    """The loss scale in effect of a ZeRO optimizer that scales losses dynamically (fp16), whose
    skips while it calibrates are its normal course; None for a fixed scale or none (a static
    `loss_scale`, fp32, bf16). A Python float on DeepSpeed's scaler: no host read."""
    if not getattr(zero, "dynamic_loss_scale", False):
        return None
    scale = getattr(zero, "loss_scale", None)
    return float(scale) if isinstance(scale, (int, float, torch.Tensor)) else None


def loss_scale_of(optimizer: Any) -> float | None:
    """`dynamic_loss_scale` of the ZeRO optimizer whose torch optimizer is `optimizer` (None for
    any other optimizer: one dict lookup per step)."""
    known = _ZERO_OF.get(id(optimizer))
    return dynamic_loss_scale(known[0]) if known is not None else None


# Per tensor of an optimizer's groups: None (the whole tensor is valid), or the (offset, length)
# of each valid part of a flat ZeRO-3 fp32 group along its one dimension.
Spans = list[list[tuple[int, int]] | None]


def valid_spans(optimizer: Any, params: list[torch.Tensor]) -> Spans | None:
    """Where the valid values of `params` (a ZeRO optimizer's torch optimizer's, in order) lie:
    each flat ZeRO-3 fp32 group's valid parts (each parameter's partition without its padding),
    None for a tensor that is valid whole (a ZeRO-1/2 partition, zero-padded); None for any
    other optimizer (its gradients are its parameters' own)."""
    known = _ZERO_OF.get(id(optimizer))
    if known is None:
        return None
    zero, stage = known
    if stage != 3:
        return [None] * len(params)
    flats = getattr(zero, "fp32_partitioned_groups_flat", [])
    paddings = getattr(zero, "groups_padding", [])
    partitions = getattr(zero, "fp16_partitioned_groups", [])
    spans: Spans = []
    for p in params:
        group = next((i for i, flat in enumerate(flats) if flat is p), None)
        if group is None:
            spans.append(None)
            continue
        parts, offset = [], 0
        for partition, pad in zip(partitions[group], paddings[group]):
            size = partition.numel()
            if size - pad > 0:
                parts.append((offset, size - pad))
            offset += size
        spans.append(parts)
    return spans


def narrow_parts(tensors: list[torch.Tensor | None], spans: Spans) -> list[torch.Tensor]:
    """The valid parts of `tensors` by `spans` (valid_spans of the tensors whose values, or
    gradients, these are): views of their own storage, which DeepSpeed updates in place. A
    None tensor (a gradient not set) gives none."""
    parts: list[torch.Tensor] = []
    for t, span in zip(tensors, spans):
        if t is None:
            continue
        if span is None:
            parts.append(t)
        else:
            parts.extend(t.detach().narrow(0, offset, length) for offset, length in span)
    return parts


_ZERO_OF: dict[int, tuple[Any, int]] = {}   # id(torch optimizer) -> (ZeRO optimizer, stage)
_FLAT_OF: dict[int, tuple[Any, int, int]] = {}   # id(flat fp32 group) -> (ZeRO, stage, index)
# Each stage's flat fp32 partitions, one per param group (1/2) or sub-group (3).
_FLATS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
          3: "fp32_partitioned_groups_flat"}


def note_zero(engine: Any) -> None:
    """Remember the engine's ZeRO optimizer (any stage) by its torch optimizer (for
    `zero_flats`, `valid_spans` and `loss_scale_of`)."""
    zero = zero_optimizer(engine)
    stage = zero_stage(engine)
    if zero is not None and stage in _FLATS:
        _ZERO_OF[id(zero.optimizer)] = (zero, stage)


def zero_flats(optimizer: Any) -> list[torch.Tensor] | None:
    """Every flat fp32 partition of a ZeRO torch optimizer, in order: each param group's under
    ZeRO-1/2 (whose `step` hands the torch optimizer one group at a time), each sub-group's
    under ZeRO-3 (its param groups hold one at a time, inside DeepSpeed's step only); None for
    any other optimizer."""
    known = _ZERO_OF.get(id(optimizer))
    if known is None:
        return None
    zero, stage = known
    flats = list(getattr(zero, _FLATS[stage], []))
    for index, flat in enumerate(flats):
        _FLAT_OF[id(flat)] = (zero, stage, index)
    return flats


def valid_gradients(flats: list[torch.Tensor], spans: Spans) -> list[torch.Tensor]:
    """The valid parts of the gradients of `flats` (a ZeRO optimizer's, by `valid_spans`) at
    the ZeRO step's entry: a flat's own `.grad` where set (offloaded, or a ZeRO-3 sub-group's
    turn inside the step), else the reduced partitions DeepSpeed keeps for it until its turn
    (`averaged_gradients`: ZeRO-3's each without its padding; ZeRO-1/2's a list of its
    parameters' slices, or DeepSpeed's compact buffer group, whose zero padding is no
    gradient); none for a group whose gradients are not set."""
    parts: list[torch.Tensor] = []
    for flat, span in zip(flats, spans):
        owner = _FLAT_OF.get(id(flat))
        if flat.grad is not None or owner is None:
            parts.extend(narrow_parts([flat.grad], [span]))
            continue
        zero, stage, index = owner
        grads = (getattr(zero, "averaged_gradients", None) or {}).get(index) or []
        if stage != 3:
            parts.extend(g.detach() for g in grads
                         if g is not None and not getattr(g, "_zero_padding", False))
            continue
        for grad, partition, pad in zip(grads, zero.fp16_partitioned_groups[index],
                                        zero.groups_padding[index]):
            valid = partition.numel() - pad
            if grad is not None and valid > 0:
                parts.append(grad.detach().reshape(-1).narrow(0, 0, valid))
    return parts
