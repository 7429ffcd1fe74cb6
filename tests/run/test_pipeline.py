"""Pipeline parallelism is refused by name (run/pipeline.py): a module called by a
`torch.distributed.pipelining` schedule is a usage error; the same module called by the
user's own loop is not. In one process (a world of one, a one-stage pipeline)."""

import pytest
import torch
from torch import nn

from nanaudit.errors import UsageError
from nanaudit.exitcodes import ExitCode
from nanaudit.run.pipeline import refuse_pipeline_stage


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def refusing(module: nn.Module):
    return module.register_forward_pre_hook(lambda m, args: refuse_pipeline_stage(m))


def test_a_module_a_pipeline_schedule_calls_is_refused_naming_the_stage(world_of_one):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.mean())
    handle = refusing(model)
    try:
        with pytest.raises(UsageError) as caught:
            schedule.step(torch.ones(2, 4), target=torch.ones(2, 4), losses=[])
    finally:
        handle.remove()
    assert caught.value.exit_code == ExitCode.USAGE
    message = str(caught.value)
    assert "`Sequential` runs as a stage of a pipeline" in message
    assert "`PipelineStage` from torch.distributed.pipelining" in message
    assert "does not audit pipeline parallelism" in message


def test_the_same_module_in_a_plain_loop_is_audited(world_of_one):
    import torch.distributed.pipelining  # imported, but not what calls the model
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = refusing(model)
    try:
        model(torch.ones(2, 4)).mean().backward()
    finally:
        handle.remove()
    assert model[0].weight.grad is not None
