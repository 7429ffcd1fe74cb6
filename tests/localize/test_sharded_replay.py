"""localize/sharded_replay.py in one process (a fake process group, helpers.on_fake_mesh): the
element of a sharded tensor a rank's finding names is read from the tensors its trip names
only: a loss trip reads no gradient (what a parameter holds then is the last step's)."""

import torch
from helpers import on_fake_mesh

from nanaudit.localize.sharded_replay import trip_element
from nanaudit.report.sections import ShardElement
from nanaudit.report.vocabulary import Check


def test_only_the_trip_s_own_tensors_name_an_element():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def check(mesh):
        model = torch.nn.Linear(16, 4, bias=False)
        model.weight = torch.nn.Parameter(distribute_tensor(   # columns 8-15 on tp rank 1
            model.weight.detach(), mesh, [Replicate(), Shard(1)], src_data_rank=None))
        model.weight.grad = model.weight.detach() * 0
        model.weight.grad._local_tensor[1, 2] = float("nan")   # a skipped step's, left over
        for check in (Check.LOSS, Check.INPUT, Check.SCHEDULE):
            assert trip_element(model, check) is None
        assert trip_element(model, Check.GRADIENT) == ShardElement("weight.grad", [1, 2],
                                                                   [1, 10])
        assert trip_element(model, Check.PARAMETER) is None    # the weights are finite
        model.weight._local_tensor[3, 0] = float("inf")
        assert trip_element(model, Check.OPTIMIZER) == ShardElement("weight", [3, 0], [3, 8])
    on_fake_mesh(1, check)
