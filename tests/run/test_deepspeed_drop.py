"""Accelerate asked for DeepSpeed but training without it (run/deepspeed_zero.py's
`dropped_deepspeed`): the setup says it was asked for, the model says it was not used."""

from torch import nn

from nanaudit.run.deepspeed_zero import dropped_deepspeed


def test_deepspeed_asked_for_but_a_plain_model_trains_is_said(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    note = dropped_deepspeed(nn.Linear(2, 1))
    assert note is not None and "`Linear`, not a DeepSpeed engine" in note
    assert "Accelerate dropped DeepSpeed" in note


def test_no_deepspeed_asked_for_is_no_note(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert dropped_deepspeed(nn.Linear(2, 1)) is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert dropped_deepspeed(nn.Linear(2, 1)) is None
