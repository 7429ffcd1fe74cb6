"""The one op registry: which aten ops a domain rule explains, and so which forward ops the
tracer keeps the inputs of.

Rules are keyed on the aten overload packet (`aten.log`, with its in-place `aten.log_`), after
PyTorch's `flop_registry`; an op registered twice is an error. The tracer asks `keeps_inputs`,
the diagnosis asks `domain_reason`, and both read this one table, so they cannot disagree about
which ops have a rule. A rule gets the op's base name, its arguments and the phase, and returns
a `Reason` with the real numbers, or None when the inputs do not explain the value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from nanaudit.localize.ops import op_base, packet_of
from nanaudit.localize.stats import first_index
from nanaudit.report.vocabulary import Cause

aten = torch.ops.aten


class Reason(NamedTuple):
    """What a rule found: the cause, the explanation, a fix when the catalogue's is too generic,
    and the operand that hit the edge (so the localizer can say where that value came from)."""

    cause: Cause
    text: str
    fix: str | None = None
    operand: Any = None
    mask: Any = None


# rule(base, args, kwargs, phase) -> Reason | None
Rule = Callable[[str, tuple, dict, str], Reason | None]

RULES: dict[Any, Rule] = {}   # OpOverloadPacket -> the rule that explains it
PRODUCERS: set = set()        # packets an explanation names as the source of a value


def packets(names: Iterable[str]) -> Iterator[Any]:
    """The aten packets of these op names and of their in-place variants (which share a rule);
    names this torch does not have are skipped."""
    for name in names:
        for variant in (name, f"{name}_"):
            try:
                yield getattr(aten, variant)
            except (AttributeError, RuntimeError):
                continue


def domain_rule(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for aten ops by name; an op registered twice is an error."""
    def register(rule: Rule) -> Rule:
        for packet in packets(names):
            if packet in RULES:
                raise ValueError(f"{packet} has two domain rules ({RULES[packet].__name__}, "
                                 f"{rule.__name__})")
            RULES[packet] = rule
        return rule
    return register


# Ops an explanation names as the source of a value that sits on an edge: their inputs are kept
# so the text can say "softplus of -180 underflows to exactly 0".
PRODUCERS.update(packets(("softplus", "sigmoid", "exp", "exp2", "log_sigmoid")))
# Ops whose backward can create a non-finite value from finite inputs without a forward rule:
# their inputs are kept so the statistics of the forward op appear in the report.
PRODUCERS.update(packets(("tanh", "acosh", "binary_cross_entropy", "prod", "cumprod",
                          "linalg_svd", "_linalg_svd", "_linalg_eigh")))


def keeps_inputs(func: Any) -> bool:
    """Does the tracer keep this forward op's inputs? Exactly the ops a rule or text reads."""
    packet = packet_of(func)
    return packet in RULES or packet in PRODUCERS


def domain_reason(func_or_op: Any, args: tuple, kwargs: dict, phase: str) -> Reason | None:
    """The catalogue cause an op's inputs explain, with the numbers; None when none applies."""
    if args is None:
        return None
    if isinstance(func_or_op, str):
        base = op_base(func_or_op)
        rule = next((r for p, r in RULES.items() if op_base(str(p)) == base), None)
    else:
        base = op_base(str(func_or_op))
        rule = RULES.get(packet_of(func_or_op))
    if rule is None:
        return None
    try:
        return rule(base, tuple(args), dict(kwargs or {}), phase)
    except (IndexError, TypeError, RuntimeError, ValueError, AttributeError):
        return None  # an overload with another argument layout: fall through


# --- what the rules' texts share ----------------------------------------------------------------

def number(x: float) -> str:
    return f"{x:.6g}"


def first_at(mask: torch.Tensor) -> str:
    """`, first at index [0, 3]` for the first True element of a mask; "" when there is none."""
    index = first_index(mask)
    if index is None:
        return ""
    return f", first at index {list(index)}" if len(index) > 1 else f", first at index {index[0]}"


def count(mask: torch.Tensor) -> int:
    return int(mask.sum())
