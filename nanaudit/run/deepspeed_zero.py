"""DeepSpeed ZeRO (stages 1, 2 and 3) as the checks of `nanaudit run` see it.

A DeepSpeed engine (`deepspeed.initialize`, or the HF Trainer's `deepspeed=` config) owns the
step: `engine.backward(loss)` reduces the gradients into each rank's partition as they are
made (ZeRO-2/3 from hooks inside backward, ZeRO-1 right after it), and `engine.step()` asks the
ZeRO optimizer to step, which all-reduces one overflow flag and, when any rank's gradients held
inf or NaN, prints "OVERFLOW! Skipping step" and never calls the torch optimizer that the
checks hook. Two things follow, and both are here:

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
* the skipped step: DeepSpeed returns from `step()` without an update, so no optimizer hook ran.
  `wrap_zero_step` wraps the engine's ZeRO optimizer (on the instance, undone on exit) so that a
  step which took no update is told to the listener, which checks it: a finding, never a
  clean run, in fp32 as under fp16 loss scaling when the values themselves were non-finite.
* ZeRO-3's sub-groups: its optimizer splits the flat partitions into sub-groups of
  `sub_group_size` elements and its `step()` hands the torch optimizer one sub-group at a time
  (its param groups hold that one flat, empty between), setting each flat's gradient only for
  its own turn. A check on the torch optimizer's step would run once per sub-group, each
  reading one sub-group, after DeepSpeed's overflow all-reduce (and not at all on a skipped
  step). So under ZeRO-3 the ZeRO optimizer's `step` is the step (`wrap_zero3_step`): one
  check at its entry, before that all-reduce, over every sub-group's flat (`zero3_flats`) and
  the valid parts of its gradient wherever DeepSpeed holds it then (`valid_gradients`: the
  reduced partitions of the backward's epilogue, or the flat's own `.grad` when offloaded);
  the torch steps inside count as one step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

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


def wrap_zero_step(zero: Any, stepped: Callable[[], int],
                   skipped: Callable[[Any], None]) -> Callable[[], None]:
    """Wrap `zero.step` on the instance: when it returns with no optimizer step counted
    (`stepped()` unchanged: DeepSpeed skipped the update), `skipped(torch optimizer)` is
    called. Returns what undoes the wrap."""
    original = zero.step

    def step(*args: Any, **kwargs: Any) -> Any:
        before = stepped()
        result = original(*args, **kwargs)
        if stepped() == before:
            skipped(zero.optimizer)
        return result
    return _on_instance(zero, step)


def wrap_zero3_step(zero: Any, entered: Callable[[], None],
                    left: Callable[[bool], None]) -> Callable[[], None]:
    """Wrap a ZeRO-3 optimizer's `step` on the instance: `entered()` before DeepSpeed reads
    any gradient, `left(updated)` once it returns (`updated`: DeepSpeed stepped the torch
    optimizer, at least one sub-group; False for a step it skipped). Returns what undoes it."""
    original = zero.step
    torch_optimizer = zero.optimizer
    calls = [0]

    def count(optimizer: Any, args: tuple, kwargs: dict) -> None:
        calls[0] += 1

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


def skipped_loss_scale(zero: Any) -> float | None:
    """The loss scale of a ZeRO optimizer that scales losses dynamically (fp16), whose skips
    while it calibrates are its normal course; None for a fixed scale or none (fp32, bf16)."""
    if not getattr(zero, "dynamic_loss_scale", False):
        return None
    scale = getattr(zero, "loss_scale", None)
    return float(scale) if isinstance(scale, (int, float, torch.Tensor)) else None


# Per tensor of an optimizer's groups: None (the whole tensor is valid), or the (offset, length)
# of each valid part of a flat ZeRO-3 fp32 group along its one dimension.
Spans = list[list[tuple[int, int]] | None]


def valid_spans(optimizer: Any, params: list[torch.Tensor]) -> Spans:
    """Where the valid values of `params` (an optimizer's, in order) lie: each flat ZeRO-3
    fp32 group's valid parts (each parameter's partition without its padding), None for any
    other tensor (and every tensor of any other optimizer)."""
    zero = _ZERO3_OF.get(id(optimizer))
    if zero is None:
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


_ZERO3_OF: dict[int, Any] = {}     # id(torch optimizer) -> its ZeRO-3 optimizer
_FLAT_OF: dict[int, tuple[Any, int]] = {}   # id(flat fp32 group) -> (ZeRO-3 optimizer, index)


def note_zero3(engine: Any) -> None:
    """Remember the engine's ZeRO-3 optimizer by its torch optimizer (for `valid_spans`)."""
    zero = zero_optimizer(engine)
    if zero is not None and zero_stage(engine) == 3:
        _ZERO3_OF[id(zero.optimizer)] = zero


def zero3_flats(optimizer: Any) -> list[torch.Tensor] | None:
    """Every sub-group's flat fp32 partition of a ZeRO-3 torch optimizer, in order (its param
    groups hold one at a time, inside DeepSpeed's step only); None for any other optimizer."""
    zero = _ZERO3_OF.get(id(optimizer))
    if zero is None:
        return None
    flats = list(getattr(zero, "fp32_partitioned_groups_flat", []))
    for index, flat in enumerate(flats):
        _FLAT_OF[id(flat)] = (zero, index)
    return flats


def valid_gradients(flats: list[torch.Tensor], spans: Spans) -> list[torch.Tensor]:
    """The valid parts of the gradients of `flats` (a ZeRO-3 optimizer's, by `valid_spans`):
    a flat's own `.grad` where set (offloaded, or its sub-group's turn inside the step), else
    the reduced partitions DeepSpeed keeps for it until its turn, each without its padding."""
    parts: list[torch.Tensor] = []
    for flat, span in zip(flats, spans):
        owner = _FLAT_OF.get(id(flat))
        if flat.grad is not None or owner is None:
            parts.extend(narrow_parts([flat.grad], [span]))
            continue
        zero, index = owner
        grads = (getattr(zero, "averaged_gradients", None) or {}).get(index) or []
        for grad, partition, pad in zip(grads, zero.fp16_partitioned_groups[index],
                                        zero.groups_padding[index]):
            valid = partition.numel() - pad
            if grad is not None and valid > 0:
                parts.append(grad.detach().reshape(-1).narrow(0, 0, valid))
    return parts
