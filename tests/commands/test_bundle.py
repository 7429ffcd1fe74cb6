"""Repro bundles, `nanaudit replay` and `nanaudit init`: what a finding leaves behind."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import BLOCK_NANAUDIT, ROOT, run_cli, scan

EXAMPLES = ROOT / "configs" / "examples"


def _bundle(tmp_path, name="log_negative"):
    result = scan(EXAMPLES / f"{name}.yaml", "--repro", tmp_path / "bundle", tmp_path=tmp_path)
    assert result.code == 1 and result.report["repro"] == str(tmp_path / "bundle")
    return tmp_path / "bundle", result.finding


def test_bundle_holds_state_batch_rows_config_and_report(tmp_path):
    folder, finding = _bundle(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["batch.pt", "config.yaml", "meta.json", "nanaudit-bundle.json", "report.json",
                     "repro.py", "rng.pt", "rows.pt", "state.pt"]
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["step"], meta["check"], meta["samples"]) == (finding["step"], "loss", [2])
    rows = torch.load(folder / "rows.pt", weights_only=True)
    batch = torch.load(folder / "batch.pt", weights_only=True)
    assert torch.equal(rows[0][0], batch[0][2])
    state = torch.load(folder / "state.pt", weights_only=True)
    assert set(state) == {"model", "optimizer"}
    assert json.loads((folder / "report.json").read_text())["finding"]["cause"] == "log-domain"


def test_repro_py_reproduces_in_a_fresh_process_without_nanaudit(tmp_path):
    folder, _ = _bundle(tmp_path)
    # Any `import nanaudit` in repro.py (or anything it imports) fails in this process.
    for extra in ([], ["--rows"]):
        proc = subprocess.run([sys.executable, "-c", BLOCK_NANAUDIT, *extra], cwd=folder,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "non-finite loss" in proc.stdout and "reproduced" in proc.stdout


def test_replay_localizes_the_bundle_again(tmp_path):
    folder, finding = _bundle(tmp_path)
    out = tmp_path / "replay.json"
    result = run_cli("replay", folder, "--json", out, "-q")
    assert result.code == 1
    body = json.loads(out.read_text())
    assert body["command"] == "replay"
    for key in ("step", "where", "op", "cause", "samples", "source"):
        assert body["finding"][key] == finding[key], key


def test_replay_of_a_broken_bundle_is_a_config_error(tmp_path):
    folder, _ = _bundle(tmp_path)
    (folder / "state.pt").write_bytes(b"not a checkpoint")
    result = run_cli("replay", folder)
    assert result.code == 3 and "cannot read the repro bundle" in result.stderr
    assert run_cli("replay", tmp_path / "nowhere").code == 3


def test_replay_of_a_bundle_naming_an_unknown_check_is_a_config_error(tmp_path):
    folder, _ = _bundle(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "check": "bogus"}))
    result = run_cli("replay", folder)
    assert result.code == 3 and "unknown check 'bogus'" in result.stderr


def test_default_bundle_folder_and_no_repro(tmp_path):
    result = run_cli("scan", EXAMPLES / "div_zero.yaml", "-q")
    assert result.code == 1
    assert (tmp_path / "nanaudit-reports" / "repro-step1" / "repro.py").is_file()
    other = tmp_path / "other"
    other.mkdir()
    os.chdir(other)
    assert run_cli("scan", EXAMPLES / "div_zero.yaml", "-q", "--no-repro").code == 1
    assert list(other.iterdir()) == []


def test_init_writes_a_config_that_scans_and_refuses_to_overwrite(tmp_path):
    assert run_cli("init").code == 0
    config = tmp_path / "nanaudit.yaml"
    text = config.read_text()
    assert "model: nanaudit_entry:build_model" in text and "# " in text
    assert run_cli("validate", config).code == 0
    assert scan(config, tmp_path=tmp_path).code == 0
    before = config.read_text()
    refused = run_cli("init")
    assert refused.code == 2 and "--force" in refused.stderr
    config.write_text(before + "# edited\n")
    assert run_cli("init", "--force").code == 0
    assert "# edited" not in config.read_text()


def test_amp_bundle_replays_at_the_recorded_loss_scale(tmp_path):
    result = scan(EXAMPLES / "amp_scale_collapse.yaml", "--repro", tmp_path / "amp",
                  tmp_path=tmp_path)
    f = result.finding
    meta = json.loads((tmp_path / "amp" / "meta.json").read_text())
    assert meta["scale"] == 128.0 and meta["precision"] == "fp16"
    # The scaled gradient entering the fp16 matmul is the step's scale, not the live one.
    assert f["op"] == "aten.mm.default" and f["inputs"][0]["max"] == 128.0
    out = tmp_path / "replay.json"
    assert run_cli("replay", tmp_path / "amp", "--json", out, "-q").code == 1
    again = json.loads(out.read_text())["finding"]
    assert (again["op"], again["inputs"][0]["max"], again["cause"]) == (
        "aten.mm.default", 128.0, "dtype-overflow")


def _replayed(folder, tmp_path, *extra):
    out = tmp_path / "replay.json"
    result = run_cli("replay", folder, "--json", out, "-q", *extra)
    result.report = json.loads(out.read_text())
    return result


def test_dataclass_batch_with_file_names_replays_as_the_dataclass(tmp_path):
    folder, finding = _bundle(tmp_path, "dataclass_string_ids")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["batch_structure"]["type"] == "dataclass_string_ids:Clips"
    rows = torch.load(folder / "rows.pt", weights_only=True)
    assert rows["ids"] == ["clip_0021.wav"] and rows["frames"].abs().sum() == 0
    again = _replayed(folder, tmp_path)
    assert again.code == 1          # the loss reads batch.frames: the dataclass was rebuilt
    for key in ("step", "where", "op", "module", "cause", "samples", "sample_rows"):
        assert again.finding[key] == finding[key], key
    proc = subprocess.run([sys.executable, "-c", BLOCK_NANAUDIT, "--rows"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "non-finite loss" in proc.stdout, proc.stdout + proc.stderr


BATCH_ENCODING_CASE = """
import torch
from torch import nn
from transformers import BatchEncoding


