"""A ZeRO step as `nanaudit run`'s hooks hear it, without DeepSpeed: its optimizer's `step`
hands the torch optimizer one sub-group (ZeRO-3, deepspeed/runtime/zero/stage3.py) or one param
group (ZeRO-1/2, stage_1_and_2.py, `_optimizer_step(i)`) at a time, so the torch step runs once
per part; the ZeRO step is one step with one check, at its entry, and a step it skips is no
step. Under fp16's dynamic loss scale (DeepSpeed's own needs a GPU: on this CPU DeepSpeed
refuses fp16, "Type fp16 is not supported on your device.") a skip while the scale calibrates
is no finding, unless the scale collapses."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from nanaudit.script.step_log import StepLog
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
        self.log = StepLog()

    def update_starting(self) -> None:
        self.calls.append("starting")

    def before_update(self, optimizer, evaluation) -> None:
        self.calls.append("check")

    def after_update(self, optimizer) -> None:
        self.calls.append("step")
        self.steps += 1

    def stepped(self) -> int:
        return self.steps

    def scale_skipped(self, optimizer, scale, next_scale, params, scaler) -> None:
        self.calls.append(f"skipped at {scale:g}, now {next_scale:g}")


def script_hooks(steps: ZeroSteps) -> tuple[list, list]:
    """The script's global optimizer hooks, as hooks.py leaves a running ZeRO step's torch
    steps unheard: (the torch steps they heard, their handles)."""
    heard: list = []
    return heard, [register_optimizer_step_pre_hook(
                       lambda o, a, k: None if o is steps.running else heard.append("pre")),
                   register_optimizer_step_post_hook(
                       lambda o, a, k: None if o is steps.running else heard.append("post"))]


def test_a_zero3_step_of_three_sub_groups_is_one_step_with_one_check_at_its_entry():
    heard, tap = Heard(), SimpleNamespace(stop=lambda: None, close=lambda: None)
    zero = Zero3([torch.nn.Parameter(torch.zeros(2)) for _ in range(3)])
    engine = SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: 3)
    steps = ZeroSteps(heard, tap, lambda: None)
    torch_steps, handles = script_hooks(steps)
    try:
        steps.wrap(engine)
        steps.wrap(engine)                       # wrapped once
        zero.step()
        assert heard.calls == ["starting", "check", "step"] and torch_steps == []
        assert all(torch.equal(f, torch.full((2,), -0.1)) for f in zero.flats)   # all stepped
        # DeepSpeed skips a step the check let through (in a run, one that --keep-going
        # skipped): a step, as DeepSpeed's `global_steps` and the script's loop count it
        zero.overflow = True
        zero.step()
        assert heard.calls[3:] == ["starting", "check", "step"] and heard.steps == 2
        steps.remove()
        assert "step" not in zero.__dict__
        zero.overflow = False
        zero.step()
        assert torch_steps == ["pre", "post"] * 3 and heard.steps == 2
    finally:
        for handle in handles:
            handle.remove()


class Zero12:
    """DeepSpeed's ZeRO-1/2 optimizer's step, as stage_1_and_2.py has it: one flat fp32
    partition per param group; the reduced gradients kept by group (`averaged_gradients`)
    until the step, which all-reduces the overflow flag first and on an overflow skips (a
    dynamic scale backs off by its factor: `loss_scale` halves), else sets each flat's `.grad`
    (unscaled) and steps the torch optimizer with its `param_groups` set to that one group."""

    def __init__(self, sizes: list[int], scale: float | None = None):
        self.single_partition_of_fp32_groups = [torch.nn.Parameter(torch.ones(n))
                                                for n in sizes]
        self.optimizer = torch.optim.SGD(
            [{"params": [flat]} for flat in self.single_partition_of_fp32_groups], lr=0.1)
        self.averaged_gradients: dict = {}
        self.dynamic_loss_scale = scale is not None
        self.loss_scale = scale if scale is not None else 1.0

    def backward(self, grads: list[list[torch.Tensor]]) -> None:
        """The backward's epilogue: each group's reduced gradient slices (loss-scaled)."""
        self.averaged_gradients = dict(enumerate(grads))

    def step(self) -> None:
        grads = self.averaged_gradients
        # `_has_inf_or_nan`: a float32 sum of each gradient (finite values may overflow it)
        if not all(math.isfinite(float(g.float().sum())) for group in grads.values()
                   for g in group):
            if self.dynamic_loss_scale:
                self.loss_scale /= 2
            self.averaged_gradients = dict.fromkeys(grads)
            return
        groups = self.optimizer.param_groups
        for i, flat in enumerate(self.single_partition_of_fp32_groups):
            flat.grad = torch.cat([g.reshape(-1) for g in grads[i]]) / self.loss_scale
            self.averaged_gradients[i] = None
            self.optimizer.param_groups = [groups[i]]
            self.optimizer.step()
            self.optimizer.param_groups = groups
            flat.grad = None


def engine_of(zero, stage: int = 2) -> SimpleNamespace:
    return SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero12_step_of_two_param_groups_is_one_step_with_one_check_at_its_entry(stage):
    # Before: each group's torch step was a step of its own (the HF Trainer's decay / no-decay
    # groups doubled every step number), checked after DeepSpeed's overflow all-reduce.
    heard, tap = Heard(), SimpleNamespace(stop=lambda: None, close=lambda: None)
    zero = Zero12([3, 2])
    steps = ZeroSteps(heard, tap, lambda: None)
    torch_steps, handles = script_hooks(steps)
    try:
        steps.wrap(engine_of(zero, stage))
        zero.backward([[torch.ones(3)], [torch.ones(2)]])
        zero.step()
        assert heard.calls == ["starting", "check", "step"] and torch_steps == []
        assert [f.tolist() for f in zero.single_partition_of_fp32_groups] == [
            [pytest.approx(0.9)] * 3, [pytest.approx(0.9)] * 2]       # both groups stepped
        zero.backward([[torch.ones(3)], [torch.full((2,), math.inf)]])
        zero.step()                  # skipped (fp32: no scale to tell), yet a step
        assert heard.calls[3:] == ["starting", "check", "step"] and heard.steps == 2
    finally:
        steps.remove()
        for handle in handles:
            handle.remove()


def test_a_dynamic_scale_skip_is_told_with_the_scale_and_its_backoff():
    heard, tap = Heard(), SimpleNamespace(stop=lambda: None, close=lambda: None)
    zero = Zero12([2], scale=1024.0)
    steps = ZeroSteps(heard, tap, lambda: None)
    steps.wrap(engine_of(zero))
    try:
        zero.backward([[torch.full((2,), math.inf)]])
        zero.step()
        assert heard.calls == ["starting", "check", "skipped at 1024, now 512"]
        assert heard.steps == 0
    finally:
        steps.remove()


class Fp16Run:
    """The script auditor hearing a ZeRO-2 optimizer of two param groups (sizes 3 and 2)."""

    def __init__(self, scale: float | None):
        from nanaudit.script.auditor import ScriptAuditor
        self.auditor = ScriptAuditor()
        self.zero = Zero12([3, 2], scale=scale)
        self.steps = ZeroSteps(self.auditor, self.auditor.hooks.tap, lambda: None)
        self.steps.wrap(engine_of(self.zero))

    def step(self, grad: float, loss: float = 1.0) -> None:
        self.auditor.loss(torch.tensor(loss))
        self.zero.backward([[torch.full((3,), grad)], [torch.full((2,), grad)]])
        self.zero.step()


def test_fp16_calibration_skips_are_skipped_steps_and_the_norm_is_unscaled():
    from nanaudit.run.intercept import StepHalted
    run = Fp16Run(scale=2.0 ** 20)
    try:
        for _ in range(3):             # scaled gradients overflow: DeepSpeed backs off
            run.step(math.inf)
        # Steps, skipped (DeepSpeed's global_steps counts them), not findings.
        assert (run.auditor.step, run.auditor.skipped, run.auditor.trip) == (3, 3, None)
        assert [e.skipped for e in run.auditor.timeline] == [True] * 3
        assert run.zero.loss_scale == 2.0 ** 17
        run.step(2.0 ** 17 * 2.0)      # a finite scaled gradient: each element 2 unscaled
        assert run.auditor.step == 4 and run.auditor.trip is None
        entry = run.auditor.timeline[3]
        assert entry.step == 3 and entry.grad_norm == pytest.approx(2.0 * math.sqrt(5))
        run.step(math.inf, loss=math.nan)     # the forward made it: a finding, at the entry
    except StepHalted:
        trip = run.auditor.trip
        assert (trip.step, trip.check.value) == (4, "loss")
        assert run.auditor.skipped == 3
    else:
        pytest.fail("a non-finite loss under fp16 was no finding")
    finally:
        run.steps.remove()


def test_fp16_skips_that_never_stop_collapse_into_a_finding():
    from nanaudit.run.intercept import StepHalted
    run = Fp16Run(scale=2.0 ** 16)
    try:
        with pytest.raises(StepHalted):
            for _ in range(30):        # a backward that overflows whatever the scale
                run.step(math.inf)
        trip = run.auditor.trip
        assert trip.check.value == "gradient" and trip.step == 9     # the tenth skip
        assert trip.collapsed.startswith("DeepSpeed skipped 10 steps in a row")
        assert run.auditor.skipped == 10 and run.zero.loss_scale == 2.0 ** 6
    finally:
        run.steps.remove()


def test_a_skip_under_a_static_scale_or_fp32_is_a_finding_at_the_step_entry():
    from nanaudit.run.intercept import StepHalted
    run = Fp16Run(scale=None)
    try:
        run.step(1.0)
        with pytest.raises(StepHalted):
            run.step(math.nan)
        assert (run.auditor.trip.step, run.auditor.trip.check.value) == (1, "gradient")
        assert [f.tolist() for f in run.zero.single_partition_of_fp32_groups] == [
            [pytest.approx(0.9)] * 3, [pytest.approx(0.9)] * 2]   # stopped before the update
    finally:
        run.steps.remove()


def test_a_skip_of_finite_gradients_is_a_skipped_step_with_a_warning():
    # DeepSpeedExamples' cifar10_deepspeed.py --dtype fp32 --stage 2, one image of 1e38
    # pixels: every gradient finite (norm 7.8e36), DeepSpeed's float32 sum overflows and it
    # skips the step ("OVERFLOW! Skipping step"); the run was said clean, the step applied.
    run = Fp16Run(scale=None)
    try:
        run.step(1.0)
        run.step(3e38)            # each finite; their float32 sum is not
        run.step(1.0)
        assert (run.auditor.step, run.auditor.trip) == (3, None)
        assert [e.skipped for e in run.auditor.timeline] == [False, True, False]
        # (and the fake's lr of 0.1 on weights of 1: an update ratio of 0.1, at step 0)
        ratio, warning = run.auditor.early_warnings()
        assert (ratio.kind, warning.kind, warning.step) == ("update-ratio", "near-overflow", 1)
        assert warning.message.startswith("DeepSpeed skipped the update of step 1: its "
                                          "overflow check")
        assert warning.value == pytest.approx(3e38 * math.sqrt(5))
        assert [f.tolist() for f in run.zero.single_partition_of_fp32_groups] == [
            [pytest.approx(0.8)] * 3, [pytest.approx(0.8)] * 2]    # two updates of 0.1 each
    finally:
        run.steps.remove()
