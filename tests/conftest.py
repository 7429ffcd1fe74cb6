"""Fixtures shared by every test folder (helpers that are not fixtures live in helpers.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml


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

