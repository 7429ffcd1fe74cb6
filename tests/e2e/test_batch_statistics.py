"""Models whose layers constrain the batch: a NaN made before a BatchNorm is found at the op
that made it, and the sample search feeds BatchNorm in train mode and fixed-size models only
batches they can take, saying how it padded them."""

from helpers import ROOT, scan

FIXED_SIZE = """
import torch
from torch import nn


class FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.log(x).view(8, -1)          # the model assumes 8 rows
        return self.proj(h)


def build_model():
    torch.manual_seed(0)
    return FixedBatch()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.rand(8, 5, generator=g) + 0.1
        if step == 1:
            x[6, 2] = 0.0
        yield x


def loss(model, batch):
    return model(batch).square().mean()
"""


def test_nan_before_batchnorm_is_the_log_in_the_forward_not_the_running_stats(tmp_path):
    result = scan(ROOT / "configs" / "examples" / "batchnorm_log_silence.yaml",
                  tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["module"], f["cause"], f["samples"]) == (
        2, "forward", "aten.log.default", "", "log-domain", [5])
    assert f["tensor"] == "loss" and "running_mean" not in f["tensors"]
    assert f["source"]["code"].startswith("features = torch.log(energy)")
    assert [link["op"] for link in f["chain"]][:2] == ["aten.log.default",
                                                       "aten.native_batch_norm.default"]
    note = f["sample_search"]["note"]
    assert "padded to 2 rows (BatchNorm in train mode (norm) needs more than one" in note
    assert "rows known to be good" in note
    assert not f["sample_search"]["coupled"]


def test_a_model_that_fixes_its_batch_size_is_fed_full_batches(case, tmp_path):
    config = case(FIXED_SIZE, optimizer={"class": "torch.optim.SGD", "lr": 0.01})
    result = scan(config, tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["cause"], f["samples"]) == (
        1, "forward", "aten.log.default", "log-domain", [6])
    note = f["sample_search"]["note"]
    assert "the model takes only its batch size" in note and "padded to 8 rows" in note
