"""The sample search feeds every replay a group the model can take (BatchNorm in train mode,
a fixed batch size), padding with rows that cannot be blamed, and says so; an exception of the
user's code during a replay is the user's error, never a verdict on the rows."""

import pytest
import torch
from torch import nn

from nanaudit.errors import UserCodeError, call_user
from nanaudit.localize.replay import rows_the_model_needs
from nanaudit.localize.samples import isolate_rows


class LogThenBatchNorm(nn.Module):
    """log of a per-row energy (0 for a silent row), then BatchNorm1d in train mode."""

    def __init__(self, fixed_batch: int | None = None):
        super().__init__()
        self.proj = nn.Linear(5, 4, bias=False)
        self.norm = nn.BatchNorm1d(4)
        self.fixed_batch = fixed_batch

    def forward(self, x):
        if self.fixed_batch is not None:
            x = x.view(self.fixed_batch, -1)     # the model assumes its batch size
        return self.norm(torch.log(self.proj(x) ** 2))


def _batch(bad_rows=(5,), size=8):
    torch.manual_seed(0)
    x = torch.rand(size, 5) + 0.1
    for row in bad_rows:
        x[row] = 0.0
    return x


def _oracle(model, x, fed_sizes, check=None):
    def reproduces(rows):
        fed_sizes.append(len(rows))
        sub = x[torch.tensor(rows)]
        out = call_user("loss `case:loss`", lambda: (check(sub) if check else None,
                                                     model(sub).square().mean())[1])
        return not bool(torch.isfinite(out))
    return reproduces


def test_batchnorm_in_train_mode_is_never_fed_one_row():
    model = LogThenBatchNorm()
    min_rows, why = rows_the_model_needs(model)
    assert min_rows == 2 and "BatchNorm" in why and "norm" in why
    fed = []
    search = isolate_rows(_oracle(model, _batch(), fed), 8, min_rows=min_rows, min_reason=why)
    assert search.samples == [5] and not search.coupled
    assert min(fed) >= 2
    assert "padded to 2 rows (BatchNorm in train mode (norm) needs more than one" in search.note
    assert "rows known to be good" in search.note


def test_padding_does_not_blame_the_padding_rows():
    model = LogThenBatchNorm()
    fed = []
    search = isolate_rows(_oracle(model, _batch((1, 6)), fed), 8, min_rows=2,
                          min_reason="BatchNorm")
    assert search.samples == [1, 6] and min(fed) >= 2


def test_eval_mode_batchnorm_needs_no_padding():
    model = LogThenBatchNorm().eval()
    assert rows_the_model_needs(model) == (1, "")
    fed = []
    search = isolate_rows(_oracle(model, _batch(), fed), 8)
    assert search.samples == [5] and min(fed) == 1 and search.note == ""


def test_a_sub_batch_that_raises_for_its_size_switches_to_the_full_batch_size():
    """Not told about the BatchNorm, the search sees a 1-row replay raise, runs it again at the
    full size, and from then on feeds every replay 8 rows."""
    model = LogThenBatchNorm(fixed_batch=8)
    fed = []
    search = isolate_rows(_oracle(model, _batch(), fed), 8)
    assert search.samples == [5]
    assert fed[0] == 4 and set(fed[1:]) == {8}       # one failed half, then always full size
    assert "the model takes only its batch size" in search.note
    assert "RuntimeError" in search.note


def test_an_exception_that_is_not_the_size_is_the_users_error():
    """A loss that asserts a positive label in every batch: a half without one raises at its
    own size and again at the full size: the user's error, naming the rows replayed."""
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 0, 1])
    x = _batch()
    x = torch.cat([x, labels[:, None].float()], 1)

    def check(sub):
        assert sub[:, -1].sum() > 0, "a batch without positives"

    fed = []

    def reproduces(rows):
        fed.append(len(rows))
        sub = x[torch.tensor(rows)]
        out = call_user("loss `case:loss`", lambda: (check(sub), torch.log(sub[:, 0]).sum())[1])
        return not bool(torch.isfinite(out))

    with pytest.raises(UserCodeError) as raised:
        isolate_rows(reproduces, 8)
    error = raised.value
    assert isinstance(error.exception, AssertionError)
    assert ("replaying batch rows [0, 1, 2, 3] (fed as [0, 1, 2, 3, 0, 1, 2, 3], 8 rows) for "
            "the sample search") in str(error)
    assert any(f.name == "check" for f in error.frames)
    assert fed == [4, 8]


class BatchWideNorm(nn.Module):
    """Norm layers whose shape includes the batch: LayerNorm over (rows, features), GroupNorm
    over the batch folded into channels; both take only the batch size they were built for."""

    def __init__(self, kind: str, rows: int = 8):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm((rows, 5)) if kind == "layer" else nn.GroupNorm(2, rows * 5)

    def forward(self, x):
        h = torch.log(x)
        if self.kind == "layer":
            return self.norm(h)
        return self.norm(h.reshape(1, -1, 1)).reshape(x.shape)


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_norms_over_the_whole_batch_are_fed_their_batch_size(kind):
    model = BatchWideNorm(kind)
    assert rows_the_model_needs(model) == (1, "")
    fed = []
    search = isolate_rows(_oracle(model, _batch((2,)), fed), 8)
    assert search.samples == [2]
    assert set(fed[1:]) == {8} and "the model takes only its batch size" in search.note
