"""An exception the user's code raises during a replay (the traced replay, the sample search's
replays, bisect's) is reported as the user's error: exit 4, their exception and frames."""

import json

from helpers import run_cli, scan

CASE = """
import torch
from torch import nn

SEEN = set()


def build_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.rand(8, 3, generator=g) + 0.1
        y = torch.zeros(8)
        y[6] = 1.0
        if step == 1:
            x[2] = 0.0
        yield x, y


def positives_loss(model, batch):
    x, y = batch
    assert y.sum() > 0, "a batch without positive labels"
    return (model(torch.log(x)).squeeze(-1) - y).square().mean()


def once_loss(model, batch):
    x, y = batch
    key = (x.shape[0], float(x.sum()))
    if key in SEEN:
        raise RuntimeError("this batch was already trained on")
    SEEN.add(key)
    return (model(torch.log(x)).squeeze(-1) - y).square().mean()


def plain_loss(model, batch):
    x, y = batch
    return (model(torch.log(x)).squeeze(-1) - y).square().mean()
"""


def _scan(case, tmp_path, loss):
    config = case(CASE, loss=f"case:{loss}", optimizer={"class": "torch.optim.SGD", "lr": 0.01})
    return scan(config, tmp_path=tmp_path)


def test_an_assert_firing_in_a_sample_search_replay_is_the_users_error(case, tmp_path):
    result = _scan(case, tmp_path, "positives_loss")
    assert result.code == 4, result.report
    error = result.report["error"]
    assert error["type"] == "UserCodeError" and error["exception"] == "AssertionError"
    assert "for the sample search" in error["message"]
    assert "a batch without positive labels" in error["message"]
    frame = error["frames"][-1]
    assert frame["file"].endswith("case.py") and frame["function"] == "positives_loss"
    assert frame["code"].startswith("assert y.sum() > 0")
    assert result.report["finding"] is None


def test_an_exception_in_the_traced_replay_is_the_users_error(case, tmp_path):
    result = _scan(case, tmp_path, "once_loss")
    assert result.code == 4, result.report
    error = result.report["error"]
    assert error["type"] == "UserCodeError" and error["exception"] == "RuntimeError"
    assert "already trained on" in error["message"]
    assert error["frames"][-1]["function"] == "once_loss"


def test_control_without_the_assert_names_the_row(case, tmp_path):
    result = _scan(case, tmp_path, "plain_loss")
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["cause"], f["samples"]) == (
        1, "forward", "aten.log.default", "log-domain", [2])


def test_an_assert_firing_in_a_bisect_replay_is_the_users_error(case, tmp_path):
    config = case(CASE, loss="case:positives_loss",
                  optimizer={"class": "torch.optim.SGD", "lr": 0.01})
    out = tmp_path / "bisect.json"
    result = run_cli("bisect", config, "--json", out, "--quiet")
    assert result.code == 4
    error = json.loads(out.read_text())["error"]
    assert error["type"] == "UserCodeError" and error["exception"] == "AssertionError"
    assert error["frames"][-1]["function"] == "positives_loss"
