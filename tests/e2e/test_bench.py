"""The benchmark's smoke run: checks the shape of its output, never its timings."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_bench_quick_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick",
                           "--clock", "cpu", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "median step time ratio to the plain loop" in done.stdout
    assert "replay of one bad step" in done.stdout
    assert "host syncs per step" in done.stdout and "cpu clock" in done.stdout
    body = json.loads(out.read_text())
    assert body["clock"] == "cpu"
    variants = {"plain", "nanaudit", "nanaudit sync", "nanaudit deferred", "sentinels only",
                "+activation watch", "detect_anomaly", "hook .item() (HF)"}
    assert [r["workload"] for r in body["results"]] == ["transformer (small)", "tiny mlp"]
    for result in body["results"]:
        assert set(result["ratio"]) == variants and result["ratio"]["plain"] == 1.0
        assert result["overhead_ms_per_step"]["plain"] == 0.0
        assert all(len(v) == result["rounds"] for v in result["raw_step_s"].values())
        # One read per step plus the final check, in both read modes (1 step per round).
        syncs = result["syncs_per_step"]
        assert syncs["nanaudit sync"]["nanaudit_reads"] == 2.0
        assert syncs["nanaudit deferred"]["nanaudit_reads"] == 2.0
        assert "nanaudit_reads" not in syncs["plain"]
        modes = result["read_mode"]
        assert (modes["nanaudit"]["mode"], modes["nanaudit deferred"]["mode"]) == (
            "sync", "deferred")                  # the CPU default, and the fused SGD deferring
    assert body["replay"]["op"] == "aten.log.default"
    assert body["replay"]["isolation_replays"] >= 1


def test_device_checks_script_parses_and_refuses_an_unknown_part(tmp_path):
    # scripts/device_checks.sh is run on a GPU machine only; here: it parses, and a part it does
    # not know is exit 2 with its name, before anything runs.
    script = ROOT / "scripts" / "device_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), "no-such-part"],
                          capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 2 and "unknown part: no-such-part" in done.stderr


@pytest.mark.slow
def test_profile_run_step_splits_a_clean_step_into_the_hooks():
    # scripts/profile_run_step.py (the GPU run's profile part) on the CPU, a few steps: each
    # of run's hooks is timed per call, and the clean loop under `run` stays a clean run.
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_run_step.py"),
                           "--steps", "260", "--rounds", "1"], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert head.startswith("cpu, width 256, steps 200..260: plain ") and "x, +" in head
    timed = {row.split()[0] for row in rows}
    assert {"pre_step", "first_call", "post_step", "loss", "returned", "read_step"} <= timed
    assert "device" not in timed                  # no wait for a device on the CPU


@pytest.mark.slow
def test_profile_scan_step_names_what_scan_adds():
    # scripts/profile_scan_step.py (the GPU profile that found a per-tensor check path) on the
    # CPU: the check's fused norm is among the ops scan adds to a plain step.
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_scan_step.py"),
                           "--workload", "tiny mlp", "--steps", "3", "--top", "40"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tiny mlp on cpu: plain ") and " ms a step, scan " in lines[0]
    assert lines[1].startswith("host time added per step by ops and profiled functions: ")
    assert any(line.split()[-1] == "aten::_foreach_norm" for line in lines[2:])