def build_model():
    torch.manual_seed(0)
    return nn.Embedding(20, 4)


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        mask = torch.ones(4, 5)
        if step == 1:
            mask[2] = 0.0                      # a row of padding only
        yield BatchEncoding({"input_ids": torch.randint(0, 20, (4, 5), generator=g),
                             "attention_mask": mask})


def loss(model, batch):
    assert isinstance(batch, BatchEncoding) and batch.input_ids is batch["input_ids"]
    mask = batch["attention_mask"].unsqueeze(-1)
    pooled = (model(batch.input_ids) * mask).sum(1) / mask.sum(1)
    return pooled.pow(2).mean()
"""


def test_batch_encoding_batches_replay_as_batch_encoding(case, tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    result = scan(case(BATCH_ENCODING_CASE), "--repro", tmp_path / "bundle", tmp_path=tmp_path)
    f = result.finding
    assert (result.code, f["step"], f["op"], f["cause"], f["samples"]) == (
        1, 1, "aten.div.Tensor", "div-by-zero", [2])
    meta = json.loads((tmp_path / "bundle" / "meta.json").read_text())
    assert meta["batch_structure"]["type"].endswith(":BatchEncoding")
    assert type(torch.load(tmp_path / "bundle" / "batch.pt", weights_only=True)) is dict
    again = _replayed(tmp_path / "bundle", tmp_path)
    assert again.code == 1, again.report["error"]
    for key in ("step", "where", "op", "cause", "samples", "source"):
        assert again.finding[key] == f[key], key


LOCAL_TYPES_CASE = """
import collections
import dataclasses
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def batches(kind):
    class Local(collections.UserDict):
        pass

    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor
    for step in range(3):
        x = torch.rand(4, 3) + 0.5
        if step == 1:
            x[1] = 0.0
        yield Local(x=x) if kind == "mapping" else Pair(x)


def loss(model, batch):
    return torch.log(batch["x"]).sum() * model(batch["x"]).mean()


def attribute_loss(model, batch):
    return torch.log(batch.x).sum() * model(batch.x).mean()
"""


def test_a_batch_type_defined_in_a_function_is_replayed_plain_and_said_so(case, tmp_path):
    config = case(LOCAL_TYPES_CASE, data={"entrypoint": "case:batches",
                                          "args": {"kind": "mapping"}})
    assert scan(config, "--repro", tmp_path / "bundle", tmp_path=tmp_path).code == 1
    again = _replayed(tmp_path / "bundle", tmp_path)
    assert again.code == 1 and again.finding["op"] == "aten.log.default"
    assert ("replay note: `case.batches.<locals>.Local` was replayed as a plain dict: it is "
            "defined inside a function") in again.finding["explanation"]


def test_a_loss_failing_on_a_batch_kept_plain_is_the_user_code_error_with_the_note(case, tmp_path):
    config = case(LOCAL_TYPES_CASE, data={"entrypoint": "case:batches",
                                          "args": {"kind": "dataclass"}},
                  loss="case:attribute_loss")
    assert scan(config, "--repro", tmp_path / "bundle", tmp_path=tmp_path).code == 1
    again = _replayed(tmp_path / "bundle", tmp_path)
    assert again.code == 4
    message = again.report["error"]["message"]
    assert "AttributeError" in message and "`case.batches.<locals>.Pair` was replayed as a " \
                                           "plain dict" in message


def test_replay_options_for_recorded_bundles_are_refused_for_scan_bundles(tmp_path):
    folder, _ = _bundle(tmp_path)
    refused = run_cli("replay", folder, "--model", "x:y")
    assert refused.code == 2 and "this bundle's config names the model" in refused.stderr


def test_numpy_and_python_rng_states_round_trip_through_a_bundle(tmp_path):
    numpy = pytest.importorskip("numpy")
    import random
    from types import SimpleNamespace

    from nanaudit.commands.bundle import rng_payload
    from nanaudit.commands.bundle_script import restore_rng
    numpy.random.seed(3)
    random.seed(4)
    rng = SimpleNamespace(python=random.getstate(), torch_cpu=torch.get_rng_state(), cuda=None,
                          numpy=numpy.random.get_state())
    expected = (numpy.random.rand(3).tolist(), random.random(), torch.rand(2).tolist())
    torch.save(rng_payload(rng), tmp_path / "rng.pt")      # weights_only must read it back
    numpy.random.rand(10), random.random(), torch.rand(5)
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True), torch.device("cpu"))
    assert (numpy.random.rand(3).tolist(), random.random(), torch.rand(2).tolist()) == expected
