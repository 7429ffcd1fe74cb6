"""The timeline's gradient norm where the script clips: the total norm `clip_grad_norm_`
returned, before clipping, which is what the script's own log prints (the Trainer's and
llm.c's do), read in the step's one host read (script/hooks.py wraps `clip_grad_norm_`; the
check itself still reads the gradients as clipped)."""

from __future__ import annotations

import json
import math

from test_run_inprocess import audit, write

from nanaudit.commands.common import exit_code

# A plain loop that clips at 0.5 every step (the name imported from torch.nn.utils, as most
# scripts do), and writes what clip_grad_norm_ returned; `--two` adds a second optimizer for
# the last layer, clipped on its own (a GAN's two clips a step).
CLIPS = """
    import json
    import sys

    import torch
    from torch import nn
    from torch.nn.utils import clip_grad_norm_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    two = "--two" in sys.argv
    groups = [list(model[0].parameters()), list(model[2].parameters())] if two else \\
        [list(model.parameters())]
    optimizers = [torch.optim.SGD(g, lr=1e-3) for g in groups]
    norms = []
    for step in range(5):
        x, y = torch.randn(16, 8) * 10, torch.randn(16, 1) * 10
        loss = (model(x) - y).pow(2).mean()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for group, optimizer in zip(groups, optimizers):
            norms.append(float(clip_grad_norm_(group, 0.5)))
            optimizer.step()
    json.dump(norms, open(sys.argv[1], "w"))
"""


def test_the_timeline_shows_the_norm_clip_grad_norm_returned_before_clipping(tmp_path):
    path = write(tmp_path, CLIPS)
    report = audit(path, str(tmp_path / "norms.json"))
    assert exit_code(report) == 0
    printed = json.loads((tmp_path / "norms.json").read_text())
    assert min(printed) > 10            # every step clipped: the gradients read are at 0.5
    assert [e.grad_norm for e in report.timeline] == printed
    # still one read a step (and one of the weights the last update left, at the end)
    assert report.run.first_run.host_reads == 6


def test_each_optimizers_step_shows_its_own_clip(tmp_path):
    # Two optimizers, each clipping its group before its step: each check's entry carries the
    # clip heard since the check before it.
    path = write(tmp_path, CLIPS)
    report = audit(path, str(tmp_path / "norms.json"), "--two")
    assert exit_code(report) == 0
    printed = json.loads((tmp_path / "norms.json").read_text())
    assert len(printed) == 10 and [e.grad_norm for e in report.timeline] == printed


# A corrupt row, finite but huge (1e30), at step 3: the gradients stay finite, but
# `clip_grad_norm_`'s float32 sum of their squares is inf, so it scales them all to 0.
CLIP_OVERFLOW = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x = torch.randn(32, 8)
        if step == 3:
            x[4] = 1e30
        loss = model(x).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert step != 3 or all(p.grad.eq(0).all() for p in model.parameters())
        optimizer.step()
"""


def test_finite_gradients_the_clip_overflowed_on_and_zeroed_are_warned_of(tmp_path):
    report = audit(write(tmp_path, CLIP_OVERFLOW))
    assert report.status == "clean" and exit_code(report) == 0
    [warning] = report.warnings
    assert (warning.kind, warning.step, warning.module) == ("near-overflow", 3, None)
    assert warning.message.startswith("`clip_grad_norm_` returned a non-finite total norm at "
                                      "step 3 for gradients that were finite")
    assert "scaled every gradient to 0" in warning.message
    assert [math.isfinite(e.grad_norm) for e in report.timeline] == [True] * 3 + [False, True,
                                                                               True]


# The same corrupt row under `nanaudit scan`, whose `grad_clip:` clips as `clip_grad_norm_`
# does: the update of step 3 learned nothing, which only a warning tells (before: nothing did).
CLIP_OVERFLOW_CASE = """
    import torch
    from torch import nn

    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def batches():
        g = torch.Generator().manual_seed(0)
        for step in range(6):
            x = torch.randn(32, 8, generator=g)
            if step == 3:
                x[4] = 1e30
            yield x

    def loss(model, x):
        return model(x).abs().mean()
"""


def test_scans_grad_clip_warns_of_finite_gradients_it_zeroed(case, tmp_path):
    from helpers import scan
    config = case(CLIP_OVERFLOW_CASE, grad_clip=1.0, optimizer={"class": "torch.optim.SGD",
                                                                "lr": 0.01})
    result = scan(config, tmp_path=tmp_path)
    assert result.code == 0, result.stderr
    [warning] = result.report["warnings"]
    assert (warning["kind"], warning["step"]) == ("near-overflow", 3)
    assert warning["message"].startswith("`grad_clip`'s `clip_grad_norm_` returned a non-finite "
                                         "total norm at step 3 for gradients that were finite")
