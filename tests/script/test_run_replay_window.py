"""The in-process replay of a loss trip stops at the first micro-batch whose replayed loss is
non-finite, before its backward: the value was made in that forward, and nothing after it is
earlier. Seen on karpathy/llm.c's train_gpt2.py (a GPT-2 with a 50,257-token vocabulary, two
micro-batches, `--learning_rate 1e30`): the replay traced both micro-batches' forward and
backward, every op after the first NaN reading its tensors' kinds, 85.8 s against a 5 s step;
stopped at the bad forward, 21.0 s (6.2 s in a quieter, profiled run; 2 shared cores).
The micro-batch it stopped in is the finding's `micro_batch`: its `samples` are that one's rows."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import run_cli

ACCUMULATED = """
    import sys

    import torch
    from torch import nn

    accumulation = int(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        for micro in range(accumulation):
            x = torch.randn(8, 4)
            if step == 2 and micro == 1:
                x[3] = 1e4                     # a corrupt row: its score overflows exp
            score = model(x).squeeze(1) + x.sum(1)
            loss = torch.log(torch.exp(score).mean()) / accumulation
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.slow
def test_a_loss_trip_replays_up_to_the_bad_forward_whatever_the_window(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ACCUMULATED))
    traced = []
    for accumulation in (2, 4):
        out = tmp_path / f"report{accumulation}.json"
        result = run_cli("run", "-q", "--json", str(out), str(script), str(accumulation))
        assert result.code == 1, result.stderr
        report = json.loads(out.read_text())
        f = report["finding"]
        assert (f["step"], f["where"], f["op"], f["cause"]) == (
            2, "forward", "aten.exp.default", "exp-overflow")
        assert f["samples"] == [3] and f["localized_by"] == "in-process"
        assert f["micro_batch"] == 1          # the rows are that micro-batch's
        assert report["run"]["replay"]["status"] == "reproduced"
        traced.append(report["run"]["replay"]["ops_traced"])
    # Micro-batch 0 whole, then micro-batch 1 up to its bad loss: nothing after, either way.
    assert traced[0] == traced[1]
