"""The graph node of a compiled program that made a non-finite value, found by running the
program's FX graphs node by node.

`NodeWatch` gives dynamo a backend whose compilers return a `torch.fx.Interpreter` over each
graph, in place of generated code: dynamo's own graph (`graph_backend`), or AOTAutograd's
forward and backward graphs after a given decomposition table (`aot_backend`). Each node's
output is checked as it is made (a host read per node: this runs on one replay of the bad step
only). Afterwards the walk goes back from the graph output that carries the bad value, through
the inputs that carry the same kind of value, to the node whose inputs did not: the node that
made it. A `-inf` a mask wrote that never reaches an output is never named. A backward graph's
bad input that the forward graph saved is followed into the forward graph.

FX nodes carry what the user wrote: `stack_trace` (the user's line), `nn_module_stack` (the
module; `fwd_nn_module_stack` in a backward graph), and `original_aten` (the op a node was
decomposed from).
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.localize.events import carries, kinds_of
from nanaudit.localize.ops import named_tensors, scalar_infinities, schema_names
from nanaudit.localize.stats import tensor_stats
from nanaudit.report.model import SourceLine
from nanaudit.run.names import user_named

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


@dataclass
class BadNode:
    """A node whose output held NaN/Inf: its graph (`graph` for dynamo's, `forward` or
    `backward` for AOTAutograd's), its FX name, its op, what it was decomposed from, the
    user's module and line, its output's kinds and its inputs (statistics, and whether each
    carried a bad value in)."""

    graph: str
    name: str
    op: str
    decomposed_from: str | None
    module: str | None
    source: SourceLine | None
    out_kinds: frozenset
    inputs: list = field(default_factory=list)          # [TensorStats]
    input_nodes: list = field(default_factory=list)     # [(node name, kinds)] of bad inputs
    random_sources: list = field(default_factory=list)  # the lines of random ops it depends on
    writes_infinity: bool = False      # an infinity among its Python numbers (a -inf mask fill)


def node_source(node: Any) -> SourceLine | None:
    """The user's line from a node's `stack_trace` (its innermost frame)."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return None
    frame = frames[-1]
    line = int(frame["line"])
    code = linecache.getline(frame["file"], line).strip()
    return SourceLine(frame["file"], line, code, frame["function"])


class ModuleNames:
    """The user's name of the module a node ran in. `nn_module_stack` (a backward node's
    `fwd_nn_module_stack`) is keyed by the ids of the modules called, innermost last; its paths
    are relative to the compiled frame, which need not be the model's root. A node of the
    frame's own module has no stack: its line is in that module's `forward`, which names it
    when one module of the model runs that code."""

    def __init__(self, model: Any):
        named = list(user_named(model, model.named_modules())) if model is not None else []
        self.by_id = {str(id(m)): n for n, m in named}
        self.by_code: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        for name, module in named:
            code = getattr(getattr(type(module), "forward", None), "__code__", None)
            if code is None:
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            key = (code.co_filename, code.co_name)
            self.by_code.setdefault(key, []).append((min(lines), max(lines), name))

    def of(self, node: Any, source: SourceLine | None) -> str | None:
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
        if stack:
            key = list(stack)[-1]
            return self.by_id.get(str(key), _relative(str(list(stack.values())[-1][0])))
        if source is None:
            return None
        owners = {name for first, last, name in self.by_code.get((source.file, source.function),
                                                                  ())
                  if first <= source.line <= last}
        return owners.pop() if len(owners) == 1 else None


def _relative(path: str) -> str:
    """`L['self'].encoder.fc` -> `encoder.fc`: a path relative to the compiled frame."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return re.sub(r"^L\['[a-z_]+'\]\.?", "", path)


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


RANDOM = "nondeterministic_seeded"     # the tag aten gives every op that draws random numbers


def is_random(node: Any) -> bool:
    tags = getattr(node.target, "tags", ()) or ()
    return any(getattr(tag, "name", "") == RANDOM for tag in tags)


def random_upstream(node: Any) -> list[SourceLine]:
    """The user's lines of the random ops a node's value depends on, in its graph."""
    seen, stack, lines = set(), list(node.all_input_nodes), []
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if is_random(current):
            source = node_source(current)
            if source is not None and source not in lines:
                lines.append(source)
        stack.extend(current.all_input_nodes)
    return lines


class _Checked(torch.fx.Interpreter):
    """Runs one graph node by node, recording each node whose output holds NaN/Inf."""

    def __init__(self, module: torch.fx.GraphModule, graph: str, watch: NodeWatch):
        super().__init__(module)
        self.part, self.watch = graph, watch
        self.bad: dict[str, BadNode] = {}

    def run_node(self, node: Any) -> Any:
        out = super().run_node(node)
        if node.op in ("call_function", "call_method", "call_module"):
            self._check(node, out)
        elif node.op == "placeholder":
            kinds = _kinds(out)
            if kinds:
                self.bad[node.name] = BadNode(self.part, node.name, "input", None, None, None,
                                              kinds)
        elif node.op == "output":
            self.watch.runs.append(self)
            self.watch.outputs.append((self, [a.name if hasattr(a, "name") else None
                                               for a in tree_flatten(node.args[0])[0]]))
        return out

    def _check(self, node: Any, out: Any) -> None:
        if is_random(node):
            self.watch.random.append(node_source(node))
        kinds = _kinds(out)
        if not kinds:
            return
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        names = schema_names(node.target)
        named = named_tensors(names, args, kwargs)
        inputs = [n for n in node.all_input_nodes if n.name in self.bad]
        decomposed = node.meta.get("original_aten")
        decomposed = str(decomposed) if decomposed is not None and \
            str(decomposed) != op_name(node.target) else None
        source = node_source(node)
        self.bad[node.name] = BadNode(
            self.part, node.name, op_name(node.target), decomposed,
            self.watch.names.of(node, source), source, kinds,
            [tensor_stats(n, t) for n, t in named],
            [(n.name, self.bad[n.name].out_kinds) for n in inputs], random_upstream(node),
            bool(scalar_infinities(args, kwargs, op_name(node.target))))


def _kinds(value: Any) -> frozenset:
    tensors = [t for t in tree_flatten(value)[0]
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    return frozenset().union(*(kinds_of(t.detach()) for t in tensors)) if tensors else frozenset()


class NodeWatch:
    """A backend running each compiled graph node by node (see the module docstring); after a
    replay under it, `creator(kind, phase)` names the node that made the bad value."""

    def __init__(self, model: Any = None) -> None:
        self.names = ModuleNames(model)
        self.runs: list[_Checked] = []
        self.outputs: list[tuple[_Checked, list]] = []
        self.random: list[SourceLine | None] = []      # the random ops' lines, as they ran

    def _compiler(self, graph: str, boxed: bool) -> Any:
        def compile_graph(module: torch.fx.GraphModule, example_inputs: Any) -> Any:
            def run(*args: Any) -> Any:
                if boxed:                  # AOTAutograd passes one list and lets us free it
                    args = tuple(args[0])
                return _Checked(module, graph, self).run(*args)
            run._boxed_call = boxed  # type: ignore[attr-defined]
            return run
        return compile_graph

    def graph_backend(self) -> Any:
        """Dynamo's graph as captured, before AOTAutograd."""
        return self._compiler("graph", boxed=False)

    def aot_backend(self, decompositions: Any = None, partition_fn: Any = None) -> Any:
        """AOTAutograd's forward and backward graphs after `decompositions`."""
        from torch._dynamo.backends.common import aot_autograd
        options: dict[str, Any] = {"fw_compiler": self._compiler("forward", boxed=True),
                                   "bw_compiler": self._compiler("backward", boxed=True)}
        if decompositions is not None:
            options["decompositions"] = decompositions
        if partition_fn is not None:
            options["partition_fn"] = partition_fn
        return aot_autograd(**options)

    def creator(self, kind: str | None, phase: str) -> tuple[BadNode, list[BadNode]] | None:
        """(the node that made the `kind` value reaching a graph output, the chain of nodes
        from it to that output); graphs of `phase` are searched first; `kind` None: the
        first bad output's (NaN before Inf)."""
        order = sorted(self.outputs, key=lambda run: run[0].part != _graph_of(phase))
        for run, outputs in order:
            for name in outputs:
                node = run.bad.get(name) if name else None
                if node is None:
                    continue
                wanted = kind or ("nan" if "nan" in node.out_kinds else "inf")
                if carries(node.out_kinds, wanted):
                    return self._walk(run, node, wanted)
        return None

    def _walk(self, run: _Checked, node: BadNode, kind: str) -> tuple[BadNode, list[BadNode]]:
        """Back through the inputs carrying `kind`; a NaN made of infinities (inf - inf, inf /
        inf) goes on to the node that made the infinity, unless that node wrote it on purpose
        (a `-inf` mask): then the NaN's maker is the node named."""
        chain, made_nan = [node], None
        while True:
            upstream = [run.bad[name] for name, kinds in node.input_nodes if carries(kinds, kind)]
            if not upstream and kind == "nan" and node.op != "input":
                infinite = [run.bad[name] for name, kinds in node.input_nodes
                            if carries(kinds, "inf")]
                if infinite:
                    made_nan, kind, upstream = node, "inf", infinite
            if not upstream and node.op == "input" and run.part == "backward":
                saved = self._saved(node.name)       # a forward value the backward reads
                if saved is None:
                    break
                run, node = saved
                chain.append(node)
                continue
            if not upstream or upstream[0] in chain:
                break
            node = upstream[0]
            chain.append(node)
        creator = next((n for n in reversed(chain) if n.op != "input"), chain[-1])
        if made_nan is not None and creator.writes_infinity:
            chain = chain[:chain.index(made_nan) + 1]
            creator = made_nan
        return creator, [n for n in reversed(chain) if n.op != "input"]

    def _saved(self, name: str) -> tuple[_Checked, BadNode] | None:
        for run in self.runs:
            if run.part == "forward" and name in run.bad and run.bad[name].op != "input":
                return run, run.bad[name]
        return None


def _graph_of(phase: str) -> str:
    return "backward" if phase == "backward" else "forward"
