"""DeepSpeed ZeRO-3's flat fp32 groups as `nanaudit run`'s step check reads them, without
DeepSpeed: each group is every parameter's partition end to end, each padded to an equal size
with memory never written. The read takes the valid parts of the weights and the same parts of
the group's gradient; the parts are views, which have no `.grad` of their own, so the gradient
norm read 0 while DeepSpeed skipped the step for a NaN gradient. ZeRO-1/2's flat groups, one per
param group, are zero-padded (valid whole), and their gradients are read where DeepSpeed keeps
them until its step: each group's reduced slices."""

from types import SimpleNamespace

import torch

from nanaudit.run.deepspeed_zero import note_zero
from nanaudit.script.readout import OptimizerScopes


def zero3_optimizer(flat: torch.Tensor) -> torch.optim.Optimizer:
    """A torch optimizer over `flat`, known as a ZeRO-3 group of two partitions of 4 elements,
    the first padded by 1 and the second by 3 (valid: elements 0-2 and 4)."""
    optimizer = torch.optim.SGD([flat], lr=0.1)
    zero = SimpleNamespace(optimizer=optimizer, fp32_partitioned_groups_flat=[flat],
                           groups_padding=[[1, 3]],
                           fp16_partitioned_groups=[[torch.empty(4), torch.empty(4)]])
    note_zero(SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: 3))
    return optimizer


def test_zero3_gradients_are_read_from_the_valid_parts_of_the_group_gradient():
    flat = torch.nn.Parameter(torch.zeros(8))
    optimizer = zero3_optimizer(flat)
    flat.grad = torch.tensor([1.0, 2.0, 2.0, float("nan"), 4.0, float("nan"), 0.0, 7.0])
    scope = OptimizerScopes().of(optimizer)
    assert [t.tolist() for t in scope.params] == [[0.0, 0.0, 0.0], [0.0]]
    assert [g.tolist() for g in scope.grads()] == [[1.0, 2.0, 2.0], [4.0]]   # padding skipped
    flat.grad = torch.full((8,), 3.0)       # DeepSpeed gives each sub-group step a new grad
    flat.grad[4] = float("inf")
    assert [g.tolist() for g in scope.grads()] == [[3.0, 3.0, 3.0], [float("inf")]]
    _, grad_norms, _ = scope.norm_parts(scope.grads(), [])
    assert not torch.isfinite(torch.stack(grad_norms)).all()
    flat.grad = None
    assert scope.grads() == []


def test_any_other_optimizer_reads_its_parameters_gradients_whole():
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.tensor([1.0, float("nan"), 0.0])
    scope = OptimizerScopes().of(torch.optim.SGD([weight], lr=0.1))
    assert scope.params == [weight] and len(scope.grads()) == 1
    assert scope.grads()[0] is weight.grad


def test_zero3_sub_groups_are_read_together_before_deepspeed_fills_their_gradients():
    # DeepSpeed's ZeRO-3 step gives its torch optimizer one sub-group's flat at a time (its
    # groups are empty outside the step) and sets a flat's `.grad` only for its turn: at the
    # step's entry the reduced gradients are the partitions its backward's epilogue kept
    # (`averaged_gradients`, by sub-group), each padded like its weights.
    flats = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.full((4,), 2.0))]
    optimizer = torch.optim.SGD(flats, lr=0.1)
    for group in optimizer.param_groups:
        group["params"] = []
    grads = {0: [torch.tensor([1.0, float("nan")]), torch.tensor([3.0, 4.0])],
             1: [torch.tensor([5.0, 6.0, 7.0, float("nan")])]}
    zero = SimpleNamespace(optimizer=optimizer, fp32_partitioned_groups_flat=flats,
                           groups_padding=[[1, 0], [1]], averaged_gradients=grads,
                           fp16_partitioned_groups=[[torch.empty(2), torch.empty(2)],
                                                    [torch.empty(4)]])
    note_zero(SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: 3))
    scope = OptimizerScopes().of(optimizer)
    assert [t.tolist() for t in scope.params] == [[1.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
    assert [g.tolist() for g in scope.grads()] == [[1.0], [3.0, 4.0], [5.0, 6.0, 7.0]]
    flats[1].grad = torch.tensor([0.0, 0.0, 0.0, 9.0])     # the sub-group's turn (or offload)
    assert [g.tolist() for g in scope.grads()][-1] == [0.0, 0.0, 0.0]


class CompactGroup(list):
    """DeepSpeed's compact gradient buffer group (stage_1_and_2.GradPartitionBufferGroup): the
    slices of one flat buffer, its zero padding marked `_zero_padding`."""

    def __init__(self, flat: torch.Tensor, sizes: list[int], padding: int):
        views, offset = [], 0
        for size in sizes:
            views.append(flat.narrow(0, offset, size))
            offset += size
        pad = flat.narrow(0, offset, padding)
        pad._zero_padding = True
        super().__init__([*views, pad])
        self.flat_partition = flat


def test_zero12_param_groups_are_read_together_from_their_reduced_gradients():
    # ZeRO-1/2's step hands the torch optimizer one param group at a time and sets a flat's
    # `.grad` only for its turn: at the step's entry every group's flat is read, with the
    # gradient slices the backward's epilogue reduced into `averaged_gradients` (a list, or
    # the compact buffer group, whose padding is no gradient; None: a group not set).
    flats = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.full((3,), 2.0)),
             torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": [flat]} for flat in flats], lr=0.1)
    compact = CompactGroup(torch.tensor([5.0, float("inf"), 0.0]), [2], padding=1)
    grads = {0: [torch.ones(2, 2), torch.tensor([3.0])], 1: compact, 2: None}
    zero = SimpleNamespace(optimizer=optimizer, single_partition_of_fp32_groups=flats,
                           averaged_gradients=grads)
    note_zero(SimpleNamespace(optimizer=zero, zero_optimization_stage=lambda: 2))
    scope = OptimizerScopes().of(optimizer)
    assert scope.params == flats
    assert [g.tolist() for g in scope.grads()] == [[[1.0, 1.0], [1.0, 1.0]], [3.0],
                                                   [5.0, float("inf")]]
    _, grad_norms, _ = scope.norm_parts(scope.grads(), [])
    assert not torch.isfinite(torch.stack(grad_norms)).all()
    flats[2].grad = torch.tensor([4.0, 4.0])     # offloaded: the flat's own gradient
    assert [g.tolist() for g in scope.grads()][-1] == [4.0, 4.0]
    optimizer.param_groups = [optimizer.param_groups[1]]    # inside the step: one group
    assert OptimizerScopes().of(optimizer).params == flats
