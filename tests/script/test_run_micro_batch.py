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
from helpers import run_cli

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
