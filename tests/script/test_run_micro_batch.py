"""Under gradient accumulation the finding names the micro-batch whose ops made the value, as
well as its rows (which are that micro-batch's): for a gradient trip (the value made in one
micro-batch's backward, seen only in the window's summed gradients), for an error the script
raised in a later micro-batch, in-process and on the re-run alike. A window of one backward
names none. Before, a gradient or error trip named rows with no micro-batch (`[1]` of which of
the four?), in-process and on the re-run."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import line_of, run_cli

# A backward-only fault (sqrt of an all-zero row: finite forward, infinite derivative) or a
# forward `log(0)` that the script's own assert stops at, in micro-batch 2 of step 3.
ACCUMULATED = """
    import sys

    import torch
    from torch import nn

    fault, accumulation = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        optimizer.zero_grad()
        for micro in range(accumulation):
            x = torch.randn(4, 8)
            if step == 3 and micro == min(2, accumulation - 1):
                x[1] = 0.0
            out = model(x)
            if fault == "backward":
                length = torch.sqrt((x * x).sum(1, keepdim=True) + 0 * out)
                loss = (out * length).mean() / accumulation
            else:
                loss = (out.abs() * torch.log((x * x).sum(1, keepdim=True))).mean()
                assert torch.isfinite(loss), f"loss {loss}"
            loss.backward()
        optimizer.step()
"""

CASES = {   # fault -> (where, op, cause)
    "backward": ("backward", "aten.div.Tensor", "sqrt-domain"),
    "assert": ("forward", "aten.log.default", "log-domain"),
}


def _finding(tmp_path, fault: str, accumulation: int, *flags: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ACCUMULATED))
    out = tmp_path / "report.json"
    result = run_cli("run", "-q", *flags, "--json", out, script, fault, str(accumulation))
    assert result.code == 1, result.stderr
    return json.loads(out.read_text())["finding"]


@pytest.mark.parametrize("fault", sorted(CASES))
@pytest.mark.parametrize("path", ["in-process", "re-run"])
def test_the_micro_batch_that_made_the_value_is_named_with_its_rows(tmp_path, fault, path):
    f = _finding(tmp_path, fault, 4, *(["--rerun"] if path == "re-run" else []))
    assert (f["step"], f["micro_batch"], f["samples"]) == (3, 2, [1])
    assert (f["where"], f["op"], f["cause"]) == CASES[fault]
    assert f["localized_by"] == path


def test_a_window_of_one_backward_names_no_micro_batch(tmp_path):
    f = _finding(tmp_path, "backward", 1)
    assert (f["step"], f["micro_batch"], f["samples"], f["cause"]) == (
        3, None, [1], "sqrt-domain")
    assert f["localized_by"] == "in-process"


# Batches of the data made non-finite (row 2) at the given indices; two micro-batches a step,
# through a GradScaler (disabled: a plain step) as AMP scripts do.
BAD_BATCHES = """
    import sys

    import torch
    from torch import nn

    bad, scaled = {int(i) for i in sys.argv[1].split(",")}, sys.argv[2] == "scaler"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    data = torch.Generator().manual_seed(1)
    for i in range(12):
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        if i in bad:
            x[2] = float("nan")
        loss = ((model(x) - y) ** 2).mean() / 2
        scaler.scale(loss).backward()
        if i % 2 == 1:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
"""


def _bad_batches(tmp_path, bad: str, scaled: bool, *flags: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(BAD_BATCHES))
    out = tmp_path / "report.json"
    result = run_cli("run", "-q", *flags, "--json", out, script, bad,
                     "scaler" if scaled else "plain")
    assert result.code == 1, result.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("micro", [0, 1])
def test_a_bad_batch_is_named_in_whichever_micro_batch_of_the_window_it_came(tmp_path, micro):
    # The first run alone: before, it read the window's last call's inputs only (a bad first
    # micro-batch was "[] (shapes [])", a bad last one named no micro-batch).
    f = _bad_batches(tmp_path, str(4 + micro), False, "--no-rerun")["finding"]
    assert (f["step"], f["where"], f["micro_batch"], f["tensor"], f["samples"]) == (
        2, "input", micro, "input[0]", [2])
    assert f"micro-batch {micro} of step 2" in f["explanation"]


def test_an_amp_scripts_bad_first_micro_batch_is_traced_by_the_rerun_without_the_model(tmp_path):
    # Before: the re-run compared its bad inputs with the first run's empty ones and called
    # the script not deterministic; and without the model no weight got a gradient, so the
    # GradScaler's step asserted ("No inf checks were recorded") and the model ran in full.
    report = _bad_batches(tmp_path, "4", True)
    f = report["finding"]
    assert (f["step"], f["micro_batch"], f["samples"], f["reproduced"]) == (2, 0, [2], None)
    assert report["run"]["rerun"]["model_skipped"] is True
    line = line_of(tmp_path / "train.py", 'float("nan")')
    assert f"entered torch at train.py:{line}" in f["explanation"]
    assert "first run had changed" not in f["explanation"]
    assert "skipped this step's update (the bad batch" in f["explanation"]


def test_keep_going_lists_each_bad_batch_with_its_micro_batch(tmp_path):
    skip, summary = tmp_path / "skip.json", tmp_path / "summary.md"
    _bad_batches(tmp_path, "5,8", True, "--keep-going", "--skip-list", skip,
                 "--markdown", summary)
    entries = json.loads(skip.read_text())["skip"]
    assert [(e["batch"], e["step"], e["micro_batch"], e["rows"]) for e in entries] == [
        (2, 2, 1, [2]), (4, 4, 0, [2])]
    table = summary.read_text()             # the bad steps' table names them too
    assert "| micro-batch 1: [2] |" in table and "| micro-batch 0: [2] |" in table
