"""`nanaudit bisect`: every poisoned batch, and the first bad checkpoint in O(log C) loads."""

import json

import torch
from helpers import LINEAR_CASE, ROOT, run_cli

from nanaudit.commands.bisect import first_bad_checkpoint, list_checkpoints


def _bisect(*args, tmp_path):
    out = tmp_path / "bisect.json"
    result = run_cli("bisect", *args, "--json", out, "--quiet")
    return result, json.loads(out.read_text())


def test_every_poisoned_batch_is_listed_with_samples_and_ids(tmp_path):
    result, report = _bisect(ROOT / "configs" / "poisoned_data.yaml", "--skip-list",
                             tmp_path / "skip.json", tmp_path=tmp_path)
    assert result.code == 1
    section = report["bisect"]
    assert section["batches_audited"] == 12
    found = [(f["step"], f["where"], f["cause"], f["samples"]) for f in section["bad_batches"]]
    assert found == [(2, "input", "nonfinite-input", [11]), (6, "backward", "sqrt-domain", [5]),
                     (9, "input", "nonfinite-input", [0])]
    # Issue 29: the demo writes its NaN and inf from Python numbers; only input findings say
    # what made their value (a new key, absent elsewhere).
    producers = [f.get("producer") for f in section["bad_batches"]]
    assert [p and (p["made_by"], p["sample_ids"]) for p in producers] == [
        ("outside-torch", [43]), None, ("outside-torch", [144])]
    assert "it entered torch at __init__.py:" in section["bad_batches"][0]["explanation"]
    skip = json.loads((tmp_path / "skip.json").read_text())["skip"]
    assert [(s["batch"], s["rows"], s["sample_ids"]) for s in skip] == [
        (2, [11], [43]), (6, [5], [101]), (9, [0], [144])]


def _checkpoint_run(tmp_path, bad_from, count=16, every=10, optimizer=True):
    """Checkpoints of a linear model every `every` steps; non-finite from index `bad_from` on."""
    folder = tmp_path / "ckpts"
    folder.mkdir()
    for i in range(count):
        weight = torch.full((1, 3), 0.1 * i)
        if i >= bad_from:
            weight[0, 1] = float("nan")
        state = {"weight": weight, "bias": torch.zeros(1)}
        body = {"model": state}
        if optimizer:
            body["optimizer"] = {"state": {}, "param_groups": [
                {"lr": 0.01, "momentum": 0, "dampening": 0, "weight_decay": 0,
                 "nesterov": False, "maximize": False, "foreach": None,
                 "differentiable": False, "fused": None, "params": [0, 1]}]}
        torch.save(body, folder / f"step_{i * every:06d}.pt")
    return folder


def test_first_bad_checkpoint_in_log_loads(tmp_path):
    files = list_checkpoints(_checkpoint_run(tmp_path, bad_from=11, count=32))
    index, loads = first_bad_checkpoint(files)
    assert files[index].step == 110
    assert len(loads) <= 6 < 32


def test_bisect_checkpoints_replays_to_the_first_bad_step(case, tmp_path):
    code = LINEAR_CASE.replace("range(4)", "range(400)") + (
        "\ndef blowup(model, batch):\n"
        "    x, y = batch\n"
        "    return ((model(x) - y) ** 2).mean() * torch.where(\n"
        "        model.weight.abs().max() > 0.75, torch.tensor(float('inf')), torch.tensor(1.0))\n")
    folder = _checkpoint_run(tmp_path, bad_from=9)
    config = case(code, loss="case:blowup", optimizer={"class": "torch.optim.SGD", "lr": 0.0})
    result, report = _bisect(config, "--checkpoints", folder, tmp_path=tmp_path)
    assert result.code == 1
    section = report["bisect"]
    assert section["first_bad"]["step"] == 90 and section["last_good"]["step"] == 80
    assert section["checkpoints_loaded"] <= 5 and section["linear_loads"] == 10
    assert section["optimizer_state"] is True and section["reproduced"] is True
    assert report["finding"]["step"] == 80 and report["finding"]["where"] == "forward"


def test_bad_checkpoint_folders_give_clear_errors(case, tmp_path):
    config = case(LINEAR_CASE)
    empty = tmp_path / "empty"
    empty.mkdir()
    result, report = _bisect(config, "--checkpoints", empty, tmp_path=tmp_path)
    assert result.code == 3 and "no checkpoint files" in report["error"]["message"]
    (empty / "final.pt").write_bytes(b"x")
    result, report = _bisect(config, "--checkpoints", empty, tmp_path=tmp_path)
    assert "final.pt" in report["error"]["message"]
    (empty / "step_10.pt").write_bytes(b"not a zip")
    result, report = _bisect(config, "--checkpoints", empty, tmp_path=tmp_path)
    assert result.code == 3 and "is not a loadable checkpoint" in report["error"]["message"]


AUGMENTED = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1)

def batches(augment=True):
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.rand(4, 3, generator=g) + 0.5
        if augment:
            x = x * (1 + 0.1 * torch.rand(4, 3))      # the global RNG: not repeatable
        if i == 2:
            x[1, 0] = -1.0
        yield x

def loss(model, x):
    return torch.log(x[:, 0]).mean() + model(x).mean()
"""


def _bisect_json(path, tmp_path):
    out = tmp_path / "bisect.json"
    result = run_cli("bisect", path, "--json", out)
    return result.code, json.loads(out.read_text())


def test_bisect_says_rows_of_an_unrepeatable_batch_could_not_be_confirmed(case, tmp_path):
    code, report = _bisect_json(case(AUGMENTED), tmp_path)
    assert code == 1
    f = report["finding"]
    assert (f["step"], f["batch_index"], f["samples"]) == (2, 2, [1])
    assert "could not be confirmed" in f["explanation"]
    assert report["bisect"]["skip_list"][0]["confirmed"] is False


def test_bisect_rows_of_a_repeatable_batch_are_not_flagged(case, tmp_path):
    path = case(AUGMENTED, data={"entrypoint": "case:batches", "args": {"augment": False}})
    code, report = _bisect_json(path, tmp_path)
    assert code == 1
    f = report["finding"]
    assert f["samples"] == [1] and "could not be confirmed" not in f["explanation"]
    assert "confirmed" not in report["bisect"]["skip_list"][0]
