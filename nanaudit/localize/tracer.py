"""Record every aten op of a replayed step, forward and backward, and who produced each bad value.

`OpTracer` is a `TorchDispatchMode` that also holds global module hooks (after PyTorch's
FlopCounterMode + ModuleTracker, though it subclasses the mode rather than composing a private
one, so one object is the context manager and the op handler): every hook has a handle
removed on exit and the user's model is never modified. Three ideas make it work:

* Producer links. Only ops whose output holds NaN/Inf become events; each event remembers, per
  tensor input, the event that produced that input's bad value. Walking those links back from
  the value that tripped a sentinel finds the op that *created* it, and skips deliberate -inf
  (a mask) that never reached the loss or a gradient.
* Forward op for backward ops. A forward op's output gets its grad_fn only after the op returns,
  so outputs are tagged at the next op: `grad_fn.metadata["nanaudit"]` = the forward record.
  In backward, `torch._C._current_autograd_node()` is the node running, whose metadata names
  the forward op, its module and the user's source line: what anomaly mode's traceback gives,
  without its cost of formatting a stack per node.
* User frames. The source of a forward op is the first stack frame outside torch and nanaudit.

This runs only on replay: it syncs the host once per op, which the scan path never does.
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanaudit.errors import is_own_file
from nanaudit.localize.diagnose import keeps_inputs, op_base, scalar_infinities, scalar_overflows
from nanaudit.report.model import SourceLine
from nanaudit.run.checks import dense_values

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

# Ops that hand a value on unchanged: "where it came from" looks through them.
PASS_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "expand", "transpose", "t",
    "permute", "select", "slice", "alias", "clone", "contiguous", "detach", "flatten",
    "_to_copy", "lift_fresh", "index", "narrow", "as_strided",
})


def user_source() -> SourceLine | None:
    """The innermost stack frame outside torch and nanaudit: the user's line."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        ours = is_own_file(filename)
        if not filename.startswith(_TORCH_DIR) and not ours \
                and not frame.f_code.co_filename.startswith("<frozen"):
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return SourceLine(frame.f_code.co_filename, frame.f_lineno, code, frame.f_code.co_name)
        frame = frame.f_back
    return None


def schema_names(func) -> tuple:
    schema = getattr(func, "_schema", None)
    return tuple(a.name for a in schema.arguments) if schema is not None else ()


def written_arguments(func) -> set:
    """Positions of the tensor arguments an op writes to (`self` of `masked_fill_`, `out=`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return set()
    positions, index = set(), 0
    for argument in schema.arguments:
        if argument.type.kind() in ("TensorType", "OptionalType") or "Tensor" in str(argument.type):
            if argument.alias_info is not None and argument.alias_info.is_write:
                positions.add(index)
            index += 1
    return positions


RUNNING_STATISTICS = ("running_mean", "running_var")


def updated_statistics(func, args, kwargs) -> set:
    """Positions of the running statistics a batch norm in train mode updates in place even
    where its schema does not say so (`native_batch_norm`, `cudnn_batch_norm`): they are read
    after the op wrote them, so the NaN it wrote there is not an input it received."""
    names = schema_names(func)
    if "running_mean" not in names:
        return set()
    position = names.index("training") if "training" in names else None
    training = (kwargs or {}).get("training", args[position] if position is not None
                                  and position < len(args) else True)
    if not training:
        return set()
    tensors = [name for name, _ in named_tensors(names, args, kwargs)]
    return {i for i, name in enumerate(tensors) if name in RUNNING_STATISTICS}


def named_tensors(arg_names, args, kwargs) -> list:
    """(name, tensor) for each tensor argument, named by the op's schema (`self`, `other`)."""
    named = []
    for i, arg in enumerate(args or ()):
        label = arg_names[i] if i < len(arg_names) else f"arg{i}"
        if isinstance(arg, torch.Tensor):
            named.append((label, arg))
        elif isinstance(arg, (list, tuple)):
            named += [(f"{label}[{j}]", a) for j, a in enumerate(arg) if isinstance(a, torch.Tensor)]
    named += [(k, v) for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)]
    return named


