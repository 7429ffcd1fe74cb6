"""Record every aten op of a replayed step, forward and backward, and who produced each bad value.

`OpTracer` is a plain context manager holding a private `TorchDispatchMode` and a module stack
(after PyTorch's FlopCounterMode + ModTracker): every hook has a handle removed on exit and the
user's model is never modified. Three ideas make it work:

* Producer links. Only ops whose output holds NaN/Inf become events (events.py); each event
  remembers, per tensor input, the event that produced that input's bad value.
* Forward op for backward ops. A forward op's output gets its grad_fn only after the op returns,
  so outputs are tagged at the next op: `grad_fn.metadata["nanaudit"]` = the forward record.
  In backward, `torch._C._current_autograd_node()` is the node running, whose metadata names
  the forward op, its module and the user's source line: what anomaly mode's traceback gives,
  without its cost of formatting a stack per node.
* User frames. The source of a forward op is the first stack frame outside torch and nanaudit.

This runs only on replay: it syncs the host once per op, which the scan path never does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import linecache
import os
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanaudit.errors import delegates, is_own_file
from nanaudit.localize.events import ForwardRecord, OpEvent, Trace, kinds_of
from nanaudit.localize.module_stack import ModuleStack
from nanaudit.localize.ops import named_tensors, schema_names
from nanaudit.localize.rules.registry import keeps_inputs
from nanaudit.localize.weight_growth import GrownWeights, WeightHistory
from nanaudit.report.model import SourceLine
from nanaudit.report.vocabulary import Where
from nanaudit.run.compiled import replay_eagerly

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
# The user's line of the op nanaudit is replaying from a record (`nanaudit run`'s loss code,
# script/inprocess.py): the call comes from nanaudit's frames, the line is the script's.
REPLAYED_LINE: contextvars.ContextVar[SourceLine | None] = contextvars.ContextVar(
    "REPLAYED_LINE", default=None)
# ... and the module whose forward made that call (a second model the loss code called: the
# replay runs its recorded ops, not its forward, so no module hook says it)
REPLAYED_MODULE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "REPLAYED_MODULE", default=None)


def user_source() -> SourceLine | None:
    """The innermost stack frame outside torch: the user's line (None when nanaudit's own
    code made the call, not the user's: frames further out are the command line's)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        kind = _file_kind(frame.f_code.co_filename)
        if kind == "ours" and frame.f_code.co_name == "__torch_function__":
            kind = "skip"       # a mode of ours passing the user's call on (the loss recorder)
        if kind == "ours":
            # nanaudit called torch itself (reading the data again): no user line, unless it
            # replays a recorded call of the user's
            return REPLAYED_LINE.get()
        if kind == "user":
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return SourceLine(frame.f_code.co_filename, frame.f_lineno, code, frame.f_code.co_name)
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=4096)
def _file_kind(name: str) -> str:
    """"skip" (torch, frozen modules, the dispatch mode's own frames), "ours" or "user": read
    once per file, as every op of a traced stretch asks it of every frame on the stack."""
    filename = os.path.abspath(name)
    if filename == _THIS_FILE or filename.startswith(_TORCH_DIR) or name.startswith("<frozen"):
        return "skip"
    return "ours" if is_own_file(filename) else "user"


