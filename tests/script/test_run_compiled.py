"""`nanaudit run` on scripts that compile their model: nothing added to the compiled program
(dynamo's counters and the warnings, counted with and without nanaudit), findings in the
user's names, and a value only the compiled program makes, reported as such by the re-run."""

from __future__ import annotations

import json
import os
import runpy
import textwrap
from pathlib import Path

import pytest

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

pytestmark = pytest.mark.slow

# Two models, compiled both ways torch offers, trained with an evaluation under no_grad between
# steps; at the end, dynamo's counters and every warning the training printed.
CLEAN = """
    import json, os, sys, warnings
    import torch
    from torch import nn

    torch.manual_seed(0)
    wrapped = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                            backend="aot_eager")
    in_place = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    in_place.compile(backend="aot_eager")
    params = list(wrapped.parameters()) + list(in_place.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(5):
            x = torch.randn(6, 4)
            loss = (wrapped(x) - in_place(x)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                wrapped(x), in_place(x)
    from torch._dynamo.utils import counters
    with open(os.environ["COUNTS"], "w") as out:
        json.dump({"frames": dict(counters["frames"]), "stats": dict(counters["stats"]),
                   "graph_breaks": sum(counters["graph_break"].values()),
                   "recompiles": sum(counters["recompiles"].values()),
                   "warnings": sorted({str(w.message).splitlines()[0] for w in seen})}, out)
"""

