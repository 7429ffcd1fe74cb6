"""The localizer: producer not propagator, deliberate infinities, negative controls, replay."""

import textwrap

import pytest

from conftest import scan

HEADER = """
import math
import torch
from torch import nn
import torch.nn.functional as F

def batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        yield torch.randn(4, 8, generator=g)
"""

NEGATIVE_CONTROLS = {
    "normalize_zero_row": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
            def forward(self, x):
                h = self.lin(x) * torch.tensor([0., 1., 1., 1.]).unsqueeze(1)
                return F.normalize(h, dim=1)
        """,
    "cdist_self": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 3)
            def forward(self, x):
                h = self.lin(x)
                return torch.cdist(h, h)
        """,
    "atan2_origin": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Parameter(torch.zeros(4, 8))
            def forward(self, x):
                return torch.atan2(self.a, self.a * 0) + x
        """,
    "sdpa_fully_masked_row": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
            def forward(self, x):
                q = self.q(x).view(1, 1, 4, 8)
                mask = torch.ones(4, 4, dtype=torch.bool)
                mask[2] = False
                return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).view(4, 8)
        """,
    "masked_fill_attention": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
            def forward(self, x):
                q = self.q(x)
                scores = q @ q.T
                causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
                scores = scores.masked_fill(causal, float("-inf"))
                return torch.softmax(scores, dim=-1) @ q
        """,
    "ctc_reachable": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 5)
            def forward(self, x):
                lp = self.lin(x).log_softmax(-1).unsqueeze(1).expand(4, 2, 5)
                targets = torch.tensor([[1, 2], [3, 3]])
                loss = F.ctc_loss(lp, targets, torch.tensor([4, 4]), torch.tensor([2, 2]))
                return loss.expand(4, 8)
        """,
}


def _case(case, body, loss="out.square().mean()", lr=0.01, **config):
    code = HEADER + textwrap.dedent(body) + textwrap.dedent(f"""
        def build_model():
            torch.manual_seed(0)
            return M()

        def loss(model, batch):
            out = model(batch)
            return {loss}
        """)
    return case(code, optimizer={"class": "torch.optim.SGD", "lr": lr}, **config)


@pytest.mark.parametrize("name", sorted(NEGATIVE_CONTROLS))
def test_negative_controls_scan_clean(case, tmp_path, name):
    result = scan(_case(case, NEGATIVE_CONTROLS[name]), tmp_path=tmp_path)
    assert result.code == 0, result.report["finding"]
    assert result.report["status"] == "clean"


def test_all_masked_attention_row_blames_softmax_not_masked_fill(case, tmp_path):
    body = """
        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
            def forward(self, x, pad):
                q = self.q(x)
                scores = (q @ q.T).masked_fill(pad, float("-inf"))
                return torch.softmax(scores, dim=-1) @ q

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = Attention()
            def forward(self, x):
                pad = torch.zeros(4, 4, dtype=torch.bool)
                pad[1] = True                      # a fully padded query row
                return self.attn(x, pad)
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["where"], f["op"], f["cause"], f["module"]) == (
        "forward", "aten._softmax.default", "softmax-all-masked", "attn")
    assert "torch.softmax" in f["source"]["code"]
    assert f["chain"][0]["op"] == "aten._softmax.default"


def test_loss_nan_with_clean_gradients_is_found(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 3)
            def forward(self, x):
                return self.lin(x)
        """
    loss = "F.cross_entropy(out, torch.full((4,), -100))"
    result = scan(_case(case, body, loss=loss), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1 and result.report["timeline"][0]["grad_norm"] != "nan"
    assert (f["step"], f["where"], f["op"], f["cause"]) == (
        0, "forward", "aten.nll_loss_forward.default", "degenerate-reduction")
    assert "ignore_index=-100" in f["explanation"]


def test_masked_gradient_names_the_forward_line(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(8))
            def forward(self, x):
                safe = torch.where(x > 0, torch.log(x.clamp(min=0) * self.w), torch.zeros_like(x))
                return safe
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert (f["where"], f["cause"], f["forward_op"]) == (
        "backward", "masked-nonfinite-gradient", "aten.log.default")
    assert "torch.where" in f["source"]["code"] and "log" in f["explanation"]
    assert result.report["timeline"][0]["loss"] != "nan"


def test_optimizer_update_attributed_to_parameter(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 2)
            def forward(self, x):
                return self.lin(x)
        """
    # An infinite lr from the user's optimizer factory (a config `lr: .inf` is refused up front).
    body += """
        def make_optimizer(model):
            return torch.optim.SGD(model.parameters(), lr=float("inf"))
        """
    path = _case(case, body)
    path.write_text(path.read_text().replace("class: torch.optim.SGD\n  lr: 0.01",
                                             "entrypoint: case:make_optimizer"))
    result = scan(path, tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["step"], f["where"], f["cause"]) == (0, "optimizer", "optimizer-update")
    assert set(f["tensors"]) == {"lin.weight", "lin.bias"}
    assert "lr=inf" in f["explanation"]


def test_transient_fault_is_not_reproduced(case, tmp_path):
    body = """
        CALLS = {"n": 0}
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 1)
            def forward(self, x):
                CALLS["n"] += 1
                out = self.lin(x)
                if CALLS["n"] == 2:            # a one-off fault, gone on replay
                    out = out * float("nan")
                return out
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert f["reproduced"] is False and f["op"] is None and f["cause"] == "unknown"
    assert f["step"] == 1 and "non-deterministic" in f["explanation"]


def test_dropout_replay_uses_the_same_rng(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
                self.drop = nn.Dropout(0.5)
            def forward(self, x):
                h = self.drop(self.lin(x))
                return torch.log(h.abs().sum(1) * 0 + (h != 0).float().sum(1) - 3.5)
        """
    result = scan(_case(case, body, loss="out.mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert f["reproduced"] is True and f["op"] == "aten.log.default"
