"""The producer re-run's stand-in for the model (script/model_skip.py), in-process: which calls
are computed, what the stand-in is, and when a shifted random stream abandons the re-run."""

from __future__ import annotations

import torch
from torch import nn

from nanaudit.script.model_skip import ModelSkip


class Counted(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc, self.drop, self.calls = nn.Linear(3, 2), nn.Dropout(dropout), 0

    def forward(self, x):
        self.calls += 1
        return {"out": self.drop(self.fc(x)), "rows": torch.arange(x.shape[0])}


def _skip(step: list[int], until: int) -> ModelSkip:
    return ModelSkip(until, lambda: step[0]).install()


def test_calls_before_the_step_are_stood_in_for_by_the_first_calls_output():
    torch.manual_seed(0)
    model, step = Counted(), [0]
    hooked: list[int] = []                      # only forward is stood in for: hooks still run
    model.register_forward_hook(lambda *_: hooked.append(1))
    skip = _skip(step, until=3)
    try:
        first = model(torch.randn(4, 3))
        outs = []
        for step[0] in (1, 2):
            outs.append(model(torch.randn(4, 3)))
        shorter = model(torch.randn(2, 3))        # another shape: computed
        step[0] = 3
        at_step = model(torch.randn(4, 3))        # the bad step: computed
    finally:
        skip.remove()
    assert model.calls == 3 and (skip.computed, skip.stood_in) == (2, 2)
    assert len(hooked) == 5                      # every call, the two stood in for included
    for out in outs:
        assert torch.equal(out["out"], first["out"].detach())
        assert out["out"].requires_grad and out["out"].grad_fn is None     # a fresh leaf
        assert not out["rows"].requires_grad
    out["out"].sum().backward()                  # reaches no weight
    assert model.fc.weight.grad is None
    assert shorter["out"].shape == (2, 2) and at_step["out"].grad_fn is not None
    model(torch.randn(4, 3))
    assert model.calls == 4                      # removed: every call computes again


def test_data_drawing_after_a_stood_in_dropout_abandons_the_skip():
    torch.manual_seed(0)
    model, step = Counted(dropout=0.5), [0]
    skip = _skip(step, until=5)
    try:
        model(torch.randn(4, 3))                 # computed: its dropout draws
        skip.stretch_started()
        assert skip.stretch_ended()              # nothing stood in for yet: nothing shifted
        step[0] = 1
        model(torch.randn(4, 3))                 # stood in for: its draw is missing
        skip.stretch_started()
        assert skip.stretch_ended()              # data code that draws nothing is fine
        skip.stretch_started()
        torch.rand(3)                            # the data code's own draw
        assert not skip.stretch_ended()
    finally:
        skip.remove()
    assert "global random stream" in (skip.abandoned or "")


def test_a_model_without_dropout_leaves_the_streams_to_the_data():
    torch.manual_seed(0)
    model, step = Counted(), [0]
    skip = _skip(step, until=5)
    try:
        model(torch.randn(4, 3))
        step[0] = 1
        model(torch.randn(4, 3))
        skip.stretch_started()
        torch.rand(3)
        assert skip.stretch_ended() and skip.abandoned is None
    finally:
        skip.remove()


def test_a_model_compiled_in_place_is_computed_never_stood_in_for():
    # `model.compile()` keeps the module's type; its calls are compiled all the same, and a
    # stand-in would hand dynamo a new forward each call.
    from nanaudit.script.model_skip import compiled
    model = Counted()
    assert not compiled(model)
    model.compile()
    assert compiled(model) and compiled(torch.compile(Counted()))
