"""torch.compile'd models: the user's names through every wrapper, the eager replay of a
compiled step, and a value only the compiled program makes, narrowed to the compiler stage,
the FX node and the user's line (compiled in-process through `Sentinel`; CPU backends)."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import scan
from rich.console import Console
from torch import nn

from nanaudit import NonFiniteError, Sentinel
from nanaudit.report.console import print_report
from nanaudit.report.formats import renderer_for
from nanaudit.report.model import report_to_dict
from nanaudit.run.names import parameter_names, unwrapped, user_named


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.log_softmax(self.fc(x), -1)      # LOG_SOFTMAX


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x):
        return self.head(x)


def nll(model, batch):
    x, t = batch
    return F.nll_loss(model(x), t)


def naive_log_softmax(x, dim, half_to_float):
    """log_softmax as a careless compiler might decompose it: exp overflows above 88.7, where
    eager's kernel subtracts the row's max first."""
    return x - torch.log(torch.exp(x).sum(dim, keepdim=True))


@pytest.fixture(scope="module")
def unsafe_backend():
    """A backend built on aot_autograd whose decomposition table computes log_softmax less
    safely than eager does."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                        decompositions={torch.ops.aten._log_softmax.default: naive_log_softmax})


def _line(text: str) -> int:
    return next(i for i, line in enumerate(open(__file__).read().splitlines(), 1)
                if text in line and "_line(" not in line)


def _train(model, loss_fn, batches, lr=0.01):
    """The user's loop under a Sentinel; the report of its first finding."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sentinel = Sentinel(model, optimizer, loss_fn=loss_fn)
    for step, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        loss.backward()
        try:
            sentinel.check(step, batch, loss)
        except NonFiniteError as error:
            return error.report
        optimizer.step()
        optimizer.zero_grad()
    return None


def _classes(scale_at=3, steps=5):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, t = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == scale_at:
            x[2] *= 500                 # logits far above 88.7: finite for eager's log_softmax
        yield x, t


class Wrapper(nn.Module):
    """A user's own module with an attribute called `module`: not a wrapper's component."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.block = nn.Sequential(nn.Linear(2, 2))


def test_user_names_drop_only_what_a_wrapper_holds():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = Wrapper()
    expected = sorted(n for n, _ in model.named_parameters())
    model.block = checkpoint_wrapper(model.block)
    compiled = torch.compile(model)                       # nothing compiles before a call
    assert next(n for n, _ in compiled.named_parameters()).startswith("_orig_mod.")
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert sorted(parameter_names(compiled).values()) == expected
    assert {n for n, _ in user_named(compiled, compiled.named_modules())} == {
        "", "module", "block", "block.0"}
    assert unwrapped(compiled) is model and unwrapped(model) is model
    model.compile(backend="eager")                        # in place: no wrapper, no prefix
    assert sorted(parameter_names(model).values()) == expected


def test_a_compiled_forward_value_is_the_eager_finding_in_the_users_names():
    def log_loss(model, batch):
        x, t = batch
        return -torch.log(model(x).exp().gather(1, t[:, None]) * (t[:, None] != 2)).mean()

    torch.manual_seed(0)
    report = _train(torch.compile(Classifier(), backend="aot_eager"), log_loss, _classes(None))
    f = report.finding
    assert (f.step, f.where, f.op, f.cause) == (0, "forward", "aten.log.default", "log-domain")
    assert f.reproduced is True and f.source.line == _line("return -torch.log(model(x)")
    assert f.compiled.backend == "aot_eager" and f.compiled.outcome == "eager"
    assert not any("_orig_mod" in (link.module or "") for link in f.chain)


