"""The training-setup keys as users get them wrong: `step:` or `scheduler:` without an
optimizer, nanaudit's clipping around a user's own update, scheduler arguments refused only
when built, optimizer factories returning what is not an optimizer. Each is exit 3 naming its
key, the same in `validate` and `scan`; a valid `step:` config validates."""

import pytest
from helpers import LINEAR_CASE, run_cli, scan

CODE = LINEAR_CASE + """

def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, batch, optimizer):
    optimizer.zero_grad()
    value = loss(model, batch)
    value.backward()
    optimizer.step()
    return value


def empty(model):
    return {}


def with_a_float(model):
    return {"main": torch.optim.SGD(model.parameters(), lr=0.1), "lr": 0.1}


def one_lambda_for_all(optimizers):
    return torch.optim.lr_scheduler.LambdaLR(optimizers, lambda s: 0.9 ** s)


def two(model):
    return [torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)]
"""


def _both(path):
    """(validate's code and output, scan's code and error message)."""
    checked = run_cli("validate", path)
    scanned = scan(path, tmp_path=path.parent)
    return (checked.code, checked.stdout + checked.stderr,
            scanned.code, scanned.report["error"]["message"])


def _own_step(case, **keys):
    return case(CODE, loss=None, step="case:train_step", **keys)


def test_a_step_config_validates(case):
    """`validate` printed the loss's target and crashed on a `step:` config (no `loss:`)."""
    result = run_cli("validate", _own_step(case, optimizer="case:sgd"))
    out = result.stdout + result.stderr
    assert result.code == 0, out
    assert "step case:train_step" in out and "Traceback" not in out


@pytest.mark.parametrize("keys, key, words", [
    ({}, "optimizer", "`step:` needs `optimizer:`"),
    ({"optimizer": "case:sgd", "grad_clip": 1.0}, "grad_clip", "clip there"),
])
def test_a_step_config_problem_is_exit_3_in_validate_and_scan(case, keys, key, words):
    v_code, v_out, s_code, s_message = _both(_own_step(case, **keys))
    assert v_code == s_code == 3
    for text in (v_out, s_message):
        assert f"{key}: " in text and words in text, text


def test_a_scheduler_without_an_optimizer(case):
    path = case(CODE, scheduler={"class": "torch.optim.lr_scheduler.StepLR", "step_size": 1})
    v_code, v_out, s_code, s_message = _both(path)
    assert v_code == s_code == 3
    assert "scheduler: a scheduler needs an `optimizer:`" in v_out
    assert "scheduler: a scheduler needs an `optimizer:`" in s_message


@pytest.mark.parametrize("optimizer", [{"class": "torch.optim.SGD", "lr": 0.1}, "case:sgd"])
def test_scheduler_arguments_refused_when_built_are_a_config_error(case, optimizer):
    """OneCycleLR binds without `total_steps` and raises only when built: exit 3 (it was a
    pass in validate and exit 4, 'your code raised', in scan)."""
    path = case(CODE, optimizer=optimizer,
                scheduler={"class": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1})
    v_code, v_out, s_code, s_message = _both(path)
    assert v_code == s_code == 3
    for text in (v_out, s_message):
        assert "scheduler: `torch.optim.lr_scheduler.OneCycleLR` rejects these arguments" in text
        assert "total_steps" in text


def test_a_scheduler_the_trial_optimizers_take_validates(case):
    path = case(CODE, optimizer="case:sgd",
                scheduler={"class": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1,
                           "total_steps": 4})
    assert run_cli("validate", path).code == 0
    assert scan(path, tmp_path=path.parent).code == 0


@pytest.mark.parametrize("factory, words", [
    ("case:empty", "`case:empty` returned an empty dict: no optimizer to step"),
    ("case:with_a_float", "`case:with_a_float` returned a dict whose entry `lr` is a float, "
                          "not a torch.optim.Optimizer"),
])
def test_an_optimizer_factory_returning_no_optimizer(case, tmp_path, factory, words):
    result = scan(case(CODE, optimizer=factory), tmp_path=tmp_path)
    assert result.code == 3
    problems = result.report["error"]["problems"]
    assert problems[0]["key"] == "optimizer" and words in problems[0]["message"]


def test_a_scheduler_factory_that_raises_says_what_it_was_given(case, tmp_path):
    path = case(CODE, optimizer="case:two", scheduler="case:one_lambda_for_all")
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 4
    message = result.report["error"]["message"]
    assert "given a list of 2 optimizers (optimizer[0], optimizer[1])" in message