def kinds_of(t: torch.Tensor) -> frozenset:
    """The non-finite kinds a floating tensor holds: subset of {'nan', 'inf', '-inf'} (syncs)."""
    t = dense_values(t)
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return frozenset()
    if bool(torch.isfinite(t).all()):
        return frozenset()
    if t.is_complex():
        t = torch.view_as_real(t)
    found = torch.stack([torch.isnan(t).any(), (t == float("inf")).any(),
                         (t == float("-inf")).any()]).tolist()
    return frozenset(k for k, f in zip(("nan", "inf", "-inf"), found) if f)


def carries(kinds: frozenset, kind: str) -> bool:
    """Does a tensor with these kinds explain an output of `kind` ('nan' or an infinity)?"""
    return "nan" in kinds if kind == "nan" else bool(kinds & {"inf", "-inf"})


@dataclass
class ForwardRecord:
    """A forward op as the backward sees it: name, module, user line, and whether it went bad."""

    index: int
    op: str
    module: str | None             # None: outside every module's forward (the loss callable)
    source: SourceLine | None
    out_kinds: frozenset = frozenset()
    args: Any = None               # kept only for ops the diagnosis reads (diagnose.keeps_inputs)
    kwargs: Any = None
    arg_names: tuple = ()
    event: int | None = None       # the OpEvent index, when this op's output went bad
    func: Any = None               # the aten OpOverload
    in_producers: tuple = ()       # events that made a bad value among its inputs (no sync)
    input_makers: tuple = ()       # the forward records that made its tensor inputs
    function: str | None = None    # a custom autograd.Function's class: this record stands for
    #                                its whole forward (the backward is the user's own code)


@dataclass
class OpEvent:
    """An op whose output held a non-finite value."""

    index: int
    op: str
    phase: str                     # "forward" | "backward"
    module: str | None
    source: SourceLine | None
    out_kinds: frozenset
    in_kinds: list                 # per tensor input
    in_producers: list             # per tensor input: index of the event that made it bad, or None
    forward: ForwardRecord | None  # for backward ops: the forward op whose gradient this is
    node: str | None = None        # autograd node name, e.g. SqrtBackward0
    args: Any = None
    kwargs: Any = None
    arg_names: tuple = ()
    func: Any = None               # the aten OpOverload
    untracked: dict = field(default_factory=dict)   # input position -> where an untraced bad
    #                                                 input came from (an autograd.Function ...)

    @property
    def function(self) -> str | None:
        """The custom autograd.Function whose hand-written backward ran this op, if any."""
        if self.phase == "backward" and self.forward is not None:
            return self.forward.function
        return None

    def created(self) -> set:
        """Kinds in the output that no input carried: this op made them."""
        made = set()
        if "nan" in self.out_kinds and not any(carries(k, "nan") for k in self.in_kinds):
            made.add("nan")
        if self.out_kinds & {"inf", "-inf"} and not any(carries(k, "inf") for k in self.in_kinds):
            made.add("inf")
        return made

    def infinite_inputs(self) -> list:
        """(position, producing event or None) of each tensor input that carried +-inf."""
        return [(i, p) for i, (k, p) in enumerate(zip(self.in_kinds, self.in_producers))
                if carries(k, "inf")]

    def scalar_infinities(self) -> list:
        """Non-finite Python numbers among the arguments (`masked_fill(m, float('-inf'))`)."""
        return scalar_infinities(self.args, self.kwargs, self.op)

    def scalar_overflows(self) -> list:
        """Finite Python numbers too large for the op's dtype (host values, `.item()`)."""
        return scalar_overflows(self.args, self.kwargs, self.op)


class _ModuleStack:
    """Global forward hooks keeping the stack of running modules' qualified names."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.handles = []

    def __enter__(self):
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        self.handles = [register_module_forward_pre_hook(self._push),
                        register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _push(self, module, args):
        self.stack.append(self.names.get(id(module), f"<{type(module).__name__}>"))

    def _pop(self, module, args, output):
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str | None:
        """The innermost running module; None outside every module's forward (the loss)."""
        return self.stack[-1] if self.stack else None


@dataclass
class Trace:
    """What a traced replay saw."""

    events: list = field(default_factory=list)          # [OpEvent]
    forward_records: list = field(default_factory=list)  # [ForwardRecord]
    producer: dict = field(default_factory=dict)         # id(tensor) -> event index
    makers: dict = field(default_factory=dict)           # id(tensor) -> (weakref, record index)
    ops_seen: int = 0

    def producer_of(self, t: torch.Tensor) -> int | None:
        return self.producer.get(id(t))

    def maker_index(self, t: torch.Tensor) -> int | None:
        entry = self.makers.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def maker_of(self, t: torch.Tensor) -> ForwardRecord | None:
        """The forward op that made a tensor (bad or not), looking through views and copies."""
        index = self.maker_index(t)
        record = self.forward_records[index] if index is not None else None
        while record is not None and op_base(record.op) in PASS_THROUGH and record.input_makers \
                and record.input_makers[0] is not None:
            record = self.forward_records[record.input_makers[0]]
        return record