def test_a_value_only_the_compiled_program_makes_is_narrowed_to_the_decomposition(
        unsafe_backend):
    torch.manual_seed(0)
    report = _train(torch.compile(Classifier(), backend=unsafe_backend), nll, _classes())
    f = report.finding
    assert (f.step, f.where, f.cause, f.reproduced) == (3, "forward", "compiled-only", False)
    c = f.compiled
    assert (c.outcome, c.stage, c.node, c.graph) == ("compiled-only", "decompositions", "exp",
                                                      "forward")
    assert c.backend == "aot_autograd(boxed_nop)"
    assert c.decomposed_from == "aten._log_softmax.default"
    assert [(r.stage, r.nonfinite) for r in c.replays] == [
        ("eager", False), ("compiled", True), ("dynamo", False), ("aot-autograd", False),
        ("decompositions", True)]
    # The node's op, the user's module and line, the op's inputs (logits above 88.7).
    assert (f.op, f.module) == ("aten.exp.default", "head")
    assert f.source.line == _line("# LOG_SOFTMAX") and f.inputs[0].max > 88.7
    assert [link.op for link in f.chain][:2] == ["aten.exp.default", "aten.sum.dim_IntList"]
    for word in ("transient", "non-deterministic"):
        assert word not in f.explanation
    assert "aot_eager" in f.fix and "TORCHDYNAMO_REPRO_AFTER=aot" in f.fix
    data = json.loads(json.dumps(report_to_dict(report)))
    assert data["finding"]["compiled"]["stage"] == "decompositions"
    assert data["finding"]["cause"] == "compiled-only"
    assert "only the compiled program makes it" in renderer_for("markdown").render(report)
    console = Console(file=io.StringIO(), width=100)
    print_report(report, console)
    assert "made only by the compiled program" in console.file.getvalue()


def naive_log_sigmoid_backward(grad, x, buffer):
    """logsigmoid's gradient as a careless compiler might decompose it: exp(-x) overflows for
    x below -88.7 and inf / inf is NaN, where eager's kernel stays finite."""
    e = torch.exp(-x)
    return grad * e / (1 + e)


@pytest.mark.slow
def test_a_backward_value_only_a_decomposed_backward_makes_names_its_graph_node():
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, decompositions={
        torch.ops.aten.log_sigmoid_backward.default: naive_log_sigmoid_backward})

    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return -F.logsigmoid(self.fc(x)).mean()        # LOGSIGMOID

    def batches(model):
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            x = torch.randn(6, 4, generator=g)
            if step == 2:                                   # a score far below -88.7
                x[3] = -300.0 * model.fc.weight.detach().sign()[0]
            yield x

    torch.manual_seed(0)
    model = Scorer()
    report = _train(torch.compile(model, backend=backend), lambda m, x: m(x), batches(model))
    f = report.finding
    assert (f.step, f.where, f.cause, f.value) == (2, "backward", "compiled-only", "nan")
    c = f.compiled
    assert (c.stage, c.graph, c.node, c.decomposed_from) == (
        "decompositions", "backward", "exp", "aten.log_sigmoid_backward.default")
    # The NaN is inf / inf: the node named is the exp whose infinity came first.
    assert [link.op for link in f.chain][:3] == ["aten.exp.default", "aten.mul.Tensor",
                                                 "aten.div.Tensor"]
    assert f.source.line == _line("# LOGSIGMOID") and f.module == ""
    assert sorted(f.tensors) == ["fc.bias", "fc.weight"]


@pytest.mark.slow
def test_a_value_that_needs_inductors_random_draws_names_no_op():
    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            h = self.drop(self.fc(x).abs() + 0.1)      # DROPOUT
            return torch.log(h.sum(-1)).mean()        # log(0) when every unit is dropped

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(40):
            yield torch.randn(3, 4, generator=g)

    torch.manual_seed(0)
    report = _train(torch.compile(Dropped()), lambda model, x: model(x), batches(), lr=0.0)
    f = report.finding
    assert f.cause == "compiled-only" and f.compiled.backend == "inductor"
    assert f.compiled.random_ops is True and f.compiled.stage in ("decompositions", "inductor")
    # No op is named, so no line either (a finding's line is its op's); the random op's line
    # is in the explanation.
    assert f.op is None and f.source is None
    assert f"test_compiled.py:{_line('# DROPOUT')}" in f.explanation
    assert ("inductor, fallback_random=True", False) in [(r.backend, r.nonfinite)
                                                        for r in f.compiled.replays]
    assert "fallback_random = True" in f.fix


