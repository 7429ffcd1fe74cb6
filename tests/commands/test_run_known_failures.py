"""A failure of training code that is no non-finite value but a shape of the data the project
knows (docs/real-world.md: BatchNorm given a training batch of one raises on torch 2.13 rather
than making NaN) is the user's error, exit 4, with a hint of what to do in every format; any
other failure gets none."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import run_cli

from nanaudit.exitcodes import ExitCode

# 65 samples in batches of 16: the last batch holds one.
LAST_BATCH_OF_ONE = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(65, 10), torch.randint(0, 3, (65,)))
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=16, shuffle=True):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    RAISE
"""


@pytest.mark.parametrize("raise_after", [False, True])
def test_a_training_batch_of_one_at_batch_norm_is_the_users_error_with_a_hint(tmp_path,
                                                                              raise_after):
    code = textwrap.dedent(LAST_BATCH_OF_ONE)
    if raise_after:     # the data with a batch size that divides it, then a ValueError of its own
        code = code.replace("65, 10), torch.randint(0, 3, (65,)", "64, 10), torch.randint(0, 3, "
                                                                    "(64,)")
    code = code.replace("RAISE", "raise ValueError('Expected more values')" if raise_after
                        else "")
    script, out, md = tmp_path / "train.py", tmp_path / "r.json", tmp_path / "r.md"
    script.write_text(code)
    result = run_cli("run", "--json", out, "--markdown", md, script)
    error = json.loads(out.read_text())["error"]
    assert result.code == ExitCode.USER_CODE and error["type"] == "UserCodeError"
    if raise_after:
        assert "hint" not in error and "hint:" not in result.stdout + result.stderr
        assert "**Hint:**" not in md.read_text()
        return
    assert "Expected more than 1 value per channel" in error["message"]
    assert "drop_last=True" in error["hint"]
    assert f"hint: {error['hint']}" in " ".join((result.stdout + result.stderr).split())
    assert f"**Hint:** {error['hint']}" in md.read_text()
