"""The localizer: producer not propagator, deliberate infinities, negative controls, replay."""

import textwrap

import pytest
from helpers import scan

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
    assert f["fix"].startswith("skip a batch with no target to train on (`if (labels != -100)")


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


def test_a_nan_made_in_forward_and_masked_by_where_is_the_masked_gradient(case, tmp_path):
    """`where(d > 0, sqrt(d), 0)`: sqrt makes NaN itself (not an infinity) where d < 0, the
    where keeps it out of the loss, and its gradient reads it: the masked-gradient trap, named
    at sqrt with both fixes (before: sqrt-domain, as if the NaN had reached the loss)."""
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 1)
            def forward(self, x):
                d = self.lin(x)
                return torch.where(d > 0, torch.sqrt(d), torch.zeros_like(d))
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert (f["where"], f["op"], f["cause"]) == ("forward", "aten.sqrt.default",
                                                 "masked-nonfinite-gradient")
    assert "torch.sqrt(d)" in f["source"]["code"] and result.report["timeline"][0]["loss"] != "nan"
    assert "masked or indexed away" in f["explanation"] and "negative" in f["explanation"]
    assert f["fix"].startswith("mask *before* the op") and "sqrt(x.clamp(min=eps))" in f["fix"]


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


# --- issue 16: follow every infinity to where it was made -----------------------------------

