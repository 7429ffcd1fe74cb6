"""localize/replay_finding.py: what a traced replay reads off the creating op's output. A
sharded DTensor output (a tensor-parallel layer's own op) names its first bad element by its
index in this rank's shard and in the whole tensor, and its bad rows by their index in the
whole batch, read through the shard (a reduction on the DTensor itself has no sharding strategy
for every op: `nonzero` has none). One process on a fake process group (helpers.on_fake_mesh)."""

import torch
from helpers import on_fake_mesh

from nanaudit.localize.replay_finding import created_element, created_rows
from nanaudit.localize.tracer import OpTracer
from nanaudit.report.sections import ShardElement


def _traced(*ops):
    """The events of `ops` (callables) run under the tracer, in order."""
    with OpTracer(torch.nn.Module()) as tracer:
        for op in ops:
            op()
    return tracer, tracer.trace.events


def test_an_op_output_that_is_a_sharded_dtensor_names_its_global_element():
    # a column-wise layer's own matmul leaves its output Shard(1) over tp: tp rank 1's local
    # column 5 is the whole tensor's column 13
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def check(mesh):
        x = distribute_tensor(torch.full((4, 4), 0.5), mesh, [Replicate(), Replicate()],
                              src_data_rank=None)
        x._local_tensor[2] = 1.0            # row 2 alone overflows: 4 x 1e38 > float32's max
        weight = distribute_tensor(torch.ones(4, 16), mesh, [Replicate(), Shard(1)],
                                   src_data_rank=None)
        weight._local_tensor[:, 5] = 1e38
        plain = torch.full((4, 8), float("nan"))                # a local tensor: no element
        tracer, (local, sharded) = _traced(lambda: plain * 2, lambda: torch.mm(x, weight))
        assert created_element(tracer, local) is None
        assert created_element(tracer, sharded) == ShardElement(
            "aten.mm.default output", [2, 5], [2, 13])
        assert created_rows(tracer, sharded, 4) == [2]
    on_fake_mesh(3, check)


def test_the_rows_of_an_output_sharded_over_the_batch_are_the_whole_batch_rows():
    # a batch sharded by rows over tp (8 rows, tp rank 1 holds rows 4-7): the shard's bad row 1
    # is the batch's row 5
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def check(mesh):
        rows = distribute_tensor(torch.ones(8, 4), mesh, [Replicate(), Shard(0)],
                                 src_data_rank=None)
        rows._local_tensor[1, 2] = float("inf")
        weight = distribute_tensor(torch.ones(4, 3), mesh, [Replicate(), Replicate()],
                                   src_data_rank=None)
        tracer, (event,) = _traced(lambda: torch.mm(rows, weight))
        assert created_rows(tracer, event, 8) == [5]
        assert created_rows(tracer, event, 4) is None          # not the batch's rows
        assert created_element(tracer, event) == ShardElement(
            "aten.mm.default output", [1, 0], [5, 0])
    on_fake_mesh(3, check)
