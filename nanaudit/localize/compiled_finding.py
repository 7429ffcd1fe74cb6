"""The finding of a value only the compiled program makes, stated as such: not a transient fault
and not non-determinism (the compiled step makes it again from the same state), not an op of
the user's code as written (the eager step is finite), but the compiler stage that makes it,
the graph node and the user's line it came from, and what to do about it."""

from __future__ import annotations

import os

import torch

from nanaudit.localize.causes import fix_for
from nanaudit.localize.compiled import Narrowed, narrow, sink_kind, step_phase
from nanaudit.localize.compiled_graph import BadNode
from nanaudit.localize.replay import preserved_buffers, replay_reproduces
from nanaudit.report.model import ChainLink, Finding, SampleSearch
from nanaudit.report.sections import CompiledReplay
from nanaudit.report.vocabulary import Cause, Check, CompiledOutcome, CompileStage, Where
from nanaudit.run.compiled import CompiledModel
from nanaudit.run.names import user_named
from nanaudit.run.session import Session
from nanaudit.run.step import StepState, Trip

GRAPHS = {"graph": "dynamo's graph", "forward": "AOTAutograd's forward graph",
          "backward": "AOTAutograd's backward graph"}

MINIFY = ("make a minimal repro with torch's minifier (`TORCHDYNAMO_REPRO_AFTER=aot "
          "TORCHDYNAMO_REPRO_LEVEL=4 python your_script.py` writes it under "
          "./torch_compile_debug) and report it at https://github.com/pytorch/pytorch/issues")


