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
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from nanaudit.errors import delegates, is_own_file

MAX_OPS = 4096            # a "loss code" longer than this is a loop of its own: not replayable
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# What ends the loss code (one set: looked up by every recorded op); a tap that wraps
# `torch.autograd.backward` adds its wrapper (`differentiates`), which a direct
# `torch.autograd.backward([...])` reaches the mode as.
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_stack_depth, _stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_push, _pop = torch._C._push_on_torch_function_stack, torch._C._pop_torch_function_stack
_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch._C.is_grad_enabled
# In-place Python operators: they write their first argument, as a method ending in `_` does.
_IN_PLACE = frozenset(("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
                       "__ilshift__", "__irshift__", "__setitem__"))


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
    grad: bool = True                   # grad mode was on (`with torch.no_grad():` off)
    module: Any = None                  # the module whose forward called it (a second model)


_new = tuple.__new__


class LossCode:
    """The recorded loss code of one model call: its ops, the (func, args, kwargs) of each
    backward it reached, and whether it ran past MAX_OPS."""

    __slots__ = ("ops", "overflowed", "roots", "whole_step")

    def __init__(self, whole_step: bool = False) -> None:
        self.ops: list[RecordedOp] = []
        self.roots: list[tuple[Any, tuple, dict]] = []
        self.overflowed = False
        # A step's code from its start (no model call): past MAX_OPS its ops are let go (an
        # evaluation loop between steps would keep every output alive) and nothing more is kept.
        self.whole_step = whole_step

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


    def earlier_losses(self) -> list[torch.Tensor]:
        """A whole step's code that ran its loss line again before its first backward (a loop
        whose guard skipped a loss: `if not torch.isfinite(loss): continue`): the losses of the
        earlier passes. Each is a differentiable floating scalar made at a line whose ops ran
        again after another line's (`-(...).mean()` makes two scalars in one run of its line),
        and read by no later op into a differentiable value (a sum built up over a loop, `loss
        = loss + ce`, is read by its next term). No tensor is read."""
        made = self._scalars()
        last_run = {}
        for where, _i, _t, run in made:
            last_run[where] = run
        candidates = [(i, t) for where, i, t, run in made if run < last_run[where]]
        if not candidates:
            return []        # the common case: one pass over the ops, no argument read
        return self._unread(candidates)

    def dead_losses(self) -> list[torch.Tensor]:
        """Every differentiable floating scalar the code made and no later op read into a
        differentiable value, in the order made: a step's code that reached no backward at
        all (its loop's last pass skipped its loss, then the script ended)."""
        made = [(i, t) for _where, i, t, _run in self._scalars()]
        return self._unread(made) if made else []

    def _scalars(self) -> list[tuple[tuple[str, int, str], int, torch.Tensor, int]]:
        """The differentiable floating scalars the ops made: (the user's line, the op's index,
        the scalar, the run of consecutive ops at one line it was made in)."""
        made, run, before = [], 0, None
        for i, op in enumerate(self.ops):
            where, out = op.where, op.out
            if where != before:
                run, before = run + 1, where
            if (where is not None and isinstance(out, torch.Tensor) and out.numel() == 1
                    and out.requires_grad and out.is_floating_point()):
                made.append((where, i, out, run))
        return made

    def _unread(self, made: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """Those of `made` no op read into a differentiable value (a tensor is read only after
        it was made, and the record keeps each alive: ids are unique)."""
        read = {id(t) for op in self.ops if any(t.requires_grad for t in _tensors(op.out))
                for t in _tensors((*op.args, *op.kwargs.values()))}
        return [t for _i, t in made if id(t) not in read]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op's output or arguments: flat ones without a pytree walk."""
    for v in (value,) if isinstance(value, torch.Tensor) else value if isinstance(
            value, tuple) else tree_flatten(value)[0]:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple, dict)):
            yield from (t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))


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

    @delegates
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

    @delegates
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        # The leave-on price: every op of every step's loss code passes here, so the record
        # is made inline (no helper calls when no autocast region is on).
        if kwargs is None:
            kwargs = {}
        code = self.code
        if code is None:
            return func(*args, **kwargs)
        if func in _BACKWARD and not _graph_made(func, args, kwargs):
            self.code = None           # the loss reached backward: the loss code ends here
            code.roots.append((func, args, kwargs))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not _computes(func):
            return out
        ops = code.ops
        if len(ops) >= MAX_OPS:
            code.overflowed = True
            if code.whole_step:
                code.ops, self.code = [], None
            return out
        frame: FrameType | None = sys._getframe(1)      # the user's line
        module = None
        while frame is not None:
            called = frame.f_code
            if module is None and called.co_name == "forward":
                # inside a module's forward (a second model the loss code calls: a critic, a
                # teacher): which one, for the replay to name (one dict read, only there)
                module = frame.f_locals.get("self")
            if is_user_file(called.co_filename):
                break
            frame = frame.f_back
        where = (None if frame is None else
                 (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        ops.append(_new(RecordedOp, (func, args, kwargs, out, where,
                                     autocast_state() if _any_autocast() else (),
                                     _grad_enabled(), module)))
        return out


def differentiates(func: Any) -> Any:
    """Count `func`, a wrapper of `torch.autograd.backward`, as a backward: returns what
    forgets it again."""
    _BACKWARD.add(func)
    return lambda: _BACKWARD.discard(func)


def _graph_made(func: Any, args: tuple, kwargs: dict) -> bool:
    """`torch.autograd.grad(..., create_graph=True)`: gradients that are part of the loss (a
    gradient penalty, a meta-learning step's inner update), not its end: recorded as an op,
    replayed as one, and the loss code goes on to the `backward` that does end it."""
    if func is not torch.autograd.grad:
        return False
    return bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))