# Allocations whose contents are undefined until something writes them.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                 "empty_permuted"}


class OpTracer(TorchDispatchMode):
    """Trace a forward and backward: use as `with OpTracer(model) as tracer:`; read `tracer.trace`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.trace = Trace()
        self.modules = _ModuleStack(model)
        self.phase = "forward"
        self._pending: list = []        # forward outputs waiting for their grad_fn
        self._keep: list = []           # bad tensors kept alive so their ids stay unique
        # tensors made inside a custom Function's backward: id -> (weakref, where), so a value
        # written into one outside torch ops (numpy, C code) is traced back to that backward
        self._function_made: dict = {}

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.modules.__exit__(*exc)

    def kept_tensors(self) -> list:
        """The non-finite outputs the trace kept alive (their ids name their producers)."""
        return list(self._keep)

    def start_backward(self) -> None:
        self._tag_pending()
        self.phase = "backward"

    def end_backward(self) -> None:
        """Back to forward ops: a user's step runs several forwards and backwards."""
        self.phase = "forward"

    def _tag_pending(self) -> None:
        for tensor, record in self._pending:
            node = tensor.grad_fn
            if node is not None and "nanaudit" not in node.metadata:
                node.metadata["nanaudit"] = record
        self._pending = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        backward = node is not None or self.phase == "backward"
        if not backward:
            self._tag_pending()
        out = func(*args, **kwargs)
        self.trace.ops_seen += 1
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = str(func)
        record = None
        if not backward:
            record = self._forward_record(func, name, args, kwargs)
            self._pending += [(t, record) for t in outputs]
            for t in outputs:
                self.trace.makers[id(t)] = (weakref.ref(t), record.index)
        out_kinds = frozenset().union(*(kinds_of(t) for t in outputs)) if outputs else frozenset()
        if out_kinds and func.overloadpacket.__name__ in UNINITIALIZED:
            # Fresh memory holds whatever bits were there, NaN patterns included: it is no
            # value yet, and what later writes into it (numpy, a C extension) made the value.
            out_kinds = frozenset()
        if record is not None:
            record.out_kinds = out_kinds
        if out_kinds:
            self._record_event(func, backward, node, record, args, kwargs, outputs, out_kinds)
        else:
            for t in outputs:        # an in-place op may have made a bad tensor finite again
                self.trace.producer.pop(id(t), None)
        if backward and hasattr(node, "_forward_cls"):
            self._note_function_outputs(node, outputs)
        return out

    def _note_function_outputs(self, node, outputs) -> None:
        """Remember tensors a custom Function's backward made, so a value written into one
        later outside torch ops (numpy, C code writing its memory) is traced to that backward."""
        where = f"a tensor made in the backward of the autograd.Function " \
                f"{node._forward_cls.__qualname__}"
        source = user_source()
        if source is not None:
            where += f" ({os.path.basename(source.file)}:{source.line})"
        for t in outputs:
            self._function_made[id(t)] = (weakref.ref(t), where)

    def _forward_record(self, func, name, args, kwargs) -> ForwardRecord:
        keep = keeps_inputs(func)
        inputs = [t for _, t in named_tensors(schema_names(func), args, kwargs)]
        record = ForwardRecord(len(self.trace.forward_records), name, self.modules.current,
                               user_source(), args=args if keep else None,
                               kwargs=kwargs if keep else None, arg_names=schema_names(func),
                               func=func,
                               in_producers=tuple(self.trace.producer.get(id(t)) for t in inputs),
                               input_makers=tuple(self.trace.maker_index(t) for t in inputs))
        self.trace.forward_records.append(record)
        return record

    def _record_event(self, func, backward, node, record, args, kwargs, outputs, out_kinds):
        name = str(func)
        inputs = [t for _, t in named_tensors(schema_names(func), args, kwargs)]
        in_kinds = [kinds_of(t) for t in inputs]
        in_producers = [self.trace.producer_of(t) if k else None
                        for t, k in zip(inputs, in_kinds)]
        written = written_arguments(func) | updated_statistics(func, args, kwargs)
        for i, (t, p) in enumerate(zip(inputs, in_producers)):
            # An in-place op's target is read after the op wrote it: it only carried a bad value
            # in if an earlier op had made it bad (then it has a producer).
            if i in written and p is None:
                in_kinds[i] = frozenset()
        forward = node.metadata.get("nanaudit") if node is not None else None
        source = (forward.source if forward else None) if backward else record.source
        if backward and hasattr(node, "_forward_cls"):
            # The user's own backward runs this op: its line is on the stack, and the forward
            # "op" is the whole Function (its last inner op is not what this is the gradient of).
            forward = function_record(node, forward)
            source = user_source()
        event = OpEvent(
            index=len(self.trace.events), op=name,
            phase="backward" if backward else "forward",
            module=(forward.module if forward else None) if backward else record.module,
            source=source,
            out_kinds=out_kinds, in_kinds=in_kinds, in_producers=in_producers,
            forward=forward, node=node.name() if node is not None else None,
            args=args, kwargs=kwargs, arg_names=schema_names(func), func=func,
            untracked={i: self._untracked_origin(t, node) for i, (t, k, p)
                       in enumerate(zip(inputs, in_kinds, in_producers)) if k and p is None})
        self.trace.events.append(event)
        if record is not None:
            record.event = event.index
        for t in outputs:
            if kinds_of(t):
                self.trace.producer[id(t)] = event.index
                self._keep.append(t)

    def _untracked_origin(self, t: torch.Tensor, node) -> str:
        made = self._function_made.get(id(t))
        if made is not None and made[0]() is t:
            return f"{made[1]} and written outside torch ops (numpy or C code on its memory)"
        if hasattr(node, "_forward_cls"):  # inside a Function's backward (numpy, C code)
            return f"code inside the backward of the autograd.Function " \
                   f"{node._forward_cls.__qualname__}"
        return untracked_origin(t)