def replayed_compiled(session: Session, state: StepState, trip: Trip, compiled: CompiledModel,
                      not_reproduced: Finding) -> Finding:
    """A scan, Sentinel or callback step whose eager replay came out finite, replayed compiled
    from the same state: the compiled-only finding, or the finding that it did not reproduce
    (with what the compiled replays came to)."""
    model = session.model

    def replay() -> bool:
        return replay_reproduces(session, state, state.batch, trip.check)
    with preserved_buffers(model):
        narrowed = narrow(compiled, replay, sink_kind(not_reproduced.value),
                          step_phase(trip.check), model)
        bad = [name for name, p in user_named(model, model.named_parameters())
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if narrowed.replay.outcome != CompiledOutcome.COMPILED_ONLY:
        not_reproduced.compiled = narrowed.replay
        return not_reproduced
    gradient = trip.check == Check.GRADIENT
    finding = compiled_only_finding(narrowed, trip.step, not_reproduced.value,
                                    step_phase(trip.check),
                                    (bad[0] if bad else None) if gradient else "loss",
                                    bad if gradient else [])
    finding.sample_search = SampleSearch(None, 0, False, "not searched: only the compiled "
                                         "program makes the value, and rows are searched by "
                                         "eager replays")
    return finding


def compiled_only_finding(narrowed: Narrowed, step: int, value: str, phase: Where,
                          tensor: str | None, tensors: list) -> Finding:
    """The finding of a step the compiled program makes non-finite and eager does not."""
    section, node = narrowed.replay, narrowed.node
    finding = Finding(
        step=step, where=phase, value=value, cause=Cause.COMPILED_ONLY,
        explanation=(f"the eager replay of step {step} from its saved state is finite, but the "
                     f"compiled step (backend {section.backend}), replayed from the same state, "
                     f"is non-finite again ({value}): the value exists only in the compiled "
                     f"program, not in the code as written"),
        fix=_fix(narrowed), tensor=tensor, tensors=tensors, reproduced=False, compiled=section)
    finding.explain(_stages_clause(section))
    if section.random_ops:
        # The op where the value shows depends on which numbers were drawn: never named as
        # the op that made it, and so no line either (a finding's line is its op's). The
        # random ops' lines are in the explanation.
        finding.explain(_random_clause(narrowed))
    elif node is not None:
        finding.op, finding.source, finding.inputs = node.op, node.source, node.inputs
        finding.module = node.module
        finding.explain(_node_clause(node))
        finding.chain = [_link(n) for n in narrowed.chain or [node]]
    elif section.stage == CompileStage.INDUCTOR:
        finding.explain("its graphs, decomposed as inductor decomposes them and run node by "
                        "node, stay finite: the value is made in inductor's generated kernels "
                        "(fused code computes in another order or precision than eager), so no "
                        "graph node is named")
    return finding


def _stages_clause(section: CompiledReplay) -> str:
    tried = [r for r in section.replays if r.stage not in ("eager", "compiled")
             and "fallback_random" not in r.backend]
    if not tried:
        return f"the {section.stage} stage makes it"
    shown = "; ".join(f"{r.backend}: " + ("failed (" + (r.note or "") + ")" if r.nonfinite is None
                                          else "non-finite" if r.nonfinite else "finite")
                      for r in tried)
    return f"replayed stage by stage ({shown}), so the {section.stage} stage makes it"


def _where(node: BadNode) -> str:
    if node.source is None:
        return ""
    return f", from {os.path.basename(node.source.file)}:{node.source.line}"


def _node_clause(node: BadNode) -> str:
    decomposed = f", decomposed from {node.decomposed_from}" if node.decomposed_from else ""
    module = f" in module `{node.module}`" if node.module else ""
    kinds = "/".join(sorted(node.out_kinds))
    return (f"the first node whose output goes non-finite ({kinds}) is `{node.name}` "
            f"({node.op}{decomposed}) in {GRAPHS.get(node.graph, node.graph)}{module}"
            f"{_where(node)}")


def _random_clause(narrowed: Narrowed) -> str:
    lines = ", ".join(f"{os.path.basename(s.file)}:{s.line}" for s in narrowed.random_lines or [])
    at = f" (at {lines})" if lines else ""
    node = narrowed.node
    shows = (f"; with these draws it shows first at `{node.name}` ({node.op}){_where(node)}"
             if node is not None else "")
    return ("inductor drawing its random ops as eager draws them (`fallback_random=True`) makes "
            f"the step finite: the value depends on the random numbers the compiled program "
            f"draws for its random ops{at}, which differ from eager's for the same seed, so the "
            f"eager replay cannot draw them and no op is named as its maker{shows}; other draws "
            f"could make it in eager too")


def _fix(narrowed: Narrowed) -> str:
    section, node = narrowed.replay, narrowed.node
    at = f" (the function at {os.path.basename(node.source.file)}:{node.source.line})" \
        if node is not None and node.source is not None else ""
    keep_out = f"keep that code out of the graph with `@torch.compiler.disable`{at}"
    if section.random_ops:
        return ("make the code after the random op safe for every draw (a dropout mask can zero "
                "all of a row); to see which op makes it, set "
                "`torch._inductor.config.fallback_random = True` before compiling: inductor then "
                "draws random numbers as eager does, so the run reproduces eagerly and nanaudit "
                "names the op")
    if section.stage == CompileStage.DECOMPOSITIONS and node is not None \
            and node.decomposed_from:
        return (f"the compiler's decomposition of {node.decomposed_from} computes it less safely "
                f"than eager's kernel: until that is fixed, compile with "
                f"`backend=\"aot_eager\"` (no decompositions) or {keep_out}; {MINIFY}")
    if section.stage == CompileStage.INDUCTOR:
        return (f"compile with `backend=\"aot_eager_decomp_partition\"` (inductor's graph "
                f"without its kernels, finite here) or {keep_out}; {MINIFY}")
    if section.stage == CompileStage.BACKEND:
        return (f"the backend {section.backend} makes it: compile with `backend=\"inductor\"` "
                f"or `\"aot_eager\"` meanwhile, and report it to the backend's authors with a "
                f"minimal repro (`TORCHDYNAMO_REPRO_AFTER=aot`)")
    return f"{keep_out}, or train this module without torch.compile; {MINIFY}" if node \
        else fix_for(Cause.COMPILED_ONLY)


def _link(node: BadNode) -> ChainLink:
    where = Where.BACKWARD if node.graph == "backward" else Where.FORWARD
    return ChainLink(op=node.op, where=where, module=node.module,
                     value=sorted(node.out_kinds),
                     line=node.source.line if node.source else None)
