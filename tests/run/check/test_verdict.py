"""Which check tripped: one decision for the loop, the rank table, Sentinel and the script."""

import pytest

from nanaudit.report.vocabulary import Check
from nanaudit.run.check.verdict import Tripped, tripped_check

FINE = dict(inputs_ok=True, weights_finite=True, updated_at=None, loss_finite=True,
            grads_finite=True)


def _verdict(**flags):
    return tripped_check(5, **{**FINE, **flags})


def test_all_finite_is_no_trip():
    assert _verdict() is None


@pytest.mark.parametrize("flags, expected", [
    # In step order: the batch first, then the weights, the loss, the gradients.
    (dict(inputs_ok=False, weights_finite=False, loss_finite=False, grads_finite=False),
     Tripped(Check.INPUT, 5)),
    (dict(weights_finite=False, loss_finite=False, grads_finite=False),
     Tripped(Check.PARAMETER, 5)),
    (dict(loss_finite=False, grads_finite=False), Tripped(Check.LOSS, 5)),
    (dict(grads_finite=False), Tripped(Check.GRADIENT, 5)),
])
def test_the_first_check_in_step_order_is_named(flags, expected):
    assert _verdict(**flags) == expected


def test_bad_weights_after_an_update_blame_that_update():
    assert _verdict(weights_finite=False, updated_at=4) == Tripped(Check.OPTIMIZER, 4)


def test_per_part_flags_name_the_first_bad_part():
    assert _verdict(inputs_ok=[True, False, False]) == Tripped(Check.INPUT, 5, part=1)
    assert _verdict(loss_finite=[True, True, False]) == Tripped(Check.LOSS, 5, part=2)
    assert _verdict(inputs_ok=[True, True], loss_finite=[True]) is None
    # The weights are every part's: no part is named.
    assert _verdict(inputs_ok=[True, True], weights_finite=False).part is None


def test_a_buffer_the_forward_made_bad_comes_after_the_weights_and_before_the_loss():
    assert _verdict(buffers_finite=False, loss_finite=False) == Tripped(
        Check.PARAMETER, 5, in_forward=True)
    assert _verdict(buffers_finite=False, weights_finite=False) == Tripped(Check.PARAMETER, 5)
    assert _verdict(buffers_finite=[True, False]) == Tripped(Check.PARAMETER, 5, 1,
                                                             in_forward=True)


def test_the_rank_rule_names_the_rank_whose_own_gradients_went_bad():
    from nanaudit.run.check.verdict import rank_verdict
    common = dict(inputs_ok=[True, True], weights_finite=True, updated_at=None,
                  loss_finite=[True, True])
    own = rank_verdict(4, own_grads_ok=[True, False], reduced_ok=False, **common)
    assert own == Tripped(Check.GRADIENT, 4, part=1)
    # Bad only once averaged (every rank's own finite): no rank is named.
    reduced = rank_verdict(4, own_grads_ok=[True, True], reduced_ok=False, **common)
    assert reduced == Tripped(Check.GRADIENT, 4, part=None)
    # A rank's buffer comes before its loss and gradients, and names that rank.
    buffer = rank_verdict(4, own_grads_ok=[True, False], reduced_ok=False,
                          buffers_finite=[False, True], **common)
    assert buffer == Tripped(Check.PARAMETER, 4, part=0, in_forward=True)
    assert rank_verdict(4, own_grads_ok=[True, True], reduced_ok=True, **common) is None
