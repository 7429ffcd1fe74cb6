"""run/mesh.py in one process: a rank's named coordinate on a 2-D mesh, and the rule that a bad
loss on a rank whose own partial sums went bad only after a tp peer's did arrived from it."""

import torch

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
