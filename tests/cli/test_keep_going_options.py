"""--keep-going and --max-bad-steps for `scan` and `run`: parsed, validated (N >= 1, default
10, --max-bad-steps alone is a usage error) and carried into the command's options. Both
skip bad steps (tests/commands/test_scan_keep_going.py, test_run_keep_going.py): neither says
the skipping is not built."""

from __future__ import annotations

import pytest
from helpers import ROOT, run_cli

from nanaudit.report.bad_steps import MAX_BAD_STEPS
from nanaudit.report.model import Report


def _clean(command: str) -> Report:
    return Report(tool_version="0.1.0", config={}, torch_version="2.13.0", device="cpu",
                  status="clean", steps_run=1, command=command)


@pytest.fixture
def received(monkeypatch):
    """The options each command was called with (its work replaced by a clean report)."""
    import nanaudit.commands.run
    import nanaudit.commands.scan
    seen: dict = {}

    def scan(config, options):
        seen["scan"] = options
        return _clean("scan")

    def run_script(target, options):
        seen["run"] = options
        return _clean("run")
    monkeypatch.setattr(nanaudit.commands.scan, "scan", scan)
    monkeypatch.setattr(nanaudit.commands.run, "run_script", run_script)
    return seen


@pytest.mark.parametrize("command", ["scan", "run"])
def test_the_options_reach_the_command(received, command, tmp_path):
    target = tmp_path / ("config.yaml" if command == "scan" else "train.py")
    result = run_cli(command, "--keep-going", "--max-bad-steps", "3", "--no-repro" if
                     command == "scan" else "--no-rerun", target)
    assert result.code == 0, result.stderr
    options = received[command]
    assert (options.keep_going, options.max_bad_steps) == (True, 3)
    # scan and run both skip bad steps: neither warns that skipping is not built.
    assert "skipping a bad step is not built yet" not in result.stderr


@pytest.mark.parametrize("command", ["scan", "run"])
def test_the_defaults(received, command, tmp_path):
    target = tmp_path / ("config.yaml" if command == "scan" else "train.py")
    assert run_cli(command, target).code == 0
    assert (received[command].keep_going, received[command].max_bad_steps) == (
        False, MAX_BAD_STEPS) == (False, 10)
    assert run_cli(command, "--keep-going", target).code == 0
    assert received[command].max_bad_steps == 10


@pytest.mark.parametrize("command", ["scan", "run"])
def test_max_bad_steps_alone_or_below_one_is_a_usage_error(received, command, tmp_path):
    target = tmp_path / ("config.yaml" if command == "scan" else "train.py")
    alone = run_cli(command, "--max-bad-steps", "3", target)
    assert alone.code == 2 and "--max-bad-steps needs --keep-going" in alone.stderr
    zero = run_cli(command, "--keep-going", "--max-bad-steps", "0", target)
    assert zero.code == 2 and "0 is not in the range x>=1" in zero.stderr
    assert command not in received            # nothing ran


def test_keep_going_scans_past_the_demos_bad_step(tmp_path):
    # The demo's bad step 6 is skipped, localized and recorded; the scan trains to its end
    # (12 steps) and exits 1, with the finding also in `findings`.
    out = tmp_path / "report.json"
    result = run_cli("scan", ROOT / "configs" / "demo.yaml", "--keep-going", "--quiet",
                     "--no-repro", "--json", out)
    import json
    body = json.loads(out.read_text())
    assert result.code == 1 and body["finding"]["step"] == 6 and body["steps_run"] == 12
    assert [(f["step"], f["action"]) for f in body["findings"]] == [(6, "skipped")]
    assert body["bad_steps"]["skipped"] == 1
    assert "not built yet" not in result.stderr
