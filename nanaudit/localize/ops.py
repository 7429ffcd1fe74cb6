"""How the localizer reads an aten op: its base name, its packet, its named tensor arguments and
the Python numbers among its values.

The tracer, the rules and the walk all name ops the same way (`aten.log_.default` is `log`), and
all read a non-finite Python number given to an op as a value written, not a parameter; this
module is that one reading.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def op_base(op_name: str) -> str:
    """`aten.log_.default` -> `log` (in-place folded in); `aten._softmax.default` -> `_softmax`."""
    parts = op_name.split(".")
    base = parts[1] if len(parts) > 1 else parts[0]
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return base


def is_collective(op_name: str) -> bool:
    """A torch.distributed collective (`c10d.allreduce_.default`): what it outputs came from
    the peers, so it never *creates* a value on this rank."""
    return op_name.startswith(("c10d.", "_c10d_functional.", "c10d_functional."))


def packet_of(func: Any) -> Any:
    """The overload packet of an aten op (`aten.log` for `aten.log.default`); None for a name."""
    return getattr(func, "overloadpacket", None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.cache
def schema_names(func: Any) -> tuple:
    """The op's argument names from its schema (`self`, `other`); () when it has none (read
    once per op: the tracer asks it of every op it sees)."""
    schema = getattr(func, "_schema", None)
    return tuple(a.name for a in schema.arguments) if schema is not None else ()


def named_tensors(arg_names: Any, args: tuple, kwargs: dict) -> list:
    """(name, tensor) for each tensor argument, named by the op's schema (`self`, `other`)."""
    named = []
    for i, arg in enumerate(args or ()):
        label = arg_names[i] if i < len(arg_names) else f"arg{i}"
        if isinstance(arg, torch.Tensor):
            named.append((label, arg))
        elif isinstance(arg, (list, tuple)):
            named += [(f"{label}[{j}]", a) for j, a in enumerate(arg)
                      if isinstance(a, torch.Tensor)]
    named += [(k, v) for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)]
    return named


# Ops whose Python-number arguments are values written or computed with (not parameters such
# as `norm(p=inf)` or `nan_to_num(posinf=...)`): a non-finite one there is a source of infinity.
VALUE_SCALAR_OPS = frozenset({
    "full", "full_like", "new_full", "fill", "masked_fill", "index_fill", "where",
    "scalar_tensor", "constant_pad_nd", "index_put", "scatter", "fill_diagonal",
    "add", "sub", "rsub", "mul", "div", "true_divide", "pow", "float_power", "addcmul", "lerp",
    "maximum", "minimum", "fmax", "fmin",
})


def scalar_infinities(args: tuple, kwargs: dict, op: str | None = None) -> list:
    """Non-finite Python numbers among an op's value arguments (`float('-inf')` given to
    masked_fill); parameters such as `norm(p=inf)` are not values."""
    if op is not None and op_base(op) not in VALUE_SCALAR_OPS:
        return []
    found = []
    for value in list(args or ()) + list((kwargs or {}).values()):
        values = value if isinstance(value, (list, tuple)) else (value,)
        found += [v for v in values if isinstance(v, float) and not math.isfinite(v)]
    return found


def scalar_overflows(args: tuple, kwargs: dict, op: str | None = None) -> list:
    """Finite Python numbers among an op's value arguments that the op's floating dtype cannot
    hold (a statistic computed on the host through `.item()`): inf once the op casts them."""
    if op is not None and op_base(op) not in VALUE_SCALAR_OPS:
        return []
    values = list(args or ()) + list((kwargs or {}).values())
    floats = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not floats:
        return []
    limit = torch.finfo(floats[0].dtype).max
    return [v for v in values if isinstance(v, float) and math.isfinite(v) and abs(v) > limit]
