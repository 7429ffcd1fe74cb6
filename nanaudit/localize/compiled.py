"""A bad step of a `torch.compile`d model whose eager replay is finite: does the compiled
program make the value, and which stage of the compiler?

The op tracer replays a compiled model eagerly (run/compiled.py). When that replay comes out
finite, the step is replayed again from the same saved state, compiled: first as the model was
compiled; if the value comes back, it exists only in the compiled program, and the stages of
torch.compile are replayed in pipeline order, each with the compiler's `force_backend` stance,
until one makes the value:

  dynamo          backend `eager`: dynamo's captured graph, run as Python
  aot-autograd    `aot_eager`: AOTAutograd's forward and backward graphs, no decompositions
  decompositions  the backend's decomposition table and partitioner, without its compiler
                  (inductor's: `aot_eager_decomp_partition`; an `aot_autograd` backend's own)
  inductor        the generated kernels (or `backend`: a custom backend's own compiler)

The first stage that makes it is replayed once more with its compiler replaced by a
`NodeWatch` (compiled_graph.py), which names the FX node that made the value, its op, what it
was decomposed from, and the user's module and line. When only inductor makes it, inductor is
replayed with `fallback_random=True` (random ops drawn as eager draws them): finite then, the
value depends on the random numbers inductor draws, and no op is named for it.

Every replay restores the step's state itself (`replay` is the caller's: the session's step,
or the script's model call); each adds a compiled entry for the frames it runs, so the
compiler's recompile limit is raised for these replays only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanaudit.localize.compiled_graph import BadNode, NodeWatch
from nanaudit.report.sections import CompiledReplay, StageReplay
from nanaudit.report.vocabulary import Check, CompiledOutcome, CompileStage, Where
from nanaudit.run.compiled import CompiledModel, stance

Replay = Callable[[], bool]       # the step again from its saved state: is the value back?

REPLAY_RECOMPILES = 64


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: the backend that stops there, and how to watch its nodes."""

    stage: CompileStage
    backend: Any                       # for `force_backend`; None: the model's own
    label: str
    watch: Callable[[NodeWatch], Any] | None = None


@dataclass
class Narrowed:
    """What the compiled replays found: the report's section, and the node that made the value
    with the chain of nodes from it to the graph's output."""

    replay: CompiledReplay
    node: BadNode | None = None
    chain: list | None = None
    random_lines: list | None = None


def _raised_recompile_limit() -> contextlib.AbstractContextManager:
    import torch._dynamo.config as dynamo_config
    limits = {name: REPLAY_RECOMPILES for name in ("recompile_limit",
                                                   "accumulated_recompile_limit")
              if hasattr(dynamo_config, name)}
    return dynamo_config.patch(limits) if limits else contextlib.nullcontext()


def _inductor_decompositions() -> tuple[Any, Any]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table(), functools.partial(min_cut_rematerialization_partition,
                                                    compiler="inductor")


def _aot_options(backend: Any) -> dict | None:
    """The `aot_autograd(...)` options of a custom backend built on it, else None."""
    options = getattr(getattr(backend, "compiler_fn", backend), "kwargs", None)
    return options if isinstance(options, dict) and "fw_compiler" in options else None


