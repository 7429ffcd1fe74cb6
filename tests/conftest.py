"""Shared helpers: run the CLI in-process, and write small user programs plus configs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from nanaudit.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _scratch_cwd(tmp_path, monkeypatch):
    """Run every test in its own folder: default outputs (./nanaudit-reports) land there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts of `Tensor.tolist()` and `Tensor.item()` calls (host reads of device values)."""
    import torch
    calls = {"tolist": 0, "item": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


class Result:
    def __init__(self, code, stdout, stderr, report):
        self.code, self.stdout, self.stderr, self.report = code, stdout, stderr, report

    @property
    def finding(self):
        return self.report["finding"]


def run_cli(*args, env=None) -> Result:
    runner = CliRunner()
    result = runner.invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)
    return Result(result.exit_code, result.stdout, result.stderr, None)


def scan(config, *extra, tmp_path=None) -> Result:
    """`nanaudit scan CONFIG --json PATH`, returning the exit code and the parsed report."""
    out = Path(tmp_path or Path(config).parent) / "report.json"
    result = run_cli("scan", config, "--json", out, "--quiet", *extra)
    result.report = json.loads(out.read_text()) if out.exists() else None
    return result


@pytest.fixture
def case(tmp_path):
    """Write `case.py` (dedented code) and `config.yaml` (keys given) in tmp_path."""
    def write(code: str, **config) -> Path:
        (tmp_path / "case.py").write_text(textwrap.dedent(code))
        lines = {"model": "case:build_model", "data": "case:batches", "loss": "case:loss"}
        lines.update(config)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(lines, sort_keys=False))
        return path
    return write


LINEAR_CASE = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        torch.manual_seed(0)
        return nn.Linear(3, 1)

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            yield torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)

    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()
""")
