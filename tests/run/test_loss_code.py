"""The loss-code recorder: the autocast regions each recorded op ran in (read with one C call
when none is enabled), and the mode popped by backward so that what follows is not recorded."""

from __future__ import annotations

import torch
from torch import nn

from nanaudit.run.loss_code import (
    LossCode,
    LossCodeRecorder,
    autocast_state,
    replay,
)


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


def _recorded(code_of) -> tuple[LossCode, torch.Tensor, torch.Tensor]:
    """The loss code `code_of(out)` recorded on a model's output: (code, out, the loss)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    out = model(torch.randn(8, 4))
    code, recorder = LossCode(), LossCodeRecorder()
    recorder.start(code)
    loss = code_of(out)
    recorder.reached_backward(torch.Tensor.backward, (loss,), {})
    return code, out, loss


def test_the_replay_writes_into_copies_of_the_scripts_tensors() -> None:
    total, counts, table = torch.zeros(()), torch.zeros(3), torch.zeros(2, 2)

    def code_of(out):
        total.add_(out.detach().sum())            # a method ending in _
        counts[1] += 1                            # __setitem__ of what __getitem__ made
        torch.mul(out.detach().mean(), 2, out=table[0, 0:1])   # out= a view: written
        return (out - total).pow(2).mean()
    code, out, loss = _recorded(code_of)
    before = (total.clone(), counts.clone(), table.clone())
    env = replay(code, {id(out): out.detach().clone().requires_grad_()})
    assert torch.equal(total, before[0]) and torch.equal(counts, before[1])
    assert torch.equal(table, before[2])
    assert id(total) in env and not torch.equal(env[id(total)], total)   # its copy moved on


def test_a_write_through_a_view_of_the_scripts_tensor_goes_to_the_copy() -> None:
    state = torch.zeros(4)

    def code_of(out):
        state[:2].copy_(out.detach()[:2, 0])      # a view of the script's tensor, written
        return (out + state[:2].sum()).pow(2).mean()
    code, out, loss = _recorded(code_of)
    before = state.clone()
    env = replay(code, {id(out): out.detach().clone().requires_grad_()})
    assert torch.equal(state, before)
    assert torch.allclose(env[id(loss)], loss)    # the code read what it wrote, in the copy


def test_a_no_grad_op_replays_without_a_graph_and_create_graph_grads_are_recorded() -> None:
    def code_of(out):
        with torch.no_grad():
            scale = out.abs().mean()
        grad, = torch.autograd.grad(out.sum(), out, create_graph=True)
        return (out * scale + grad).pow(2).mean()
    code, out, loss = _recorded(code_of)
    funcs = [op.func for op in code.ops]
    assert torch.autograd.grad in funcs and code.roots[0][0] is not torch.autograd.grad
    assert next(op.grad for op in code.ops if op.func.__name__ == "mean") is False
    again = out.detach().clone().requires_grad_()
    env = replay(code, {id(out): again})
    assert torch.allclose(env[id(loss)], loss)


def test_a_buffer_the_loss_code_fills_by_setitem_is_filled_in_the_replays_copy() -> None:
    # pytorch/tutorials' seq2seq loop: `encoder_outputs[ei] = encoder_output[0, 0]` writes the
    # model's outputs into a tensor the script made before the step, and `x[i] = v` returns
    # None: the replay still writes, into its copy of the buffer, so its graph is its own.
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
    before = buffer.detach().clone()
    again = model(x)
    env = replay(code, {id(out): again})
    assert torch.equal(env[id(loss)], loss) and env[id(buffer)] is not buffer
    assert torch.equal(buffer, before)
    env[id(loss)].backward()          # the run's graph was freed by its backward: not this one
    assert model.weight.grad is not None and torch.isfinite(model.weight.grad).all()
