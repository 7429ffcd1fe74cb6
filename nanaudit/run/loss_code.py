"""The script's own code between its model's return and `backward` (the loss), recorded so that
an in-process replay can run it again on the replayed model's output.

A `TorchFunctionMode` is pushed when the model's outermost call returns and popped at the next
model call, optimizer step or end of the script: the few torch calls of the loss code (a
`cross_entropy`, a division for accumulation, `GradScaler.scale`'s multiplication) each pass
through it once, recorded as references (the function, its arguments, its output and the
user's line). The model's forward itself never meets the mode, so its cost does not grow with
the model. The first `backward` ends the recording (its tensor is the root the replay
differentiates); what the script does after it is not loss code. A loss computed and then
skipped before `backward` (`if not torch.isfinite(loss): continue`) is in the record too: its
last differentiable scalar is that loss."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from types import CodeType, FrameType
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from nanaudit.errors import is_own_file

MAX_OPS = 4096            # a "loss code" longer than this is a loop of its own: not replayable
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_BACKWARD = frozenset((torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad))
_stack_depth, _stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_push, _pop = torch._C._push_on_torch_function_stack, torch._C._pop_torch_function_stack
_any_autocast = torch._C._is_any_autocast_enabled


@functools.lru_cache(maxsize=4096)
def _computes(func: Any) -> bool:
    """False for what makes no value to replay: a tensor's attribute read or write
    (`p.grad`, `.shape`), which an optimizer's `zero_grad` does for every parameter."""
    return getattr(func, "__name__", "") not in ("__get__", "__set__", "__delete__")


