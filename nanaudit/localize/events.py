"""What a traced replay records: the non-finite kinds a tensor holds, the forward ops as the
backward sees them, the ops whose output went bad, and the trace that links them.

Only ops whose output holds NaN/Inf become events; each event remembers, per tensor input, the
event that produced that input's bad value. Walking those links back from the value that tripped
a sentinel finds the op that *created* it (see walk.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.localize.ops import op_base, scalar_infinities, scalar_overflows
from nanaudit.report.model import SourceLine
from nanaudit.report.vocabulary import Where
from nanaudit.run.checks import dense_values


def kinds_of(t: torch.Tensor) -> frozenset:
    """The non-finite kinds a floating tensor holds: subset of {'nan', 'inf', '-inf'} (syncs)."""
    t = dense_values(t)
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.is_meta:
        return frozenset()          # (a meta tensor holds no values: a `torch.func` template's)
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


def signed(kinds: set | frozenset) -> str:
    """'-inf', '+inf', '+-inf' or 'NaN' for a set of kinds, for explanations."""
    kinds = set(kinds)
    if "nan" in kinds:
        return "NaN"
    if kinds >= {"inf", "-inf"}:
        return "+-inf"
    return "-inf" if "-inf" in kinds else "+inf"


@dataclass
class ForwardRecord:
    """A forward op as the backward sees it: name, module, user line, and whether it went bad."""

    index: int
    op: str
    module: str | None             # None: outside every module's forward (the loss callable)
    source: SourceLine | None
    out_kinds: frozenset = frozenset()
    args: Any = None               # kept only for ops a rule reads (rules.registry.keeps_inputs)
    kwargs: Any = None
    arg_names: tuple = ()
    event: int | None = None       # the OpEvent index, when this op's output went bad
    func: Any = None               # the aten OpOverload
    in_producers: tuple = ()       # events that made a bad value among its inputs (no sync)
    input_makers: tuple = ()       # the forward records that made its tensor inputs
    function: str | None = None    # a custom autograd.Function's class: this record stands for
    #                                its whole forward (the backward is the user's own code)
    reads_weights: bool = False    # a trainable leaf (a parameter, or a view of one) is an input


@dataclass
class OpEvent:
    """An op whose output held a non-finite value."""

    index: int
    op: str
    phase: Where                   # forward or backward
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
    # (name, input, path) of each input an op reading a parameter an update grew made (through
    # contractions: weight_growth.grown_makers), for the overflow that growth made downstream
    grown_paths: tuple = ()

    @property
    def function(self) -> str | None:
        """The custom autograd.Function whose hand-written backward ran this op, if any."""
        if self.phase == Where.BACKWARD and self.forward is not None:
            return self.forward.function
        return None

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


def _storage(t: torch.Tensor) -> tuple | None:
    """Where a dense tensor's memory is (device, address); None for one without storage."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


# Ops that hand a value on unchanged: "where it came from" looks through them.
PASS_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "expand", "transpose", "t",
    "permute", "select", "slice", "alias", "clone", "contiguous", "detach", "flatten",
    "_to_copy", "lift_fresh", "index", "narrow", "as_strided",
})


@dataclass
class Trace:
    """What a traced replay saw."""

    events: list = field(default_factory=list)          # [OpEvent]
    forward_records: list = field(default_factory=list)  # [ForwardRecord]
    producer: dict = field(default_factory=dict)         # id(tensor) -> event index
    makers: dict = field(default_factory=dict)           # id(tensor) -> (weakref, record index)
    ops_seen: int = 0
    written: dict = field(default_factory=dict)          # storage -> event that wrote a bad value
    # Who updated the parameters the ops read (weight_growth.WeightHistory): set by the
    # checker that owns the replay, for the overflow an update made; None where none is known.
    # (typed Any: weight_growth imports the rules, whose stats import this module)
    weights: Any = None

    def producer_of(self, t: torch.Tensor) -> int | None:
        """The event that made `t` bad: by the tensor, else by the memory an op wrote a bad
        value into (a view made below autograd, as FSDP's flat reduce-scatter buffer is
        filled, is not the tensor the op returned)."""
        found = self.producer.get(id(t))
        local = getattr(t, "_local_tensor", None)    # a DTensor: the op made its local tensor
        if found is None and local is not None:
            found = self.producer.get(id(local))
        return found if found is not None else self.written.get(_storage(local if local
                                                                         is not None else t))

    def wrote_into(self, t: torch.Tensor, event: int) -> None:
        """An in-place or `out=` op wrote a bad value into `t`'s memory."""
        key = _storage(t)
        if key is not None:
            self.written[key] = event

    def maker_index(self, t: torch.Tensor) -> int | None:
        entry = self.makers.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def maker_of(self, t: torch.Tensor) -> ForwardRecord | None:
        """The forward op that made a tensor (bad or not), looking through views and copies."""
        return self.record_at(self.maker_index(t))

    def record_at(self, index: int | None) -> ForwardRecord | None:
        """The forward record `index`, looking through views and copies to the op that made
        the values (None: no traced op did, or one wrote into them since)."""
        record = self.forward_records[index] if index is not None else None
        while record is not None and op_base(record.op) in PASS_THROUGH:
            if not record.input_makers or record.input_makers[0] is None:
                return None     # a view of a tensor no traced op made (or one written since)
            record = self.forward_records[record.input_makers[0]]
        return record

    def walk_back(self, start: int, kind: str) -> tuple[OpEvent, list]:
        """From the event that made the sink bad, follow inputs carrying `kind` to the creator.

        Returns the creating event and the chain of events from it to `start`.
        """
        chain = []
        event = self.events[start]
        seen = set()
        while event.index not in seen:
            seen.add(event.index)
            chain.append(event)
            sources = [p for k, p in zip(event.in_kinds, event.in_producers) if carries(k, kind)]
            if not sources:
                break                  # no input carried it: this op created it
            upstream = [p for p in sources if p is not None]
            if not upstream:
                break                  # carried in by an untracked tensor: the first op we saw
            event = self.events[upstream[0]]
        return event, list(reversed(chain))
