"""A ZeRO-3 step as `nanaudit run`'s hooks hear it, without DeepSpeed: its optimizer's `step`
hands the torch optimizer one sub-group at a time (deepspeed/runtime/zero/stage3.py,
`_optimizer_step`), so the torch step runs once per sub-group; the ZeRO step is one step with
one check, at its entry, and a step it skips is no step."""

from types import SimpleNamespace

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from nanaudit.script.zero_steps import ZeroSteps


class Zero3:
    """DeepSpeed's ZeRO-3 optimizer's step, as its structure has it: each sub-group's flat put
    in the torch optimizer's group for its own `step()`, the group emptied after; none on an
    overflow."""

    def __init__(self, flats: list[torch.Tensor]):
        self.optimizer = torch.optim.SGD(flats, lr=0.1)
        self.flats = flats
        self.overflow = False

    def step(self) -> None:
        if self.overflow:
            return
        for flat in self.flats:
            flat.grad = torch.ones_like(flat)
            self.optimizer.param_groups[0]["params"] = [flat]
            self.optimizer.step()
            self.optimizer.param_groups[0]["params"] = []


class Heard:
    def __init__(self):
        self.calls: list[str] = []
        self.steps = 0

    def update_starting(self) -> None:
        self.calls.append("starting")

    def before_update(self, optimizer, evaluation) -> None:
        self.calls.append("check")

    def after_update(self, optimizer) -> None:
        self.calls.append("step")
        self.steps += 1

    def stepped(self) -> int:
        return self.steps


def test_a_zero3_step_of_three_sub_groups_is_one_step_with_one_check_at_its_entry():
    heard, tap = Heard(), SimpleNamespace(stop=lambda: None, close=lambda: None)
    zero = Zero3([torch.nn.Parameter(torch.zeros(2)) for _ in range(3)])
    engine = SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: 3)
    steps = ZeroSteps(heard, tap, lambda: None)
    # the script's global optimizer hooks, as hooks.py leaves a running ZeRO step's unheard
    torch_steps = []
    handles = [register_optimizer_step_pre_hook(
                   lambda o, a, k: None if o is steps.running else torch_steps.append("pre")),
               register_optimizer_step_post_hook(
                   lambda o, a, k: None if o is steps.running else torch_steps.append("post"))]
    try:
        steps.wrap(engine)
        steps.wrap(engine)                       # wrapped once
        zero.step()
        assert heard.calls == ["starting", "check", "step"] and torch_steps == []
        assert all(torch.equal(f, torch.full((2,), -0.1)) for f in zero.flats)   # all stepped
        zero.overflow = True                     # DeepSpeed skips: checked, not a step
        zero.step()
        assert heard.calls[3:] == ["starting", "check"] and heard.steps == 1
        steps.remove()
        assert "step" not in zero.__dict__
        zero.overflow = False
        zero.step()
        assert torch_steps == ["pre", "post"] * 3 and heard.steps == 1
    finally:
        for handle in handles:
            handle.remove()