class RecordedOp(NamedTuple):
    """One torch call of the loss code; `where`: the user's (file, line, function). A tuple:
    made on every step, and made with `tuple.__new__` there: even a NamedTuple's own `__new__`
    is a Python call."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any
    where: tuple[str, int, str] | None
    autocast: tuple = ()                # the autocast regions it ran in: ((device, dtype), ...)


_new = tuple.__new__


_MUTATES: dict[Any, bool] = {}


def mutates(func: Any) -> bool:
    """Does `func` write into its first argument (`t[i] = v`, `t.copy_(v)`, `t.add_(v)`)? A
    dict lookup once seen: this runs for every recorded op."""
    known = _MUTATES.get(func)
    if known is None:
        name = getattr(func, "__name__", "")
        known = _MUTATES[func] = name in ("__setitem__", "__iadd__", "__isub__", "__imul__",
                                          "__itruediv__") or (
            name.endswith("_") and not name.endswith("__")
            and name not in ("requires_grad_", "retain_grad_", "share_memory_"))
    return known


class LossCode:
    """The recorded loss code of one model call: its ops, the (func, args, kwargs) of each
    backward it reached, whether it ran past MAX_OPS, and `before`: a copy of each tensor it
    wrote into in place that no op had made (no autograd history: a buffer the script made
    before the model call, `encoder_outputs[ei] = encoder_output[0, 0]` in a seq2seq loop), as
    it was before that first write, for the replay to write into instead."""

    __slots__ = ("before", "ops", "overflowed", "roots")

    def __init__(self) -> None:
        self.ops: list[RecordedOp] = []
        self.roots: list[tuple[Any, tuple, dict]] = []
        self.overflowed = False
        self.before: dict[int, torch.Tensor] = {}

    def skipped_loss(self) -> torch.Tensor | None:
        """The last differentiable floating scalar the code made, when no backward ran."""
        if self.roots:
            return None
        for op in reversed(self.ops):
            for t in tree_flatten(op.out)[0]:
                if (isinstance(t, torch.Tensor) and t.numel() == 1 and t.requires_grad
                        and t.is_floating_point()):
                    return t
        return None


@functools.lru_cache(maxsize=1024)
def is_user_file(name: str) -> bool:
    path = os.path.abspath(name)
    return not (path.startswith(_TORCH_DIR) or name.startswith("<frozen") or is_own_file(path))


def user_frame(site: list[tuple[CodeType, int]]) -> tuple[str, int, str] | None:
    """The innermost user frame of `site` (frames' code and line, innermost first)."""
    return next(((code.co_filename, line, code.co_name) for code, line in site
                 if is_user_file(code.co_filename)), None)


def autocast_state() -> tuple:
    """((device, dtype), ...) of the autocast regions enabled now (CPU, and CUDA once it is
    initialized): a replay runs each call in the same ones. One C call when none is (the
    common case: this runs for every recorded op)."""
    if not _any_autocast():
        return ()
    devices = ("cpu", "cuda") if torch.cuda.is_initialized() else ("cpu",)
    return tuple((d, torch.get_autocast_dtype(d)) for d in devices
                 if torch.is_autocast_enabled(d))


def autocast(state: tuple) -> contextlib.ExitStack:
    """The autocast regions of `state`, entered."""
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


class LossCodeRecorder(TorchFunctionMode):
    """Records into one LossCode at a time while pushed (`start` / `stop`)."""

    def __init__(self) -> None:
        super().__init__()
        self.code: LossCode | None = None
        self.pushed = False

    def start(self, code: LossCode) -> None:
        if self.pushed:
            self.stop()
        self.code = code
        _push(self)
        self.pushed = True

    def reached_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        """`Tensor.backward` (wrapped: a call through the mode costs more than the rest): the
        loss code ends, with its root, and the mode is popped before backward runs."""
        if self.code is not None:
            self.code.roots.append((func, args, kwargs))
        self.stop()

    def paused(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """`call(*args, **kwargs)` with the mode popped (an optimizer's `zero_grad` between the
        loss and backward: nothing of the loss, and a torch call per parameter)."""
        depth = _stack_depth()         # innermost: the script's own modes stay
        if not self.pushed or not depth or _stack_at(depth - 1) is not self:
            return call(*args, **kwargs)
        _pop()
        try:
            return call(*args, **kwargs)
        finally:
            _push(self)

    def stop(self) -> None:
        """Pop the mode, when it is the innermost one (the script's own modes stay)."""
        self.code = None
        if not self.pushed:
            return
        depth = _stack_depth()
        if depth and _stack_at(depth - 1) is self:
            _pop()
            self.pushed = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        # The leave-on price: every op of every step's loss code passes here, so the record
        # is made inline (no helper calls when no autocast region is on).
        if kwargs is None:
            kwargs = {}
        code = self.code
        if code is None:
            return func(*args, **kwargs)
        if func in _BACKWARD:
            self.code = None           # the loss reached backward: the loss code ends here
            code.roots.append((func, args, kwargs))
            return func(*args, **kwargs)
        writes = _MUTATES.get(func)          # inline (a C lookup): no call per op
        if writes is None:
            writes = mutates(func)
        if writes and args:
            target = args[0]
            if isinstance(target, torch.Tensor) and target.grad_fn is None \
                    and id(target) not in code.before:
                code.before[id(target)] = target.detach().clone()
        out = func(*args, **kwargs)
        if not _computes(func):
            return out
        ops = code.ops
        if len(ops) >= MAX_OPS:
            code.overflowed = True
            return out
        frame: FrameType | None = sys._getframe(1)      # the user's line
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        where = (None if frame is None else
                 (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        ops.append(_new(RecordedOp, (func, args, kwargs, out, where,
                                     autocast_state() if _any_autocast() else ())))
        return out


def replay(code: LossCode, env: dict[int, torch.Tensor],
           on_op: Any = None) -> dict[int, torch.Tensor]:
    """Run the recorded ops again, each tensor the run made replaced by the replay's (`env`:
    id of the first run's tensor -> the replay's, the model's outputs to start with); the
    tensors the script passed in (targets, masks) are used as they are, except one the code
    wrote into, replaced by a copy of it as it was before (LossCode.before). `on_op(where)` is told
    the user's line before each op. Returns `env`, grown by every op's outputs."""
    def swap(value: Any) -> Any:
        return env.get(id(value), value) if isinstance(value, torch.Tensor) else value
    for key, value in code.before.items():
        env.setdefault(key, value.clone())     # written into by the replay, not the run's
    for op in code.ops:
        outs = [t for t in tree_flatten(op.out)[0] if isinstance(t, torch.Tensor)]
        if not outs and not mutates(op.func):
            continue                   # `.item()`, `__bool__`: nothing a later op takes
        if on_op is not None:
            on_op(op.where)
        with autocast(op.autocast):
            new = op.func(*tree_map(swap, op.args), **tree_map(swap, op.kwargs))
        for old, made in zip(tree_flatten(op.out)[0], tree_flatten(new)[0]):
            if isinstance(old, torch.Tensor) and isinstance(made, torch.Tensor):
                env[id(old)] = made
    return env
