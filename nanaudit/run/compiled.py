"""What nanaudit knows of a `torch.compile`d model, on the cheap path: whether a model is
compiled and with which backend, how a replay runs it eagerly, and how `compile:` in a config
compiles the model the config builds.

Two ways to compile a module exist and both are recognised: `torch.compile(model)` returns an
`OptimizedModule` holding the user's module as `_orig_mod`, and `model.compile()` compiles the
module's own `_call_impl` in place. The backend is read from the dynamo context torch keeps for
either, as `torch._dynamo.eval_frame.innermost_backend` reads it.

Replays run the compiled model eagerly with the compiler's `force_eager` stance: the op tracer
sees every aten op as the user's code makes it (in the user's modules, at the user's lines),
and no replay adds a compilation to the user's program.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.errors import ConfigError, Problem

# `torch.compile(model, backend=..., mode=...)` arguments that `compile:` in a config may give.
COMPILE_ARGUMENTS = ("backend", "mode", "fullgraph", "dynamic")


@dataclass(frozen=True)
class CompiledModel:
    """A compiled module of the user's model: the module itself (inside any wrapper), the
    backend callable torch.compile was given and its name (`inductor`, `aot_eager`, the name
    of a custom backend)."""

    module: torch.nn.Module
    backend: Any
    backend_name: str

    @property
    def inductor(self) -> bool:
        return self.backend_name == "inductor"


def dynamo_context(module: Any) -> Any:
    """The dynamo context that compiles `module`'s calls, or None when they are not compiled."""
    context = getattr(module, "dynamo_ctx", None)
    if context is not None and hasattr(module, "_orig_mod"):
        return context                              # torch.compile(model)
    lightning = getattr(module, "__dict__", {}).get("_compiler_ctx")
    if isinstance(lightning, dict) and lightning.get("dynamo_ctx") is not None:
        return lightning["dynamo_ctx"]      # Lightning's `from_compiled`: its steps compiled
    compiled = getattr(module, "__dict__", {}).get("_compiled_call_impl")
    if compiled is None:
        return None
    from torch._dynamo.eval_frame import _TorchDynamoContext
    while compiled is not None:     # model.compile(): the context is in the wrapper's closure
        for cell in getattr(compiled, "__closure__", None) or ():
            with contextlib.suppress(ValueError):               # an empty cell
                if isinstance(cell.cell_contents, _TorchDynamoContext):
                    return cell.cell_contents
        compiled = getattr(compiled, "__wrapped__", None)
    return None


def backend_name(backend: Any) -> str:
    """How torch names a backend: the wrapper's `compiler_name`, else the callable's name; a
    backend built with `aot_autograd(fw_compiler=f)` is `aot_autograd(f)`."""
    inner = getattr(backend, "compiler_fn", backend)
    options = getattr(inner, "kwargs", None)
    if isinstance(options, dict) and "fw_compiler" in options:
        compiler = options["fw_compiler"]
        return f"aot_autograd({getattr(compiler, '__name__', type(compiler).__name__)})"
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return str(name) if name else type(backend).__name__


def find_compiled(model: Any) -> CompiledModel | None:
    """The first compiled module of `model` (itself, the module a wrapper holds, or a
    submodule the user compiled), or None for an eager model."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        context = dynamo_context(module)
        if context is None:
            continue
        try:
            from torch._dynamo.eval_frame import innermost_backend
            backend = innermost_backend(context.callback)
        except (ImportError, AttributeError, AssertionError):
            backend = None
        user_module = getattr(module, "_orig_mod", module)
        return CompiledModel(user_module, backend, backend_name(backend) if backend else "?")
    return None


def stance(name: str, **kwargs: Any) -> contextlib.AbstractContextManager:
    """The compiler's stance `name` for a block (torch >= 2.6); a null context where torch has
    no stances or the block is already being compiled."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)
    # Nothing was compiled while dynamo is not even imported: importing it costs a second.
    if set_stance is None or "torch._dynamo" not in sys.modules or compiling():
        return contextlib.nullcontext()
    return set_stance(name, **kwargs)


# What `OptimizedModule.__call__` warns while any global module hook is registered: the op
# tracer's hooks are, for the replay only, and the user's own run never printed it.
GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


@contextlib.contextmanager
def replay_eagerly() -> Iterator[None]:
    """Every compiled function and module runs eagerly inside (replays see the user's ops),
    without torch's warning about the replay's global module hooks."""
    with stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GLOBAL_HOOKS_WARNING)
        yield


def compile_model(model: torch.nn.Module, options: dict) -> torch.nn.Module:
    """The config's `compile:` applied in place (`model.compile(**options)`), which keeps the
    module's type, its state-dict keys and its parameter names as the user wrote them. A
    backend torch does not know is the config's problem, named at its key."""
    try:
        model.compile(**{k: v for k, v in options.items() if k in COMPILE_ARGUMENTS})
    except Exception as exc:
        if type(exc).__name__ != "InvalidBackend":
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError([Problem("compile.backend", first)]) from None
    return model
