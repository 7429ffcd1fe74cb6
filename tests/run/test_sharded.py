"""FSDP2 as the checks see it, in one process (world of 1): local shards, the shard a rank
holds, the reduce-scatter flag, and HSDP's reduce-scatter flagged like FSDP's (issue 37)."""

import pytest
import torch
from torch import nn

from nanaudit.run.sharded import (
    PreReduceFlags,
    describe_shard,
    fsdp_modules,
    fsdp_param_groups,
    local_shards,
)


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_plain_tensors_are_their_own_shards():
    t = torch.ones(3)
    assert local_shards([t])[0] is t and describe_shard(t, 0) == ""


def test_a_sharded_model_is_read_by_its_local_shards(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    weight = model[0].weight
    assert type(local_shards([weight])[0]) is torch.Tensor
    assert describe_shard(weight, 0) == "rank 0's shard (rows 0-2 of 3)"
    flags = PreReduceFlags()
    flags.install(fsdp_modules(model))
    flags.note(torch.tensor([1.0, float("nan")]))
    assert float(flags.take(torch.device("cpu"))) == 1.0
    assert float(flags.take(torch.device("cpu"))) == 0.0     # taken: reset


def test_hsdp_reduce_scatter_is_flagged_not_refused(world_of_one):
    # A 2-D (replicate x shard) mesh: the reduce-scatter over dp_shard runs first, so its input
    # is still this rank's own gradients.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = nn.Linear(4, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "shard")))
    flags = PreReduceFlags()
    flags.install(fsdp_modules(model))
    groups = fsdp_param_groups(model._get_fsdp_state())      # torch 2.11's and 2.13's layouts
    assert type(groups[0]._reduce_scatter_comm).__name__ == "FlaggingReduceScatter"
    # the e2e tests (tests/e2e/test_mesh.py) see it flag a rank's own gradients on 4 ranks