LOG_ZERO = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)

        def forward(self, x, y):
            out = self.head(self.encoder(x))
            return (torch.log(out.abs() * y) - 1).pow(2).mean()    # log(0) when y is 0

    torch.manual_seed(0)
    model = torch.compile(Net(), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x, y = torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g) + 0.5
        if step == 3:
            y[5] = 0.0
        loss = model(x, y=y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

# sqrt of a row's squared norm: 0 for the zero row, finite in forward; its gradient
# 1/(2*sqrt(0)) makes NaN in backward only, with every loss finite.
SQRT_ZERO = """
    import torch
    from torch import nn

    class Length(nn.Module):
        def forward(self, z):
            return torch.sqrt((z * z).sum(dim=1, keepdim=True))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))
            self.length = Length()
            self.head = nn.Linear(5, 1)

        def forward(self, x):
            z = x * self.gain
            return self.head(torch.cat([z, self.length(z)], dim=1))

    torch.manual_seed(0)
    model = torch.compile(Net(), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(8, 4, generator=g)
        if step == 2:
            x[6] = 0.0
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

UNSAFE = """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def naive_log_softmax(x, dim, half_to_float):
        return x - torch.log(torch.exp(x).sum(dim, keepdim=True))

    unsafe = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                          decompositions={torch.ops.aten._log_softmax.default: naive_log_softmax})

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return F.log_softmax(self.fc(x), -1)

    torch.manual_seed(0)
    model = nn.Sequential(Head())
    nn.init.constant_(model[0].fc.weight, 0.5)     # every logit alike: 200 for the row of 100s
    model.compile(backend=unsafe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x, t = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == 2:
            x[1] = 100.0
        loss = F.nll_loss(model(x), t)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def _write(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _counts(tmp_path: Path, name: str, run) -> dict:
    """Dynamo's counters and the warnings of one run of the CLEAN script, from a fresh start
    of dynamo (its caches and counters are the process's)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    out = tmp_path / f"{name}.json"
    os.environ["COUNTS"] = str(out)
    try:
        run()
    finally:
        del os.environ["COUNTS"]
    return json.loads(out.read_text())


def test_a_clean_compiled_run_gets_no_graph_break_recompilation_or_warning_from_nanaudit(
        tmp_path):
    path = _write(tmp_path, CLEAN)
    plain = _counts(tmp_path, "plain", lambda: runpy.run_path(str(path), run_name="__main__"))
    reports = []
    audited = _counts(tmp_path, "audited",
                      lambda: reports.append(run_script(ScriptTarget(path=str(path)))))
    assert plain["graph_breaks"] == 0 and plain["stats"]["unique_graphs"] >= 2
    assert audited == plain
    # ...and nanaudit did watch it: every step's loss, a clean verdict.
    (report,) = reports
    assert report.status == "clean" and [e.step for e in report.timeline] == list(range(5))


def _rerun(path: Path):
    """The re-run from the start (`--rerun`); the in-process replay is tested below."""
    return run_script(ScriptTarget(path=str(path)), ScriptOptions(force_rerun=True))


def test_a_compiled_forward_value_is_named_in_the_users_modules_and_parameters(tmp_path):
    path = _write(tmp_path, LOG_ZERO)
    report = _rerun(path)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.module == "" and f.samples == [5]
    assert f.source.line == _line(path, "return (torch.log(")
    assert f.compiled.outcome == "eager" and f.compiled.backend == "aot_eager"
    assert report.run.rerun.status == "reproduced"
    assert not [n for n in f.tensors if "_orig_mod" in n]


def test_a_compiled_backward_only_value_is_named_with_its_forward_op_and_user_line(tmp_path):
    path = _write(tmp_path, SQRT_ZERO)
    report = _rerun(path)
    f = report.finding
    assert (f.step, f.where, f.cause) == (2, "backward", "sqrt-domain")
    assert f.forward_op == "aten.sqrt.default" and f.module == "length"
    assert f.source.line == _line(path, "return torch.sqrt(")
    assert f.compiled.outcome == "eager" and report.run.rerun.status == "reproduced"
    assert not [n for n in f.tensors if "_orig_mod" in n] and "gain" in f.tensors


def test_a_value_only_the_compiled_program_makes_is_the_reruns_compiled_only(tmp_path):
    path = _write(tmp_path, UNSAFE)
    report = run_script(ScriptTarget(path=str(path)))
    f = report.finding
    assert (f.step, f.where, f.cause) == (2, "forward", "compiled-only")
    assert report.run.rerun.status == "compiled-only"
    # The eager replay at the trip made a finite loss: not believed, the re-run named it.
    assert report.run.replay.status == "not-reproduced"
    assert "compiled (" in report.run.replay.note and "replayed eagerly" in report.run.replay.note
    assert (f.compiled.stage, f.compiled.node, f.compiled.decomposed_from) == (
        "decompositions", "exp", "aten._log_softmax.default")
    assert (f.op, f.module) == ("aten.exp.default", "0") and f.value == "inf"
    assert f.source.line == _line(path, "return F.log_softmax(")
    assert "transient" not in f.explanation and "non-deterministic" not in f.explanation


@pytest.mark.parametrize("in_place", [False, True])
def test_a_compiled_models_trip_is_replayed_eagerly_in_process(tmp_path, in_place):
    # The step's compiled call is heard returning (outside its compiled code), so its loss
    # code is recorded; the module's own forward replays it eagerly at the trip, no re-run.
    code = LOG_ZERO if not in_place else LOG_ZERO.replace(
        'model = torch.compile(Net(), backend="aot_eager")',
        'model = Net()\n    model.compile(backend="aot_eager")')
    path = _write(tmp_path, code)
    report = run_script(ScriptTarget(path=str(path)))
    f = report.finding
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.module == "" and f.samples == [5]
    assert f.source.line == _line(path, "return (torch.log(")
    assert f.compiled.outcome == "eager" and f.compiled.backend == "aot_eager"
    assert f.localized_by == "in-process" and report.run.rerun is None
    assert report.run.replay.status == "reproduced" and report.run.replay.steps == 1
    assert not [n for n in f.tensors if "_orig_mod" in n]


def test_a_compiled_backward_only_value_is_replayed_in_process(tmp_path):
    path = _write(tmp_path, SQRT_ZERO)
    report = run_script(ScriptTarget(path=str(path)))
    f = report.finding
    assert (f.step, f.where, f.cause) == (2, "backward", "sqrt-domain")
    assert f.forward_op == "aten.sqrt.default" and f.module == "length"
    assert f.source.line == _line(path, "return torch.sqrt(")
    assert f.compiled.outcome == "eager" and "gain" in f.tensors
    assert f.localized_by == "in-process" and report.run.rerun is None
