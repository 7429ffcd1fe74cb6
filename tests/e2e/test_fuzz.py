"""Property-based fuzzing (issue 13): every bad config, YAML text or batch structure gets a
documented exit code and a message that names where the problem is; never exit 6, never a hang.

Example counts are sized for CI on 2 cores; NANAUDIT_FUZZ_SCALE multiplies them for a longer
local hunt (`NANAUDIT_FUZZ_SCALE=20 python -m pytest tests/e2e/test_fuzz.py`).
"""

import json
import math
import os
import textwrap

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz suite needs the test extra "
                                 "(pip install -e '.[test]')")
from helpers import LINEAR_CASE, run_cli  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanaudit.exitcodes import ExitCode  # noqa: E402

SCALE = int(os.environ.get("NANAUDIT_FUZZ_SCALE", "1"))
DOCUMENTED = {int(code) for code in ExitCode}
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

KNOWN_KEYS = ["model", "data", "loss", "optimizer", "steps", "seed", "checkpoint", "device",
              "grad_clip", "batch_dim", "localize", "precision", "amp", "watch", "fail_on",
              "distributed", "schema_version"]
SECTION_KEYS = {"localize": ["samples", "max_replays"],
                "amp": ["grad_scaler", "init_scale", "growth_interval", "scale_floor",
                        "max_skipped"],
                "watch": ["activations", "near_overflow", "loss_spike", "spike_window",
                          "grad_growth", "growth_steps", "update_ratio", "update_every"],
                "distributed": ["backend", "ddp", "timeout_s", "find_unused_parameters"],
                "optimizer": ["class", "lr", "eps", "betas", "momentum", "weight_decay",
                              "entrypoint", "args"]}

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]),
    st.text(max_size=12),
    st.sampled_from(["case:build_model", "case:nope", "case.py:batches", "torch.optim.SGD",
                     "torch.optim.Nope", "nanaudit:__version__", ":", "a:b:c", "cuda:99",
                     "auto", "cpu", "fp16", "bf16", "gloo", "nccl", "warning"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(sum(SECTION_KEYS.values(), [])),
                              st.text(max_size=6)), inner, max_size=3)), max_leaves=6)

BASE = {"model": "case:build_model", "data": "case:batches", "loss": "case:loss",
        "optimizer": {"class": "torch.optim.SGD", "lr": 0.1}, "steps": 2}


# Values at the edges users hit: the limits of int64, non-finite floats, empty and odd types.
edges = st.sampled_from([None, True, 0, -1, 1, 2**63, 2**64, 2**70, -(2**70), 1e308, 1e-320,
                         math.nan, math.inf, -math.inf, "", "x", [], {}, [1, 2], {"a": 1}])


@st.composite
def configs(draw):
    """A valid config with a few keys replaced, removed or added: near misses, as users make."""
    config = dict(BASE)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.one_of(st.sampled_from(KNOWN_KEYS), st.sampled_from(KNOWN_KEYS),
                             st.text(min_size=1, max_size=8)))
        value = st.one_of(edges, values)
        action = draw(st.sampled_from(["set", "set", "section", "section", "drop"]))
        if action == "drop":
            config.pop(key, None)
        elif action == "section" and key in SECTION_KEYS:
            section = dict(config.get(key) or {}) if isinstance(config.get(key), dict) else {}
            section[draw(st.sampled_from(SECTION_KEYS[key]))] = draw(value)
            config[key] = section
        else:
            config[key] = draw(value)
    return config


def _write(tmp_path, config) -> str:
    (tmp_path / "case.py").write_text(LINEAR_CASE)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


def _assert_documented(result, report=None):
    assert result.code in DOCUMENTED and result.code != ExitCode.INTERNAL, (
        result.code, result.stderr[-2000:])
    if result.code == ExitCode.CONFIG:
        assert "config error" in result.stderr
        if report is not None:
            problems = report["error"].get("problems") or []
            assert problems and all(p["message"] for p in problems)


@pytest.mark.slow
@settings(max_examples=150 * SCALE, **FUZZ)
@given(config=configs())
def test_validate_never_fails_internally(tmp_path, config):
    _assert_documented(run_cli("validate", _write(tmp_path, config)))


