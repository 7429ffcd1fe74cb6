"""The benchmark's smoke run: checks the shape of its output, never its timings."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_bench_quick_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "median step time ratio to the plain loop" in done.stdout
    assert "replay of one bad step" in done.stdout
    body = json.loads(out.read_text())
    variants = {"plain", "nanaudit", "sentinels only", "+activation watch", "detect_anomaly",
                "hook .item() (HF)"}
    for result in body["results"]:
        assert set(result["ratio"]) == variants and result["ratio"]["plain"] == 1.0
        assert all(len(v) == result["rounds"] for v in result["raw_step_s"].values())
    assert body["replay"]["op"] == "aten.log.default"
    assert body["replay"]["isolation_replays"] >= 1