def function_record(node, inner: ForwardRecord | None) -> ForwardRecord:
    """The forward record standing for a whole custom autograd.Function (one per node): named
    by its class, in the module and at the line where its forward ran."""
    record = node.metadata.get("nanaudit_function")
    if record is None:
        name = node._forward_cls.__qualname__
        record = ForwardRecord(inner.index if inner else -1, f"autograd.Function {name}",
                               inner.module if inner else None, inner.source if inner else None,
                               out_kinds=inner.out_kinds if inner else frozenset(),
                               event=inner.event if inner else None, function=name)
        node.metadata["nanaudit_function"] = record
    return record


def untracked_origin(t: torch.Tensor) -> str:
    """Where a non-finite input that no traced op produced came from, as far as torch knows."""
    forward_cls = getattr(t.grad_fn, "_forward_cls", None)
    if forward_cls is not None:           # the output of a custom autograd.Function
        return f"the output of the autograd.Function {forward_cls.__qualname__}"
    function = _running_function()
    if function is not None:              # made inside a Function's forward (numpy, C code)
        return f"code inside the forward of the autograd.Function {function}"
    if t.grad_fn is not None:
        return f"the autograd node {t.grad_fn.name()}"
    return "a tensor made outside the traced ops (a constant, numpy, the batch, .item())"


def _running_function() -> str | None:
    """The custom autograd.Function whose forward is on the stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if frame.f_code.co_name == "forward" and "." in qualname:
            owner = frame.f_globals.get(qualname.split(".")[0])
            if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
                return owner.__qualname__
        frame = frame.f_back
    return None


def walk_back(trace: Trace, start: int, kind: str) -> tuple[OpEvent, list]:
    """From the event that made the sink bad, follow inputs carrying `kind` to the creator.

    Returns the creating event and the chain of events from it to `start`.
    """
    chain = []
    event = trace.events[start]
    seen = set()
    while event.index not in seen:
        seen.add(event.index)
        chain.append(event)
        sources = [p for k, p in zip(event.in_kinds, event.in_producers) if carries(k, kind)]
        if not sources:
            break                      # no input carried it: this op created it
        upstream = [p for p in sources if p is not None]
        if not upstream:
            break                      # carried in by an untracked tensor: the first op we saw
        event = trace.events[upstream[0]]
    return event, list(reversed(chain))