@pytest.mark.slow
@settings(max_examples=60 * SCALE, **FUZZ)
@given(config=configs())
def test_scan_never_fails_internally(tmp_path, config):
    out = tmp_path / "r.json"
    out.unlink(missing_ok=True)
    path = _write(tmp_path, config)
    result = run_cli("scan", path, "-q", "--no-repro", "--json", out)
    report = json.loads(out.read_text())
    assert report["status"] in ("clean", "nonfinite", "error")
    _assert_documented(result, report)
    # A problem `validate` finds is the same config error for `scan` (scan may find more:
    # it also builds the model and runs the data).
    if run_cli("validate", path).code == ExitCode.CONFIG:
        assert result.code == ExitCode.CONFIG, result.stderr


@pytest.mark.slow
@settings(max_examples=40 * SCALE, **FUZZ)
@given(option=st.sampled_from(["--seed", "--device", "--steps"]),
       value=st.one_of(st.integers(-(2**70), 2**70).map(str), st.text(max_size=8),
                       st.sampled_from(["tpu", "cuda:99", "cuda:-1", "mps", str(2**64),
                                        str(-(2**63) - 1), "nan", "1e400", "0", ""])))
def test_command_line_overrides_never_fail_internally(tmp_path, option, value):
    out = tmp_path / "r.json"
    out.unlink(missing_ok=True)
    config = _write(tmp_path, BASE)
    result = run_cli("scan", config, "-q", "--no-repro", "--json", out, option, value)
    _assert_documented(result, json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
@settings(max_examples=100 * SCALE, **FUZZ)
@given(text=st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["model: case:build_model", "data: case:batches", "loss: case:loss",
                              "a: &a [1, 2]", "b: *a", "c: *nope", "- x", "? [a]", "!!python/"
                              "object:os.system ls", "{", "}", "key: 'unterminated", "\t",
                              "optimizer: {class: torch.optim.SGD, lr: .nan}", "&x", "*x",
                              "steps: 1e400", "%YAML 1.1", "---", "..."]),
             max_size=8).map("\n".join)))
def test_any_yaml_text_is_a_config_error_or_runs(tmp_path, text):
    (tmp_path / "case.py").write_text(LINEAR_CASE)
    (tmp_path / "config.yaml").write_text(text)
    result = run_cli("validate", tmp_path / "config.yaml")
    _assert_documented(result)
    assert result.code in (ExitCode.CLEAN, ExitCode.CONFIG)


# --- batch structures ---------------------------------------------------------------------------

BATCH_CASE = textwrap.dedent("""
    import pathlib
    import torch
    from torch import nn

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))
        def forward(self, batch):
            leaves, stack = [], [batch]
            while stack:
                item = stack.pop()
                if isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, (list, tuple)):
                    stack.extend(item)
                elif isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel():
                    leaves.append(item.mean())
            return self.w * (sum(leaves) if leaves else torch.zeros(()))

    def build_model():
        return Scale()

    def batches():
        batch = torch.load(pathlib.Path(__file__).with_name("batch.pt"), weights_only=True)
        for _ in range(2):
            yield batch

    def loss(model, batch):
        return model(batch).square()
""")

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw):
    import torch
    shape = draw(shapes)
    if draw(st.booleans()):
        t = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        return t
    t = torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if t.numel() and draw(st.booleans()):
        flat = t.view(-1)
        flat[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(
            [math.nan, math.inf, -math.inf]))
    return t


batches = st.recursive(tensors(), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from(["input_ids", "x", "mask", "labels", "a b", "'q'", ""]),
                    inner, max_size=3)), max_leaves=5)


@pytest.mark.slow
@settings(max_examples=40 * SCALE, **FUZZ)
@given(batch=batches, batch_dim=st.one_of(st.none(), st.integers(-2, 3)))
def test_any_batch_structure_gets_a_documented_answer(tmp_path, batch, batch_dim):
    import torch
    (tmp_path / "case.py").write_text(BATCH_CASE)
    torch.save(batch, tmp_path / "batch.pt")
    config = {"model": "case:build_model", "data": "case:batches", "loss": "case:loss",
              "optimizer": {"class": "torch.optim.SGD", "lr": 0.1}}
    if batch_dim is not None:
        config["batch_dim"] = batch_dim
    out = tmp_path / "r.json"
    out.unlink(missing_ok=True)
    result = run_cli("scan", _write_config(tmp_path, config), "-q", "--no-repro", "--json", out)
    report = json.loads(out.read_text())
    _assert_documented(result, report)
    finding = report["finding"]
    if finding is not None and finding["where"] == "input":
        assert finding["tensor"].startswith("batch")   # the path reads like the user's code


def _write_config(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
