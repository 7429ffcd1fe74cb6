"""One rank row: the layout every front end adds to the step's exchange under torchrun, and the
table's verdict by the one per-rank rule (the loop's confirmed readings, FSDP shards, TP
partials, buffers, a rank out of data)."""

import math

import torch

from nanaudit.report.vocabulary import Check
from nanaudit.run.check.rank_row import WIDTH, Column, RankTable, rank_row, readout_values
from nanaudit.run.check.verdict import Tripped
from nanaudit.run.checks import StepChecks

NAN = float("nan")


def _row(**set_columns: float) -> list[float]:
    row = [0.0] * WIDTH
    for name, value in set_columns.items():
        row[Column[name.upper()]] = value
    return row


def _table(*rows: list[float]) -> RankTable:
    return RankTable.from_read([v for row in rows for v in row], len(rows))


def _values(inputs_ok=1.0, weights=1.0, loss=0.5, grads=1.0, buffers=0.0) -> torch.Tensor:
    return torch.tensor([inputs_ok, weights, loss, grads, buffers], dtype=torch.float64)


def test_a_row_flags_each_non_finite_value_in_its_column():
    zero = torch.zeros((), dtype=torch.float64)
    assert rank_row(_values(), zero).tolist() == [0.0] * WIDTH
    row = rank_row(_values(inputs_ok=0.0, weights=NAN, loss=math.inf, grads=NAN, buffers=NAN),
                   zero + 1, partials=zero + 3, exhausted=True)
    assert row.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]
    assert row.tolist() == _row(input=1, weights=1, loss=1, gradients=1, buffers=1,
                                own_gradients=1, partials=3, exhausted=1)
    assert rank_row(_values(loss=NAN), zero).tolist() == _row(loss=1.0)
    assert rank_row(_values(), zero, zero + 2).tolist() == _row(partials=2.0)


def test_the_loops_readout_fills_the_same_row():
    model = torch.nn.Linear(3, 2)
    checks = StepChecks(model, "cpu")
    batch = torch.tensor([[1.0, NAN, 2.0]])
    loss = model(torch.ones(1, 3)).sum()
    loss.backward()
    readout = checks.step_readout(loss, [batch])
    row = rank_row(readout_values(readout, loss, [batch]), torch.zeros((), dtype=torch.float64))
    assert row.tolist() == _row(input=1.0)
    assert RankTable.size(3) == 3 * WIDTH


def test_a_large_finite_batch_is_not_flagged_on_a_rank():
    # 1e20 squared is past float32's largest value: the readout's batch norm is inf, yet every
    # element is finite. A rank's flag is final (no later element-wise confirmation), so the
    # row must not take it from that norm.
    model = torch.nn.Linear(3, 2)
    checks = StepChecks(model, "cpu")
    batch = torch.full((2, 3), 1e20)
    loss = model(torch.ones(1, 3)).sum()
    loss.backward()
    readout = checks.step_readout(loss, [batch])
    assert not math.isfinite(readout.read(readout.values.tolist())[0])
    row = rank_row(readout_values(readout, loss, [batch, torch.tensor([1, 2])]),
                   torch.zeros((), dtype=torch.float64))
    assert row.tolist() == _row()


def test_the_first_rank_whose_own_value_went_bad_is_named():
    table = _table(_row(), _row(loss=1.0, gradients=1.0), _row(loss=1.0))
    assert table.verdict(7, updated_at=None, sharded=False) == Tripped(Check.LOSS, 7, part=1)
    own = _table(_row(gradients=1.0), _row(own_gradients=1.0, gradients=1.0))
    assert own.verdict(7, updated_at=None, sharded=False) == Tripped(Check.GRADIENT, 7, part=1)
    # Bad only once reduced: no one rank's.
    reduced = _table(_row(gradients=1.0), _row(gradients=1.0))
    assert reduced.verdict(7, updated_at=None, sharded=False) == Tripped(Check.GRADIENT, 7)
    buffers = _table(_row(), _row(buffers=1.0, loss=1.0))
    assert buffers.verdict(7, updated_at=None, sharded=False) == Tripped(
        Check.PARAMETER, 7, part=1, in_forward=True)
    assert _table(_row(), _row()).verdict(7, updated_at=None, sharded=False) is None


def test_shared_weights_name_no_rank_and_shards_name_theirs():
    table = _table(_row(), _row(weights=1.0))
    assert table.verdict(7, updated_at=6, sharded=False) == Tripped(Check.OPTIMIZER, 6)
    assert table.verdict(7, updated_at=6, sharded=True) == Tripped(Check.OPTIMIZER, 6, part=1)
    assert table.verdict(7, updated_at=None, sharded=True) == Tripped(Check.PARAMETER, 7, 1)


def test_the_loops_confirmed_reading_decides_for_what_every_rank_shares():
    # The fused norm overflowed while every element is finite: the loop's confirmed reading wins.
    table = _table(_row(weights=1.0, gradients=1.0), _row(weights=1.0, gradients=1.0))
    assert table.verdict(3, updated_at=None, sharded=False, weights_finite=True,
                         reduced_finite=True) is None
    # Shards are each rank's own: no one rank's reading stands for them.
    assert table.verdict(3, updated_at=None, sharded=True, weights_finite=True,
                         reduced_finite=True) == Tripped(Check.PARAMETER, 3, part=0)


def test_a_tp_peer_that_received_a_bad_partial_is_not_named():
    # Rank 0's partial went bad first (earliness 2); rank 1 got it through the all-reduce.
    table = _table(_row(loss=1.0, partials=2.0), _row(loss=1.0, partials=1.0))
    assert table.verdict(2, updated_at=None, sharded=True) == Tripped(Check.LOSS, 2, part=0)
    table = _table(_row(loss=1.0, partials=1.0), _row(loss=1.0, partials=2.0))
    assert table.verdict(2, updated_at=None, sharded=True) == Tripped(Check.LOSS, 2, part=1)


def test_a_rank_out_of_data_stops_every_rank():
    assert _table(_row(), _row(exhausted=1.0)).exhausted()
    assert not _table(_row(), _row()).exhausted()
    assert _table(_row(), _row(exhausted=1.0)).verdict(1, updated_at=None,
                                                        sharded=False) is None