def stages(compiled: CompiledModel) -> list[Stage]:
    """The pipeline's stages for the model's backend, in order; the last is the model's own."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    found = [Stage(CompileStage.DYNAMO, "eager", "dynamo's graph (backend eager)",
                   lambda w: w.graph_backend()),
             Stage(CompileStage.AOT_AUTOGRAD, "aot_eager", "AOTAutograd (backend aot_eager)",
                   lambda w: w.aot_backend(partition_fn=min_cut_rematerialization_partition))]
    if compiled.inductor:
        table, partition = _inductor_decompositions()
        found.append(Stage(CompileStage.DECOMPOSITIONS, "aot_eager_decomp_partition",
                           "inductor's decompositions (backend aot_eager_decomp_partition)",
                           lambda w: w.aot_backend(table, partition)))
        found.append(Stage(CompileStage.INDUCTOR, None, "inductor"))
        return found
    options = _aot_options(compiled.backend)
    if options is not None and options.get("decompositions"):
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        table, partition = options["decompositions"], options.get("partition_fn")
        nop = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, decompositions=table,
                           **({"partition_fn": partition} if partition else {}))
        found.append(Stage(CompileStage.DECOMPOSITIONS, nop,
                           f"the decompositions of backend {compiled.backend_name}",
                           lambda w: w.aot_backend(table, partition)))
    found.append(Stage(CompileStage.BACKEND, None, f"backend {compiled.backend_name}"))
    return found


def _run(replay: Replay, backend: Any = None, own: bool = False) -> tuple[bool | None, str]:
    """Replay with `backend` forced (own: as the model was compiled); (value back?, note)."""
    try:
        with _raised_recompile_limit(), \
                (stance("default") if own else stance("default", force_backend=backend)):
            return replay(), ""
    except Exception as exc:         # a compiler that fails on this graph: that stage is unknown
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return None, f"{type(exc).__name__}: {first}"


def _eager_random_inductor(module: Any, example_inputs: Any) -> Any:
    """Inductor drawing its random ops as eager does (`fallback_random`)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    with inductor_config.patch(fallback_random=True):
        return compile_fx(module, example_inputs)


def narrow(compiled: CompiledModel, replay: Replay, kind: str | None, phase: str,
           model: Any) -> Narrowed:
    """The compiled replays of a step whose eager replay was finite (the module docstring);
    `kind` (nan or inf; None: either) and `phase` (forward or backward) are what the sentinel
    saw; `model` names the modules."""
    section = CompiledReplay(backend=compiled.backend_name,
                             outcome=CompiledOutcome.NOT_REPRODUCED)
    section.replays.append(StageReplay("eager", "eager", False))
    back, note = _run(replay, own=True)
    section.replays.append(StageReplay("compiled", compiled.backend_name, back, note or None))
    if not back:
        return Narrowed(section)
    section.outcome = CompiledOutcome.COMPILED_ONLY
    try:
        pipeline = stages(compiled)
    except ImportError:              # a torch build without inductor or functorch's partitioner
        return Narrowed(section)
    made = pipeline[-1]
    for stage in pipeline[:-1]:
        back, note = _run(replay, stage.backend)
        section.replays.append(StageReplay(stage.stage, stage.label, back, note or None))
        if back:
            made = stage
            break
    section.stage = made.stage
    narrowed = Narrowed(section)
    if made.watch is not None:
        watch = NodeWatch(model)
        back, _ = _run(replay, made.watch(watch))
        found = watch.creator(kind, phase) if back else None
        if found is not None and found[0].op != "input":
            narrowed.node, narrowed.chain = found
            section.node, section.graph = found[0].name, found[0].graph
            section.decomposed_from = found[0].decomposed_from
            if found[0].random_sources and compiled.inductor:
                _random_draws(replay, narrowed, found[0].random_sources)
    elif made.stage == CompileStage.INDUCTOR:
        _random_draws(replay, narrowed, None)
    return narrowed


def _random_draws(replay: Replay, narrowed: Narrowed, lines: list | None) -> None:
    """Is the value inductor's random numbers (its decomposed random ops draw differently
    from eager's)? Replayed with inductor drawing as eager does; finite then, it is: the lines
    of the random ops are those the node depends on, or (`lines` None: the value came out of
    inductor's kernels) every random op of the graph, run node by node."""
    back, note = _run(replay, _eager_random_inductor)
    section = narrowed.replay
    section.replays.append(StageReplay(CompileStage.INDUCTOR, "inductor, fallback_random=True",
                                       back, note or None))
    if back is not False:
        return
    if lines is None:
        watch = NodeWatch()
        table, partition = _inductor_decompositions()
        _run(replay, watch.aot_backend(table, partition))
        lines = [line for line in watch.random if line is not None]
        section.random_ops = bool(watch.random)
    else:
        section.random_ops = True
    narrowed.random_lines = list(dict.fromkeys(lines))


def step_phase(check: Check) -> Where:
    """The phase a sentinel's check saw the value in."""
    return Where.FORWARD if check == Check.LOSS else Where.BACKWARD


def sink_kind(value: str | None) -> str:
    return "nan" if value in (None, "nan") else "inf"