@pytest.mark.slow
def test_scan_compiles_on_request_and_names_a_backward_value_in_the_users_modules(tmp_path):
    # The demo's sqrt(sum(z * z)) at an all-zero row: finite forward, NaN backward.
    config = tmp_path / "config.yaml"
    config.write_text("model: nanaudit.demo:build_model\ndata: nanaudit.demo:batches\n"
                      "loss: nanaudit.demo:loss\noptimizer: {class: torch.optim.AdamW, lr: 1.0e-3}\n"
                      "steps: 12\nseed: 0\ndevice: cpu\ncompile: {backend: aot_eager}\n")
    result = scan(config, "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1 and result.report["config"]["compile"]["backend"] == "aot_eager"
    assert (f["step"], f["where"], f["op"], f["forward_op"], f["module"], f["cause"]) == (
        6, "backward", "aten.div.Tensor", "aten.sqrt.default", "features", "sqrt-domain")
    assert f["tensors"] == ["features.gain"] and f["samples"] == [5]
    assert f["compiled"] == {"backend": "aot_eager", "outcome": "eager"}


def test_compile_key_takes_true_or_torch_compile_arguments(tmp_path):
    from nanaudit.config.parse import load_draft
    base = "model: a:b\ndata: a:c\nloss: a:d\n"
    path = tmp_path / "c.yaml"

    def parsed(compile_value: str):
        path.write_text(base + f"compile: {compile_value}\n")
        draft = load_draft(path)
        return draft.values.get("compile"), {p.key for p in draft.problems}
    assert parsed("false") == (None, set())
    assert parsed("true")[0].arguments() == {"backend": "inductor", "mode": None,
                                             "fullgraph": False, "dynamic": None}
    options, problems = parsed("{backend: aot_eager, mode: max-autotune}")
    assert (options.backend, options.mode, problems) == ("aot_eager", "max-autotune", set())
    assert parsed("{backend: 3, mode: fast, fullgraph: 2, bogus: 1}")[1] == {
        "compile.backend", "compile.mode", "compile.fullgraph", "compile.bogus"}
    assert parsed("yes please")[1] == {"compile"}


@pytest.mark.slow
def test_a_factory_returning_a_compiled_model_takes_a_checkpoint_of_the_plain_one(tmp_path):
    from nanaudit import demo
    torch.manual_seed(0)
    torch.save(demo.build_model().state_dict(), tmp_path / "plain.pt")
    (tmp_path / "factory.py").write_text(
        "import torch\nfrom nanaudit import demo\n\n\ndef build_model():\n"
        "    return torch.compile(demo.build_model(), backend='aot_eager')\n")
    config = tmp_path / "config.yaml"
    config.write_text("model: factory.py:build_model\ndata: nanaudit.demo:batches\n"
                      "loss: nanaudit.demo:loss\noptimizer: {class: torch.optim.AdamW, lr: 1.0e-3}\n"
                      "steps: 12\nseed: 0\ndevice: cpu\ncheckpoint: plain.pt\n")
    f = scan(config, "--no-repro", tmp_path=tmp_path).finding
    assert (f["where"], f["op"], f["module"], f["tensors"]) == (
        "backward", "aten.div.Tensor", "features", ["features.gain"])
    assert f["compiled"]["outcome"] == "eager"


def test_a_compiled_only_finding_that_names_no_op_names_no_line():
    from nanaudit.localize.compiled import Narrowed
    from nanaudit.localize.compiled_finding import compiled_only_finding
    from nanaudit.report.model import SourceLine
    from nanaudit.report.sections import CompiledReplay
    from nanaudit.report.vocabulary import CompiledOutcome, CompileStage, Where

    dropout = SourceLine("train.py", 16, "h = self.drop(self.fc(x).abs() + 0.1)", "forward")
    section = CompiledReplay("inductor", CompiledOutcome.COMPILED_ONLY, CompileStage.INDUCTOR,
                             random_ops=True)
    f = compiled_only_finding(Narrowed(section, random_lines=[dropout]), 7, "nan",
                              Where.FORWARD, "loss", [])
    assert (f.op, f.source, f.module) == (None, None, None)
    assert "(at train.py:16)" in f.explanation and f.cause == "compiled-only"