def test_log_space_dp_over_nothing_but_minus_inf_blames_logsumexp(case, tmp_path):
    """A log-space forward algorithm: torch.full(-inf) as the initial state (on purpose); one
    sample's allowed states are empty, so logsumexp reduces nothing but -inf."""
    body = """
        class Aligner(nn.Module):
            def __init__(self):
                super().__init__()
                self.emit = nn.Linear(8, 3)
            def forward(self, x):
                scores = self.emit(x).log_softmax(-1)               # (4, 3)
                alpha = torch.full((4, 3), float("-inf"))
                alpha[:, 0] = 0.0
                allowed = torch.ones(4, 3, dtype=torch.bool)
                allowed[2] = False                                  # no state is allowed
                alpha = alpha + scores
                alpha = alpha.masked_fill(~allowed, float("-inf"))
                return torch.logsumexp(alpha, dim=1)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.aligner = Aligner()
            def forward(self, x):
                return self.aligner(x)
        """
    result = scan(_case(case, body, loss="-out.mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["where"], f["value"], f["op"], f["module"], f["cause"]) == (
        "forward", "inf", "aten.logsumexp.default", "aligner", "softmax-all-masked")
    assert "overflow" not in f["explanation"] and "on purpose" in f["explanation"]
    assert f["chain"][0]["op"] == "aten.logsumexp.default"


def test_deliberate_minus_inf_dp_that_stays_finite_scans_clean(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emit = nn.Linear(8, 3)
            def forward(self, x):
                alpha = torch.full((4, 3), float("-inf"))
                alpha[:, 0] = 0.0
                for _ in range(3):
                    shifted = torch.cat([torch.full((4, 1), float("-inf")), alpha[:, :-1]], 1)
                    alpha = torch.logaddexp(alpha, shifted) + self.emit(x).log_softmax(-1)
                return alpha[:, -1]
        """
    result = scan(_case(case, body, loss="-out.mean()"), tmp_path=tmp_path)
    assert result.code == 0, result.report["finding"]


def test_negative_power_at_zero_is_a_pole_with_its_origin(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
            def forward(self, x):
                d = torch.relu(self.lin(x))          # distances; relu makes exact zeros
                return d.pow(-2.0)                   # inverse-square weights
        """
    result = scan(_case(case, body, loss="out.mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["where"], f["op"], f["cause"]) == ("forward", "aten.pow.Tensor_Scalar", "pole")
    assert "pole at 0" in f["explanation"] and "came from relu" in f["explanation"]


@pytest.mark.parametrize("module", ["torch.nn.utils.parametrizations.weight_norm",
                                    "torch.nn.utils.weight_norm"])
def test_weight_norm_over_an_all_zero_row_is_the_norm_at_zero(case, tmp_path, module):
    # weight_norm (either API) divides each output row by its norm, with no eps: a row zeroed
    # at init (or pruned) is 0/0 in the forward.
    body = f"""
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                lin = nn.Linear(8, 4)
                with torch.no_grad():
                    lin.weight[2] = 0.0
                self.lin = {module}(lin)
            def forward(self, x):
                return self.lin(x)
        """
    result = scan(_case(case, body, loss="out.pow(2).mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["where"], f["op"], f["cause"]) == (
        "forward", "aten._weight_norm_interface.default", "norm-at-zero")
    assert "1 slice(s) along dim 0, first at index 2" in f["explanation"]
    assert "weight_norm" in f["fix"] and "eps" in f["fix"]


def test_an_entropy_written_as_p_log_p_is_told_to_take_log_p_from_the_logits(case, tmp_path):
    # A policy's entropy bonus -(p * log p): a saturated softmax has exact zeros, log(0) is -inf
    # and 0 * -inf NaN. xlogy / special.entr are finite there in forward but NaN in backward,
    # so the fix names log_softmax; a log weighted by anything else keeps the generic fix.
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 3)
            def forward(self, x):
                return torch.softmax(self.lin(x) * 1000.0, dim=-1)
        """
    entropy = scan(_case(case, body, loss="(out * torch.log(out)).sum(-1).mean()"),
                   tmp_path=tmp_path / "entropy").finding
    assert (entropy["op"], entropy["cause"]) == ("aten.log.default", "log-domain")
    assert "log_softmax(logits" in entropy["fix"] and "xlogy" in entropy["fix"]
    weighted = scan(_case(case, body, loss="(0 * out + torch.log(out)).sum(-1).mean()"),
                    tmp_path=tmp_path / "weighted").finding
    assert weighted["cause"] == "log-domain" and "xlogy" not in weighted["fix"]


def test_a_masks_infinity_that_label_smoothing_averages_into_the_loss_says_fill_finite(
        case, tmp_path):
    # Classes masked with -inf, trained with `label_smoothing`: cross_entropy averages the
    # log-probabilities of every class, masked ones too, so the loss is inf. The mask wrote the
    # value (no rule names a cause), and the fix says how to keep it out of the loss.
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 6)
            def forward(self, x):
                unavailable = torch.tensor([False] * 4 + [True] * 2)
                return self.lin(x).masked_fill(unavailable, float("-inf"))
        """
    loss = "F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long), label_smoothing=0.1)"
    f = scan(_case(case, body, loss=loss), tmp_path=tmp_path).finding
    assert (f["where"], f["op"], f["cause"], f["value"]) == (
        "forward", "aten.masked_fill.Scalar", "unknown", "inf")
    assert "wrote -inf on purpose" in f["explanation"]
    assert "torch.finfo(x.dtype).min" in f["fix"] and "label_smoothing" in f["fix"]


def test_digamma_at_zero_from_exp_underflow_is_a_pole(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 3)
            def forward(self, x):
                alpha = torch.exp(self.lin(x) - 200.0)      # Dirichlet concentrations
                return torch.digamma(alpha) - torch.digamma(alpha.sum(-1, keepdim=True))
        """
    result = scan(_case(case, body, loss="out.mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["op"], f["cause"]) == ("aten.digamma.default", "pole")
    assert "came from exp" in f["explanation"] and "underflows to exactly 0" in f["explanation"]


def test_float32_overflow_turned_into_nan_by_layer_norm_blames_the_matmul(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(8, 8)
                self.norm = nn.LayerNorm(8)
                with torch.no_grad():
                    self.up.weight.fill_(1e37)
            def forward(self, x):
                return self.norm(self.up(x.abs() * 100))
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["where"], f["value"], f["op"], f["module"], f["cause"]) == (
        "forward", "nan", "aten.addmm.default", "up", "dtype-overflow")
    assert "float32 holds at most" in f["explanation"]
    assert "native_layer_norm" in f["explanation"]
    assert [c["op"] for c in f["chain"][:1]] == ["aten.addmm.default"]
    assert any(c["op"] == "aten.native_layer_norm.default" for c in f["chain"])


def test_minus_inf_from_log_of_zero_keeps_its_sign_and_names_the_loss(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 1)
            def forward(self, x):
                return torch.sigmoid(self.lin(x) * 0 - 200.0).squeeze(1)   # saturates to 0
        """
    result = scan(_case(case, body, loss="torch.log(out).mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["value"], f["op"], f["cause"], f["module"]) == (
        "-inf", "aten.log.default", "log-domain", "case:loss")
    assert "-inf" in f["explanation"] and "came from sigmoid" in f["explanation"]
    assert f["chain"][0]["module"] == "case:loss"


def test_python_inf_scalar_times_zero_is_inf_arithmetic_not_all_finite(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
            def forward(self, x):
                keep = torch.ones(4, 4)
                keep[:, 3] = 0.0
                bias = (1 - keep) * float("-inf")        # 0 * -inf = NaN where kept
                return torch.softmax(self.q(x) @ self.q(x).T + bias, dim=-1)
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["op"], f["cause"]) == ("aten.mul.Tensor", "inf-arithmetic")
    assert "all finite" not in f["explanation"] and "-inf * 0" in f["explanation"]


def test_nan_from_numpy_in_the_forward_is_created_outside_torch(case, tmp_path):
    body = """
        import numpy as np
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
            def forward(self, x):
                ratio = np.log(np.array([1.0, 0.0, 2.0, 3.0], dtype=np.float32))
                return self.lin(x) * torch.tensor(ratio).unsqueeze(1)
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert f["cause"] == "unknown" and f["where"] == "forward"
    assert "created outside torch ops" in f["explanation"]
    assert "overflow" in f["explanation"] and "not an overflow" in f["explanation"]
    assert "inputs that were all finite" not in f["explanation"]


def test_rsqrt_at_zero_in_forward_keeps_sqrt_domain_with_a_true_text(case, tmp_path):
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
            def forward(self, x):
                h = self.lin(x) * torch.tensor([1., 0., 1., 1.]).unsqueeze(1)   # a padding row
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))           # RMSNorm, no eps
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["op"], f["cause"]) == ("aten.rsqrt.default", "sqrt-domain")
    assert "rsqrt(0) = 1/sqrt(0) is inf" in f["explanation"]
    assert "-inf * 0" not in f["explanation"] and "mul" in f["explanation"]


def test_one_op_registry_keys_rules_on_overload_packets():
    import torch

    from nanaudit.localize.rules import registry
    assert registry.RULES[torch.ops.aten.log] is registry.RULES[torch.ops.aten.log_]
    assert registry.keeps_inputs(torch.ops.aten.lgamma.default)
    assert registry.keeps_inputs(torch.ops.aten.softplus.default)       # named as an origin
    assert not registry.keeps_inputs(torch.ops.aten.relu.default)
    with pytest.raises(ValueError, match="two domain rules"):
        registry.domain_rule("log")(lambda *a: None)


def test_overflow_is_claimed_only_when_the_result_can_exceed_the_range():
    import torch

    from nanaudit.localize.overflow import overflow_bound
    a = torch.full((2, 64), 3.1e4, dtype=torch.float16)
    b = torch.full((64, 2), 1.0, dtype=torch.float16)
    big = overflow_bound("aten.mm.default", (a, b), {}, None)
    assert big.bound > big.limit == 65504
    small = overflow_bound("aten.mm.default", (a / 1e4, b), {}, None)
    assert small.bound < small.limit
    cast = overflow_bound("aten._to_copy.default", (torch.tensor([1e5]),), {},
                          torch.float16)
    assert cast.bound > cast.limit and cast.dtype == torch.float16


def test_a_norms_overflow_bound_sums_one_row_not_the_batch():
    """A LayerNorm sums the squares of one row (its normalized shape), not of the whole batch:
    GPT-2's ln_2 in transformers' run_clm_no_trainer.py at a learning rate of 1e6 saw
    |input| 1e20 in a [4, 16, 16] batch and was said to sum 1024 squares; it sums 16. A row
    of 16 values of 1e18 (1.6e37) fits float32, though 1024 of them would not."""
    import torch

    from nanaudit.localize.overflow import overflow_bound
    x = torch.full((4, 16, 16), 1e18)
    w, b = torch.ones(16), torch.zeros(16)
    ln = overflow_bound("aten.native_layer_norm.default", (x, [16], w, b, 1e-5), {}, None)
    assert ln.bound < ln.limit and "summed over 16 values" in ln.how
    rms = overflow_bound("aten.rms_norm.default", (x, [16, 16], w), {}, None)
    assert "summed over 256 values" in rms.how
    var = overflow_bound("aten.var.correction", (x, [0]), {}, None)
    assert "summed over 4 values" in var.how
    vnorm = overflow_bound("aten.linalg_vector_norm.default", (x, 2, [-1]), {}, None)
    assert "summed over 16 values" in vnorm.how
    img = torch.full((2, 6, 3, 3), 1e18)                         # 2 groups of 3 channels x 9
    gn = overflow_bound("aten.native_group_norm.default",
                        (img, None, None, 2, 6, 9, 2, 1e-5), {}, None)
    assert "summed over 27 values" in gn.how
    bn = overflow_bound("aten.native_batch_norm.default", (img, None, None, None, None, True,
                                                           0.1, 1e-5), {}, None)
    assert "summed over 18 values" in bn.how                     # one channel: 2 x 9
    whole = overflow_bound("aten.mse_loss.default", (x, torch.zeros_like(x)), {}, None)
    assert whole.bound > whole.limit and "summed over 1024 values" in whole.how
    each = overflow_bound("aten.mse_loss.default", (x, torch.zeros_like(x), 0), {}, None)
    assert "summed over 1 values" in each.how


def test_a_norms_overflow_bound_sums_the_squares_it_normalizes_over_not_the_whole_tensor():
    # karpathy/makemore's transformer under lr 1e3: a LayerNorm over 32 features of a
    # [32, 9, 32] activation near 8e19 sums 32 squares per row, not 9216.
    import torch

    from nanaudit.localize.overflow import overflow_bound
    x = torch.full((32, 9, 32), 7.8e19)
    norm = overflow_bound("aten.native_layer_norm.default", (x, [32], None, None, 1e-5), {}, None)
    assert norm.how == "(7.8e+19)² summed over 32 values" and norm.bound > norm.limit
    assert overflow_bound("aten.native_layer_norm.default", (x / 1e2, [32], None, None, 1e-5),
                          {}, None).bound < norm.limit       # 32 x 6e35: no overflow
    group = overflow_bound("aten.native_group_norm.default",
                           (torch.ones(2, 8, 3, 3), None, None, 2, 8, 9, 4, 1e-5), {}, None)
    assert group.how.endswith("summed over 18 values")         # 8 channels / 4 groups x 3x3
    batch = overflow_bound("aten.native_batch_norm.default",
                           (torch.ones(8, 4, 5), None, None, None, None, True, 0.1, 1e-5), {},
                           None)
    assert batch.how.endswith("summed over 40 values")          # all but the channels
    assert overflow_bound("aten.linalg_vector_norm.default", (x, 2, [1]), {},
                          None).how.endswith("summed over 9 values")
    assert overflow_bound("aten.mse_loss.default", (x, x), {},
                          None).how.endswith("summed over 9216 values")

def test_masked_out_empty_bag_nan_in_backward_blames_the_softmax(case, tmp_path):
    """Attention MIL pooling: the empty bag's output is masked out, so the loss is finite, but
    the softmax over its all -inf row made NaN that backward multiplies into the gradients. The
    -inf is the mask's: softmax-all-masked at the softmax, not an overflow, not masked_fill."""
    body = """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(8, 8)
                self.score = nn.Linear(8, 1)
            def forward(self, x):
                tiles = self.embed(x).view(2, 2, 8)
                valid = torch.tensor([[True, True], [False, False]])
                scores = self.score(tiles).squeeze(-1).masked_fill(~valid, float("-inf"))
                pooled = (torch.softmax(scores, dim=1).unsqueeze(-1) * tiles).sum(1)
                return torch.where(valid.any(1, keepdim=True), pooled, torch.zeros_like(pooled))
        """
    result = scan(_case(case, body, loss="out.square().mean()"), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1 and result.report["timeline"][0]["loss"] != "nan"
    assert (f["where"], f["op"], f["cause"]) == (
        "forward", "aten._softmax.default", "softmax-all-masked")
    assert f["chain"][-1]["where"] == "backward"             # the hops into backward are shown
    assert "masked_fill" in f["explanation"] and "overflow" not in f["explanation"]


def test_multihead_attention_over_a_fully_padded_sequence(case, tmp_path):
    """Real-world 17: nn.MultiheadAttention writes -inf for padded keys itself (masked_fill_ in
    place); a sequence with every key padded is softmax-all-masked, its -inf written on purpose."""
    code = """
        import torch
        from torch import nn

        def batches():
            g = torch.Generator().manual_seed(0)
            for step in range(3):
                pad = torch.zeros(4, 5, dtype=torch.bool)
                pad[:, 3:] = True
                if step == 1:
                    pad[2] = True                      # an empty sequence
                yield torch.randn(4, 5, 8, generator=g), pad

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            def forward(self, x, pad):
                return self.attn(x, x, x, key_padding_mask=pad)[0]

        def build_model():
            torch.manual_seed(0)
            return M()

        def loss(model, batch):
            return model(*batch).square().mean()
        """
    result = scan(case(code, optimizer={"class": "torch.optim.SGD", "lr": 0.01}),
                  tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["step"], f["op"], f["module"], f["cause"], f["samples"]) == (
        1, "aten._softmax.default", "attn", "softmax-all-masked", [2])
    assert "masked_fill" in f["explanation"] and "on purpose" in f["explanation"]


def test_softmax_over_a_numpy_built_minus_inf_mask_is_all_masked(case, tmp_path):
    """A causal mask built with numpy (np.triu of -inf) is a deliberate -inf from outside torch:
    a fully masked row is softmax-all-masked, never an overflow."""
    body = """
        import numpy as np
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(8, 8)
            def forward(self, x):
                mask = np.triu(np.full((4, 4), -np.inf, dtype=np.float32), k=1)
                mask[0, 0] = -np.inf                     # the first query sees nothing
                scores = self.q(x) @ self.q(x).T
                return torch.softmax(scores + torch.from_numpy(mask), dim=-1)
        """
    result = scan(_case(case, body), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["op"], f["cause"]) == ("aten._softmax.default", "softmax-all-masked")
    assert "outside torch" in f["explanation"]


def test_every_nanaudit_package_is_ours_and_the_demo_is_the_users():
    # The op tracer and the error frames share one test of "ours": a finding's source line
    # must never point into nanaudit, whichever package the call went through.
    import nanaudit.commands.scan
    import nanaudit.demo
    import nanaudit.integrations.sentinel
    import nanaudit.run.loop
    from nanaudit.errors import is_own_file
    for module in (nanaudit.run.loop, nanaudit.commands.scan, nanaudit.integrations.sentinel):
        assert is_own_file(module.__file__)
    assert not is_own_file(nanaudit.demo.__file__)
    assert not is_own_file(__file__)
