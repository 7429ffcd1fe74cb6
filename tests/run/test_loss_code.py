"""The loss-code recorder: the autocast regions each recorded op ran in (read with one C call
when none is enabled), and the mode popped by backward so that what follows is not recorded."""

from __future__ import annotations

import torch
from torch import nn

from nanaudit.run.loss_code import LossCode, LossCodeRecorder, autocast_state, replay


def test_autocast_state_names_the_enabled_region_only() -> None:
    assert autocast_state() == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_state() == (("cpu", torch.bfloat16),)
    assert autocast_state() == ()


def test_recorded_ops_keep_their_autocast_region_and_replay_in_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    out = model(x)
    code, recorder = LossCode(), LossCodeRecorder()
    recorder.start(code)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scaled = out * 2.0
    loss = nn.functional.mse_loss(scaled.float(), y)
    recorder.reached_backward(torch.Tensor.backward, (loss,), {})
    loss.backward()
    assert not recorder.pushed
    regions = [op.autocast for op in code.ops]
    assert regions[0] == (("cpu", torch.bfloat16),)
    assert regions[-1] == ()
    again = model(x)
    env = replay(code, {id(out): again})
    assert torch.equal(env[id(loss)], loss)


def test_a_buffer_the_loss_code_writes_into_is_replayed_on_a_copy_of_it_as_it_was() -> None:
    # pytorch/tutorials' seq2seq loop: `encoder_outputs[ei] = encoder_output[0, 0]` writes the
    # model's outputs into a tensor the script made before the step; the replay writes the
    # replayed outputs into a copy of it as it was, so its graph is the replay's own.
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    buffer = torch.zeros(4, 3)
    out = model(x)
    code, recorder = LossCode(), LossCodeRecorder()
    recorder.start(code)
    buffer[1:3] = out
    loss = buffer.sum() + buffer[0].sum()
    recorder.reached_backward(torch.Tensor.backward, (loss,), {})
    loss.backward()
    assert list(code.before) == [id(buffer)] and torch.equal(code.before[id(buffer)],
                                                            torch.zeros(4, 3))
    again = model(x)
    env = replay(code, {id(out): again})
    assert torch.equal(env[id(loss)], loss) and env[id(buffer)] is not buffer
    env[id(loss)].backward()          # the run's graph was freed by its backward: not this one
    assert model.weight.grad is not None and torch.isfinite(model.weight.grad).all()