def replay(code: LossCode, env: dict[int, torch.Tensor], on_op: Any = None,
           writable: frozenset = frozenset()) -> dict[int, torch.Tensor]:
    """Run the recorded ops again, each tensor the run made replaced by the replay's (`env`:
    id of the first run's tensor -> the replay's, the model's outputs to start with); the
    tensors the script passed in (targets, masks) are used as they are, but never written: one
    the code writes into (`metric += loss.detach()`, `counts[label] += 1`, `p.zero_()`), or
    into a view of, is replaced by a copy of its storage, which later ops read, so the replay
    leaves the script's state as the trip left it (a replayed update applied twice would
    change what the script goes on with). Each op runs in the grad mode it ran in (a teacher's
    `no_grad` forward makes no graph). `on_op(where, module)` is told the user's line and the
    module whose forward called it (None: the loss code's own) before each op. `writable`:
    the storages (`storage_key`) the replay's caller puts back afterwards (the buffers of a
    module the code called, a quantizer's codebook), written in place, so the replay's values
    are where the check reads them.
    A generator of the script's own that an op draws from (`generator=`) is left as the trip
    left it. Returns `env`, grown by every op's outputs."""
    with _generators_kept(code):
        return _replayed(code, env, on_op, writable)


@contextlib.contextmanager
def _generators_kept(code: LossCode) -> Iterator[None]:
    """The states of the generators the recorded ops name (`randn(..., generator=g)`, a
    sampler's `randperm`) put back after the replay drew from them."""
    kept = {id(g): g for op in code.ops
            if isinstance(g := op.kwargs.get("generator"), torch.Generator)}
    states = [(g, g.get_state()) for g in kept.values()]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)


def _replayed(code: LossCode, env: dict[int, torch.Tensor], on_op: Any,
              writable: frozenset) -> dict[int, torch.Tensor]:
    writes = [_written(op.func, op.args, op.kwargs) for op in code.ops]
    written = {id(_storage_of(t)) for ts in writes for t in ts
               if not writable or storage_key(t) not in writable}

    def swap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        again = env.get(id(value))
        if again is None and id(_storage_of(value)) in written:
            again = _private_copy(value, env)
        return value if again is None else again
    for op, writes_into in zip(code.ops, writes):
        outs = [t for t in tree_flatten(op.out)[0] if isinstance(t, torch.Tensor)]
        if not outs and not writes_into:
            # `.item()`, `__bool__`: nothing a later op takes; but `x[i] = v` returns None
            # and writes what a later op (or model call) reads: `encoder_outputs[ei] = ...`
            continue
        if on_op is not None:
            on_op(op.where, op.module)
        with autocast(op.autocast), torch.set_grad_enabled(op.grad):
            new = op.func(*tree_map(swap, op.args), **tree_map(swap, op.kwargs))
        for old, again in zip(tree_flatten(op.out)[0], tree_flatten(new)[0]):
            if isinstance(old, torch.Tensor) and isinstance(again, torch.Tensor):
                env[id(old)] = again
    return env


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a torch call writes: an in-place method's (`add_`) or operator's (`+=`,
    `x[i] = v`) first argument, `inplace=True`'s input, and `out=`."""
    name = getattr(func, "__name__", "")
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    written = [first] if first is not None and (
        (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE
        or kwargs.get("inplace") is True) else []
    out = kwargs.get("out")
    written += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return written


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which storage `t` views (its aliases, `.data` among them, share it)."""
    return str(t.device), t.untyped_storage().data_ptr()


def _storage_of(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _private_copy(value: torch.Tensor, env: dict[int, torch.Tensor]) -> torch.Tensor:
    """The replay's own copy of `value`, a tensor of the script's whose storage the code writes:
    its storage copied once (kept in `env` under the tensor that owns it), `value` as the same
    view of the copy."""
    base = _storage_of(value)
    copy = env.get(id(base))
    if copy is None:
        owner = base.detach()
        copy = torch.empty(0, dtype=owner.dtype, device=owner.device).set_(
            owner.untyped_storage().clone(), owner.storage_offset(), owner.size(),
            owner.stride())
        env[id(base)] = copy
    if value is base:
        return copy
    view = copy.as_strided(value.size(), value.stride(), value.storage_offset())
    env[id(value)] = view
    return view
