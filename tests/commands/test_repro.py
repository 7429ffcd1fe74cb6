"""Repro bundles, `nanaudit replay` and `nanaudit init`: what a finding leaves behind."""

import json
import os
import subprocess
import sys

import torch

from helpers import ROOT, run_cli, scan


EXAMPLES = ROOT / "configs" / "examples"


def _bundle(tmp_path, name="log_negative"):
    result = scan(EXAMPLES / f"{name}.yaml", "--repro", tmp_path / "bundle", tmp_path=tmp_path)
    assert result.code == 1 and result.report["repro"] == str(tmp_path / "bundle")
    return tmp_path / "bundle", result.finding


def test_bundle_holds_state_batch_rows_config_and_report(tmp_path):
    folder, finding = _bundle(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["batch.pt", "config.yaml", "meta.json", "nanaudit-bundle.json", "report.json", "repro.py",
                     "rng.pt", "rows.pt", "state.pt"]
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
    blocker = ("import sys, runpy; sys.modules['nanaudit'] = None; sys.argv = ['repro.py'] + "
               "sys.argv[1:]; runpy.run_path('repro.py', run_name='__main__')")
    for extra in ([], ["--rows"]):
        proc = subprocess.run([sys.executable, "-c", blocker, *extra], cwd=folder,
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
