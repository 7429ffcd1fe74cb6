"""Sample isolation: which rows of a batch reproduce the finding alone, in O(k log B) replays."""

import math

import torch
from helpers import scan

from nanaudit.localize.samples import isolate_rows
from nanaudit.run.batch import infer_layout, select_rows


def _oracle(bad, need_all=False):
    calls = []

    def reproduces(rows):
        calls.append(rows)
        hit = set(rows) & set(bad)
        return hit == set(bad) if need_all else bool(hit)
    return reproduces, calls


def test_single_bad_row_in_log_replays():
    reproduces, _ = _oracle({37})
    search = isolate_rows(reproduces, 64)
    assert search.samples == [37] and not search.coupled
    assert search.replays <= 2 * math.ceil(math.log2(64))


def test_several_independent_rows_all_found():
    reproduces, _ = _oracle({3, 40, 41})
    search = isolate_rows(reproduces, 64)
    assert search.samples == [3, 40, 41]
    assert search.replays <= 3 * 2 * math.ceil(math.log2(64))


def test_interacting_rows_found_together():
    reproduces, _ = _oracle({5, 50}, need_all=True)   # only both together reproduce
    search = isolate_rows(reproduces, 64)
    assert search.samples == [5, 50] and search.coupled
    assert search.replays < 64


def test_coupled_batch_reports_no_samples():
    reproduces, _ = _oracle(set(range(0, 32, 2)), need_all=True)
    search = isolate_rows(reproduces, 32)
    assert search.samples is None and search.coupled
    assert "coupled" in search.note


def test_every_row_failing_is_batch_level():
    search = isolate_rows(lambda rows: True, 16)
    assert search.samples is None and "not in particular samples" in search.note


def test_budget_is_respected():
    reproduces, _ = _oracle(set(range(40)))
    search = isolate_rows(reproduces, 64, max_replays=5)
    assert search.samples is None and search.replays == 5


def test_time_major_layout_is_inferred_and_sliced():
    batch = {"feats": torch.randn(10, 4, 8), "targets": torch.randint(1, 5, (4, 12)),
             "input_lengths": torch.full((4,), 10), "scale": torch.tensor(2.0)}
    layout = infer_layout(batch)
    assert layout.size == 4
    assert layout.dims == {'["feats"]': 1, '["targets"]': 0, '["input_lengths"]': 0,
                           '["scale"]': None}
    sub = select_rows(batch, layout, [2])
    assert sub["feats"].shape == (10, 1, 8) and sub["targets"].shape == (1, 12)
    assert sub["scale"].shape == ()
    assert torch.equal(sub["feats"][:, 0], batch["feats"][:, 2])


def test_config_batch_dim_overrides_inference():
    batch = (torch.randn(4, 4, 3), torch.randn(4))
    layout = infer_layout(batch, {"[0]": 1})
    assert layout.dims["[0]"] == 1 and layout.size == 4


def test_bad_row_values_shown_in_report(tmp_path):
    from helpers import ROOT
    result = scan(ROOT / "configs" / "demo.yaml", tmp_path=tmp_path)
    rows = result.finding["sample_rows"]
    assert rows[0]["index"] == 5
    leaves = dict(rows[0]["leaves"])
    assert leaves['batch["x"]']["value"] == [0.0] * 8
    assert leaves['batch["x"]']["zeros"] == 8


def test_every_row_bad_is_called_batch_level_in_a_few_replays():
    from nanaudit.localize.samples import isolate_rows
    result = isolate_rows(lambda rows: bool(rows), 256)
    assert result.samples is None and result.replays <= 5
    assert "model or the batch as a whole" in result.note
