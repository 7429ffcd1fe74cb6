"""run/mesh.py in one process: a rank's named coordinate on a 2-D mesh, and the rule that a bad
loss on a rank whose own partial sums went bad only after a tp peer's did arrived from it."""

import torch
from helpers import on_fake_mesh

from nanaudit.run.mesh import MeshView, PartialFlags, own_losses


def test_coordinates_are_named_by_the_mesh_dimensions_in_row_major_order():
    view = MeshView(("dp", "tp"), (2, 2), (0, 1, 2, 3))
    assert [view.coordinate(r) for r in range(4)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert view.coordinate(7) is None and view.coordinate(None) is None
    assert MeshView(("a", "b", "c"), (2, 1, 2), (0, 1, 2, 3)).coordinate(3) == {
        "a": 1, "b": 0, "c": 1}


def test_the_rank_whose_bad_partial_came_first_made_the_value():
    # ranks 2 and 3 share a tp group: rank 3's first partial went bad, rank 2's second only
    assert own_losses([True, True, False, False], [0.0, 0.0, 1.0, 2.0]) == [
        True, True, True, False]
    # made after the all-reduce (no bad partial): every bad loss is its rank's own
    assert own_losses([True, False, False, True], [0.0, 0.0, 0.0, 0.0]) == [
        True, False, False, True]


def test_partial_flags_say_how_early_the_first_bad_partial_came():
    flags = PartialFlags()
    cpu = torch.device("cpu")
    assert float(flags.take(cpu)) == 0.0
    flags._extremes = [torch.tensor([0.0, 1.0]), torch.tensor([float("nan"), 1.0]),
                       torch.tensor([0.0, float("inf")])]
    assert float(flags.take(cpu)) == 2.0          # the 2nd of 3: 3 - 1
    assert float(flags.take(cpu)) == 0.0          # taken: reset


def test_global_index_of_fsdp_over_tp_follows_the_strided_rows():
    # FSDP2 over TP (torchtitan): a column-wise weight (16, 8) is Shard(0) on tp, then
    # _StridedShard(0) on dp; rank (dp=d, tp=t) holds rows 8t + 4d .. 8t + 4d + 3, not a
    # block starting where the shard's first row is (the DTensor's whole-tensor values say
    # which element each local one is).
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from nanaudit.run.mesh import global_index

    def check(mesh):
        full = torch.arange(16 * 8).reshape(16, 8)
        t = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                              src_data_rank=None)
        local = t._local_tensor
        for index in [(0, 0), (3, 7), (1, 2)]:
            row, col = global_index(t, index)
            assert full[row, col] == local[index]
    for rank in range(4):
        on_fake_mesh(rank, check)


def test_first_bad_element_names_the_local_and_global_index():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from nanaudit.report.sections import ShardElement
    from nanaudit.run.mesh import first_bad_element

    def check(mesh):
        # a row-wise weight (8, 16): Shard(1) on tp; rank 3 (tp=1) holds columns 8-15
        t = distribute_tensor(torch.zeros(8, 16), mesh, [Replicate(), Shard(1)],
                              src_data_rank=None)
        assert first_bad_element("down.weight", t) is None
        t._local_tensor[2, 5] = float("nan")
        assert first_bad_element("down.weight.grad", t) == ShardElement(
            "down.weight.grad", [2, 5], [2, 13])
        assert first_bad_element("plain", torch.full((2,), float("nan"))) is None
    on_fake_mesh(3, check)


def test_the_rank_whose_partial_input_gradient_went_bad_first_made_a_backward_value():
    from nanaudit.run.mesh import own_gradients
    # ranks 2 and 3 (one tp group) both hold bad gradients before the reduction (1.0); rank
    # 3's partial input gradient went bad first (1 + 2), rank 2's never: rank 3 made it
    assert own_gradients([0.0, 0.0, 1.0, 3.0]) == [True, True, True, False]
    # TP alone: no reduction flag at all, the partial gradient alone names the maker
    assert own_gradients([0.0, 2.0]) == [True, False]
    # no bad partial gradient: each set flag is its rank's own
    assert own_gradients([1.0, 0.0, 1.0]) == [False, True, False]


def test_partial_flags_rank_a_bad_partial_gradient_above_the_reductions_flag():
    flags = PartialFlags()
    flag = torch.tensor(1.0, dtype=torch.float64)
    assert float(flags.take_gradients(flag)) == 1.0       # none noted: the flag as it was
    flags._gradients = [torch.tensor([0.0, 1.0]), torch.tensor([float("nan"), 1.0])]
    assert float(flags.take_gradients(flag * 0)) == 2.0   # the 2nd of 2 (2 - 1), plus 1
    assert float(flags.take_gradients(flag * 0)) == 0.0   # taken: reset


def test_scan_and_sentinel_name_the_first_bad_element_of_a_sharded_weight_or_gradient():
    # what rank_finding gives scan's and Sentinel's finding on each rank (run's from its trip)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from nanaudit.report.sections import ShardElement
    from nanaudit.run.mesh import tensor_element

    def check(mesh):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        with torch.no_grad():      # `0` column-wise (rows on tp), `1` row-wise (columns on tp)
            for layer, dim in ((model[0], 0), (model[1], 1)):
                layer.weight = torch.nn.Parameter(distribute_tensor(
                    layer.weight.detach(), mesh, [Replicate(), Shard(dim)], src_data_rank=None))
        for layer in model:
            layer.weight.grad = layer.weight.detach() * 0
        assert tensor_element(model, gradients=True) is None
        assert tensor_element(model, gradients=False) is None
        model[1].weight.grad._local_tensor[3, 2] = float("inf")    # rank 1 holds columns 8-15
        assert tensor_element(model, gradients=True) == ShardElement(
            "1.weight.grad", [3, 2], [3, 10])
        model[1].bias.grad = torch.full((8,), float("nan"))     # not sharded: no element
        model[0].weight._local_tensor[0, 1] = float("nan")      # rows 8-15 on tp rank 1
        assert tensor_element(model, gradients=False) == ShardElement("0.weight", [0, 1], [8, 1])
    on_fake_mesh(1, check)


def test_partial_flags_hook_a_tensor_parallel_layout_and_never_plain_fsdp2():
    # FSDP2 alone makes every parameter a DTensor, but no op of its modules leaves a value
    # `Partial`: the flags' forward hooks and input pre-hooks would run on every module call
    # for nothing. parallelize_module's layers are hooked (and FSDP2 over them as well).
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from nanaudit.run.mesh import tensor_parallel

    def hooks(model):
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    def check(mesh):
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        fully_shard(plain, mesh=mesh["dp"])
        before, flags = hooks(plain), PartialFlags()
        flags.install(plain)
        assert not tensor_parallel(plain) and flags.hooked == {} and hooks(plain) == before
        tp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(tp, mesh=mesh["dp"])
        before = hooks(tp)
        flags.install(tp)
        assert tensor_parallel(tp) and set(flags.hooked) == {id(tp[0]), id(tp[1])}
        assert hooks(tp) == before + 4        # a forward hook and an input pre-hook each
    on_fake_mesh(0, check)
