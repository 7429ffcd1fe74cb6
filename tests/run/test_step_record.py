"""The step record: a replay starts from the window's state and leaves the trip's."""

from __future__ import annotations

import torch
from torch import nn

from nanaudit.run.step_record import StepRecord


def test_replaying_starts_from_the_window_and_leaves_the_state_the_trip_left():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Dropout(0.5))
    params = list(model.parameters())
    before = [b.clone() for b in model.buffers()]
    record = StepRecord()
    x = torch.randn(8, 4)
    call = record.called(model, model, (x,), {})
    out = model(x)
    out.sum().backward()
    grads = [p.grad for p in params]
    after = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    with record.replaying(params):
        assert all(p.grad is None for p in params)
        # The buffers as the window began: running statistics and the batch count.
        assert all(torch.equal(b, v) for b, v in zip(model.buffers(), before))
        call.seed_replay()
        again = model(x)
        assert torch.equal(again, out)           # the same dropout mask, the same statistics
        again.sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    # As the trip left it: the gradients (the same tensors), the buffers, the RNG streams.
    assert all(p.grad is g for p, g in zip(params, grads))
    assert all(torch.equal(b, v) for b, v in zip(model.buffers(), after))
    assert model[1].num_batches_tracked.item() == 1
    assert torch.equal(torch.get_rng_state(), rng)


def test_restore_buffers_undoes_a_skipped_steps_forward():
    model = nn.BatchNorm1d(3)
    record = StepRecord()
    x = torch.randn(5, 3) * 10 + 4
    record.called(model, model, (x,), {})
    model(x)
    assert not torch.equal(model.running_mean, torch.zeros(3))
    record.restore_buffers()
    assert torch.equal(model.running_mean, torch.zeros(3)) and model.num_batches_tracked == 0
