"""A rank's in-process replay of its own step (script/rank_replay.py), without DeepSpeed: a
DeepSpeed ZeRO-1/2 engine's module is what the rank replays, and the replay's backward must not
run DeepSpeed's hooks, which run after each gradient is accumulated and reduce it with every
peer (deepspeed/runtime/zero/stage_1_and_2.py, `create_gradient_handling_hooks`: one
`register_post_accumulate_grad_hook` per trained parameter). A rank replaying alone that ran
them would wait in that reduction for peers that are not replaying, and would add the replay's
gradients to DeepSpeed's buckets."""

import sys
from types import ModuleType

import pytest
import torch
from torch import nn

from nanaudit.script.rank_replay import local_backward, local_module


class DeepSpeedEngine(nn.Module):
    """An engine as `is_engine` knows one: the class of `deepspeed.runtime.engine`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


@pytest.fixture
def engine(monkeypatch):
    fake = ModuleType("deepspeed.runtime.engine")
    fake.DeepSpeedEngine = DeepSpeedEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.engine", fake)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    reduced: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: reduced.append(name))
    return DeepSpeedEngine(model), reduced


def expected_grads(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> list:
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    out = torch.func.functional_call(model, dict(zip(
        [n for n, _ in model.named_parameters()], twin)), (x,))
    torch.autograd.backward(out.sum() * scale)
    return [t.grad for t in twin]


def test_a_deepspeed_engine_replays_its_module_and_backward_without_its_hooks(engine):
    ds, reduced = engine
    assert local_module(ds) is ds.module
    x = torch.randn(5, 4)
    loss = ds.module(x).sum()
    local_backward(ds, torch.Tensor.backward)(loss)
    assert reduced == []                           # no reduction ran
    for p, want in zip(ds.module.parameters(), expected_grads(ds.module, x)):
        torch.testing.assert_close(p.grad, want)    # the gradients set as backward would


def test_autograd_backward_with_its_seeds_and_inputs_and_gradients_accumulated(engine):
    ds, reduced = engine
    x = torch.randn(5, 4)
    first, last = ds.module[0].weight, ds.module[2].weight
    first.grad = torch.ones_like(first)             # a gradient already there is added to
    out = ds.module(x).sum()
    local_backward(ds, torch.autograd.backward)(out, grad_tensors=torch.tensor(2.0),
                                                inputs=[first])
    assert reduced == []
    want = expected_grads(ds.module, x, scale=2.0)[0]
    torch.testing.assert_close(first.grad, want + 1)
    assert last.grad is None                        # not among `inputs`: left alone


def test_other_modules_replay_the_scripts_own_backward(engine):
    ds, reduced = engine
    plain = ds.module
    assert local_module(plain) is plain
    assert local_backward(plain, torch.Tensor.backward) is torch.Tensor.backward
    plain(torch.randn(2, 4)).sum().backward()
    assert len(reduced) == 4                        # the hooks ran, as the script's would
