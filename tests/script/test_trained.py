"""Which modules a script trains (script/trained.py), the one answer the hooks and the step tap
both ask: a module an optimizer the script built holds a parameter of, whatever the order of
its calls; without any optimizer (an update by hand), a module called with autograd as a
step's call. A call without autograd of a module it does not train (a distillation teacher's)
is kept with the step; an evaluation of the model it trains is not."""

from __future__ import annotations

import gc
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.run.step_record import StepRecord
from nanaudit.script.target import ScriptOptions, ScriptTarget
from nanaudit.script.trained import TrainedModules


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_every_module_holding_an_optimized_parameter_is_trained_whatever_its_calls():
    model, teacher = _model(), _model()
    trained = TrainedModules()
    trained.training_call(teacher)      # a teacher probed once with autograd on (its width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained.built(optimizer)
    assert trained.trains(model) and trained.trains(model[0]) and trained.trains(model[2])
    assert not trained.trains(model[1])            # a ReLU holds no parameter
    assert not trained.trains(teacher) and not trained.trains(teacher[0])
    del optimizer                       # an optimizer the script dropped holds nothing
    gc.collect()
    assert not trained.trains(model[0])


def test_a_parameter_group_added_later_trains_its_module():
    # Progressive unfreezing: the backbone's parameters join the optimizer after some steps.
    backbone, head = _model(), nn.Linear(1, 1)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    trained = TrainedModules()
    trained.built(optimizer)
    assert not trained.trains(backbone)
    optimizer.add_param_group({"params": backbone.parameters()})
    assert trained.trains(backbone) and trained.trains(backbone[2])


def test_without_an_optimizer_the_modules_called_to_train_are_the_trained_ones():
    model, other = _model(), _model()
    trained = TrainedModules()
    with torch.no_grad():
        assert trained.training_call(model) is None     # an evaluation: not a training call
    assert not trained.trains(model)
    assert trained.training_call(model) is not None
    assert trained.trains(model) and not trained.trains(other)
    assert trained.training_call(nn.ReLU()) is None     # no parameter: a data transform


def test_a_new_module_under_a_collected_ones_id_is_asked_again():
    trained = TrainedModules()
    model = _model()
    trained.training_call(model)
    key = id(model)
    del model
    gc.collect()
    again = [m for m in (_model() for _ in range(200)) if id(m) == key]
    for module in again:              # one may take the dead one's id: it was never called
        assert not trained.trains(module)


EVALUATED = """
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        with torch.no_grad():
            {no_grad_call}
        out = model(x)
        if step == 4:
            out = out * torch.log(torch.zeros(()))
        loss = ((out - y) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("no_grad_call, kept", [
    ("model.eval(); model(x); model.train()", []),     # an evaluation of the trained model
    # a teacher's call, at steps 1 to 4 (step 0's is in the code recorded from the
    # optimizer's construction, code_window.untrained)
    ("teacher(x)", ["Sequential"] * 4),
])
def test_only_a_call_of_a_module_the_script_does_not_train_is_kept_with_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_grad_call: str, kept: list):
    # Before: the evaluation's inner modules (model.0, model.2), which the optimizer trains,
    # were kept as frozen calls (with the code after them) at every step.
    frozen: list[str] = []
    original = StepRecord.frozen_call

    def spy(record: StepRecord, module: nn.Module, args: tuple, kwargs: dict):
        frozen.append(type(module).__name__)
        return original(record, module, args, kwargs)
    monkeypatch.setattr(StepRecord, "frozen_call", spy)
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(EVALUATED.format(no_grad_call=no_grad_call)))
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    assert exit_code(report) == 1 and report.finding.step == 4
    assert report.finding.localized_by == "in-process"
    assert frozen == kept