@functools.cache
def written_arguments(func: Any) -> frozenset:
    """Positions of the tensor arguments an op writes to (`self` of `masked_fill_`, `out=`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return frozenset()
    positions, index = set(), 0
    for argument in schema.arguments:
        if argument.type.kind() in ("TensorType", "OptionalType") or "Tensor" in str(argument.type):
            if argument.alias_info is not None and argument.alias_info.is_write:
                positions.add(index)
            index += 1
    return frozenset(positions)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes to, by its schema (`Tensor(a!)`, `Tensor(a!)[]`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else (kwargs or {}).get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


RUNNING_STATISTICS = ("running_mean", "running_var")


def updated_statistics(func: Any, args: tuple, kwargs: dict) -> set:
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


# Allocations whose contents are undefined until something writes them.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                 "empty_permuted"}


class _TracingMode(TorchDispatchMode):
    """The dispatch mode an OpTracer enters: hands every op to the tracer. The tracer's own
    torch calls run with the mode popped, so they are not traced."""

    def __init__(self, tracer: OpTracer):
        super().__init__()
        self.tracer = tracer

    @delegates
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return self.tracer.run_op(func, args, kwargs or {})


class OpTracer:
    """Trace a forward and backward: use as `with OpTracer(model) as tracer:`; read `tracer.trace`.

    The caller says when backward starts and ends (`start_backward`, `end_backward`, or sets
    `phase`): a user's step runs several forwards and backwards."""

    def __init__(self, model: torch.nn.Module, others: dict[int, str] | None = None,
                 weights: WeightHistory | None = None):
        self.trace = Trace(weights=weights)    # `weights`: who updated the parameters (events.py)
        self._grown = GrownWeights(self.trace)     # an op reading a grown weight keeps its inputs
        self.modules = ModuleStack(model, others)     # `others`: other modules' names
        self.phase = Where.FORWARD
        self._mode = _TracingMode(self)
        self._exit = contextlib.ExitStack()
        self._pending: list = []        # forward outputs waiting for their grad_fn
        self._keep: list = []           # bad tensors kept alive so their ids stay unique
        # tensors made inside a custom Function's backward: id -> (weakref, where), so a value
        # written into one outside torch ops (numpy, C code) is traced back to that backward
        self._function_made: dict = {}

    def __enter__(self) -> OpTracer:
        with contextlib.ExitStack() as entering:
            # A compiled model runs eagerly under the tracer: every aten op is the user's own.
            entering.enter_context(replay_eagerly())
            entering.enter_context(self.modules)
            entering.enter_context(self._mode)
            self._exit = entering.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exit.__exit__(*exc)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The non-finite op outputs the tracer saw, oldest first (kept alive, so the trace's
        `producer` ids stay theirs)."""
        return list(self._keep)

    def start_backward(self) -> None:
        self._tag_pending()
        self.phase = Where.BACKWARD

    def end_backward(self) -> None:
        """Back to forward ops: a user's step runs several forwards and backwards."""
        self.phase = Where.FORWARD

    def _tag_pending(self) -> None:
        for tensor, record in self._pending:
            node = tensor.grad_fn
            if node is not None and "nanaudit" not in node.metadata:
                node.metadata["nanaudit"] = record
        self._pending = []

    @delegates
    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one aten op and record it (the dispatch mode's handler)."""
        node = torch._C._current_autograd_node()
        backward = (node is not None or self.phase == Where.BACKWARD) \
            and not self._recomputes(node)
        if self._pending:            # in backward too: a recomputed forward's last outputs
            self._tag_pending()
        out = func(*args, **kwargs)
        self.trace.ops_seen += 1
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs:
            # An op returning nothing wrote its results into its arguments (`_foreach_add_`,
            # FSDP's `chunk_cat(..., out=)` filling the buffer it reduce-scatters).
            outputs = written_tensors(func, args, kwargs)
        record = None
        if not backward:
            record = self._forward_record(func, str(func), args, kwargs)
            self._pending += [(t, record) for t in outputs]
            for t in outputs:
                self.trace.makers[id(t)] = (weakref.ref(t), record.index)
            self._forget_overwritten(func, args, kwargs)
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

    def _recomputes(self, node: Any) -> bool:
        """A forward recomputed inside backward: a reentrant activation checkpoint (torch's
        `checkpoint(use_reentrant=True)`, the default of transformers 4's gradient checkpointing,
        and DeepSpeed's or Megatron's) runs its first forward without autograd, then, in its
        custom Function's backward, the modules' forward again with grad mode on and the inner
        backward through it. Those are forward ops: the inner backward's nodes name them. (A
        Function's own backward runs with grad mode off unless it differentiates twice, and
        then not inside a module's forward.)"""
        return (node is not None and hasattr(node, "_forward_cls") and bool(self.modules.stack)
                and torch.is_grad_enabled())

    def _forget_overwritten(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A write into a view (`x[5, 2] = 0`) changes its base: the op that made the base no
        longer made all its values, so where they came from is not said at all."""
        written = written_arguments(func)
        if not written:
            return
        tensors = [t for _, t in named_tensors(schema_names(func), args, kwargs)]
        for i in written:
            base = tensors[i]._base if i < len(tensors) else None
            if base is not None:
                self.trace.makers.pop(id(base), None)

    def _note_function_outputs(self, node: Any, outputs: Any) -> None:
        """Remember tensors a custom Function's backward made, so a value written into one
        later outside torch ops (numpy, C code writing its memory) is traced to that backward."""
        where = f"a tensor made in the backward of the autograd.Function " \
                f"{node._forward_cls.__qualname__}"
        source = user_source()
        if source is not None:
            where += f" ({os.path.basename(source.file)}:{source.line})"
        for t in outputs:
            self._function_made[id(t)] = (weakref.ref(t), where)

    def _forward_record(self, func: Any, name: str, args: tuple, kwargs: dict) -> ForwardRecord:
        inputs = [t for _, t in named_tensors(schema_names(func), args, kwargs)]
        # an op reading weights an update grew keeps its inputs: an overflow downstream of it
        # is weighed against them (weight_growth.grown_upstream)
        keep = keeps_inputs(func) or self._grown.read_by(inputs)
        module = self.modules.current
        if module is None:          # "" is the model itself
            module = self.modules.name_of(REPLAYED_MODULE.get())
        record = ForwardRecord(len(self.trace.forward_records), name, module,
                               user_source(), args=args if keep else None,
                               kwargs=kwargs if keep else None, arg_names=schema_names(func),
                               func=func,
                               in_producers=tuple(self.trace.producer.get(id(t)) for t in inputs),
                               input_makers=tuple(self.trace.maker_index(t) for t in inputs),
                               reads_weights=any(_trainable_leaf(t) for t in inputs))
        self.trace.forward_records.append(record)
        return record

    def _record_event(self, func: Any, backward: Any, node: Any, record: Any, args: tuple,
                      kwargs: dict, outputs: Any, out_kinds: Any) -> None:
        inputs = [t for _, t in named_tensors(schema_names(func), args, kwargs)]
        in_kinds = [kinds_of(t) for t in inputs]
        in_producers = [self.trace.producer_of(t) if k else None
                        for t, k in zip(inputs, in_kinds)]
        written = written_arguments(func) | updated_statistics(func, args, kwargs)
        for i, p in enumerate(in_producers):
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
            index=len(self.trace.events), op=str(func),
            phase=Where.BACKWARD if backward else Where.FORWARD,
            module=(forward.module if forward else None) if backward else record.module,
            source=source,
            out_kinds=out_kinds, in_kinds=in_kinds, in_producers=in_producers,
            forward=forward, node=node.name() if node is not None else None,
            args=args, kwargs=kwargs, arg_names=schema_names(func), func=func,
            untracked={i: self._untracked_origin(t, node) for i, (t, k, p)
                       in enumerate(zip(inputs, in_kinds, in_producers)) if k and p is None},
            grown_paths=() if backward else self._grown.paths(schema_names(func), args, kwargs))
        self.trace.events.append(event)
        if record is not None:
            record.event = event.index
        for t in outputs:
            if kinds_of(t):
                self.trace.producer[id(t)] = event.index
                self._keep.append(t)
                local = getattr(t, "_local_tensor", None)
                if local is not None:
                    # A DTensor op: the local ops that follow (a collective, to_local()) read
                    # its local tensor, which this op made.
                    self.trace.producer[id(local)] = event.index
                if written:
                    # The memory holds the value now, whatever tensor is read from it later
                    # (a flat buffer filled below autograd, as FSDP's reduce-scatter's is).
                    self.trace.wrote_into(t, event.index)
                if t._base is not None and any(t is inputs[i] for i in written
                                               if i < len(inputs)):
                    # written into a view (`x[11, 3] = nan`): its base holds the value now
                    self.trace.producer[id(t._base)] = event.index
                    self._keep.append(t._base)

    def _untracked_origin(self, t: torch.Tensor, node: Any) -> str:
        made = self._function_made.get(id(t))
        if made is not None and made[0]() is t:
            return f"{made[1]} and written outside torch ops (numpy or C code on its memory)"
        if hasattr(node, "_forward_cls"):  # inside a Function's backward (numpy, C code)
            return f"code inside the backward of the autograd.Function " \
                   f"{node._forward_cls.__qualname__}"
        return untracked_origin(t)


def _trainable_leaf(t: torch.Tensor) -> bool:
    root = t._base if t._base is not None else t
    return root.is_leaf and root.requires_grad


def function_record(node: Any, inner: ForwardRecord | None) -> ForwardRecord:
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
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if frame.f_code.co_name == "forward" and "." in qualname:
            owner = frame.f_globals.get(qualname.split(".")[0])
            if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
                return owner.__qualname__
        frame = frame.f_back
    return None
