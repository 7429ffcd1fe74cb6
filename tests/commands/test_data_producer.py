"""Issue 29, end to end: when the batch is already non-finite, every command names the op of
the user's data code that made it (with its line, the rows and the cause), or says the value
was already non-finite when it reached torch; a batch a DataLoader worker made is made again
in this process, and only when that gives the same batch."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import run_cli, scan

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

DATA = """
    import sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    def build_model(dropout=0.0):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 8), nn.Dropout(dropout), nn.Linear(8, 1))

    def standardize(rows):
        x = torch.stack([r[0] for r in rows])
        y = torch.stack([r[1] for r in rows])
        return (x - x.mean(0)) / x.std(0), y

    def loader(kind="collate", workers=0):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g)
        if kind == "collate":
            x[16:24, 1] = 5.0              # feature 1 is constant in batch 2
            return DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=standardize,
                              num_workers=workers)
        x[21, 0] = float("nan")            # already NaN in the data set: batch 2, row 5
        return DataLoader(TensorDataset(x, y), batch_size=8, num_workers=workers)

    def batches(augment=False):
        g = torch.Generator().manual_seed(0)
        for i in range(4):
            x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
            if augment:
                x = x + torch.rand(8, 3)   # the global RNG, which training's dropout moves
            if i == 2:
                x[:, 2] = 1.0              # a constant feature in batch 2
            yield (x - x.mean(0)) / x.std(0), y

    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    if __name__ == "__main__":
        model = build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in loader(sys.argv[1], int(sys.argv[2])):
            out = model(x)
            optimizer.zero_grad()
            ((out - y) ** 2).mean().backward()
            optimizer.step()
"""

LOOP_LOG = """
    import torch
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = torch.randint(1, 10, (64, 4)).float()
    counts[21, 2] = 0.0                    # a legitimate zero count: batch 2, row 5
    target = torch.randn(64, 1)
    for step in range(8):
        x, y = counts[step * 8:(step + 1) * 8], target[step * 8:(step + 1) * 8]
        loss = F.mse_loss(model(torch.log(x)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def _write(tmp_path, code: str, name: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _config(tmp_path, data) -> str:
    (tmp_path / "data_code.py").write_text(textwrap.dedent(DATA))
    config = tmp_path / "config.yaml"
    # CPU: the model's dropout then draws from the stream the data code draws from (on CUDA it
    # would not, and a batch the data cannot give again here would be given again there).
    config.write_text(json.dumps({"model": "data_code:build_model", "data": data,
                                  "loss": "data_code:loss", "device": "cpu"}))
    return str(config)


# --- nanaudit run ------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_names_the_loops_log_and_its_line(tmp_path):
    path = _write(tmp_path, LOOP_LOG, "train.py")
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    line = _line(path, "torch.log(x)")
    assert report.run.rerun.status == "reproduced"
    assert (f.step, f.where, f.op, f.cause, f.samples) == (2, "input", "aten.log.default",
                                                           "log-domain", [5])
    assert (f.source.file, f.source.line, f.module) == (str(path), line, None)
    assert f.fix.startswith(f"at train.py:{line}: clamp the input")
    assert f.producer.made_by == "torch-op" and f.producer.worker is None
    assert f.tensors == ["input[0]"] and "log of exactly 0 is -inf" in f.explanation


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind, workers", [("collate", 0), ("collate", 2), ("nan", 2)])
def test_run_names_the_collate_fn_or_says_the_data_set_held_it(tmp_path, kind, workers):
    path = _write(tmp_path, DATA, "train.py")
    report = run_script(ScriptTarget(path=str(path), args=(kind, str(workers))),
                        ScriptOptions(rerun_timeout_s=120))
    f, p = report.finding, report.finding.producer
    assert report.run.rerun.status == "reproduced" and (f.step, f.where) == (2, "input")
    assert p.worker == (0 if workers else None)         # batch 2 went to worker 2 % 2
    if kind == "collate":
        assert (f.op, f.cause, f.samples) == ("aten.div.Tensor", "div-by-zero", list(range(8)))
        assert f.source.line == _line(path, "/ x.std(0)") and p.made_by == "torch-op"
        assert "the value 0 came from std" in f.explanation
    else:
        assert (f.op, f.cause, f.samples) == (None, "nonfinite-input", [5])
        assert p.made_by == "outside-torch" and p.sample_indices == [21]
        assert "already non-finite when it reached torch" in f.explanation


# --- nanaudit scan and bisect ------------------------------------------------------------------

def test_scan_names_the_data_entrypoints_division(tmp_path):
    result = scan(_config(tmp_path, "data_code:batches"), "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["step"], f["where"], f["op"], f["cause"]) == (2, "input", "aten.div.Tensor",
                                                            "div-by-zero")
    assert f["source"]["line"] == _line(tmp_path / "data_code.py", "yield (x - x.mean(0))")
    assert f["producer"]["made_by"] == "torch-op" and f["samples"] == list(range(8))
    assert "read again from its start to batch 2" in f["producer"]["traced"]


def test_bisect_names_the_division_in_its_list_and_skip_list(tmp_path):
    out = tmp_path / "bisect.json"
    result = run_cli("bisect", _config(tmp_path, "data_code:batches"), "--json", out, "--quiet")
    report = json.loads(out.read_text())
    (bad,) = report["bisect"]["bad_batches"]
    assert result.code == 1
    assert (bad["batch_index"], bad["op"], bad["cause"]) == (2, "aten.div.Tensor", "div-by-zero")
    assert bad["producer"]["made_by"] == "torch-op"
    assert report["bisect"]["skip_list"][0]["cause"] == "div-by-zero"


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_scan_says_a_nan_in_the_data_set_was_already_there(tmp_path, workers):
    data = {"entrypoint": "data_code:loader", "args": {"kind": "nan", "workers": workers}}
    result = scan(_config(tmp_path, data), "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert (f["step"], f["where"], f["cause"], f["op"], f["samples"]) == (
        2, "input", "nonfinite-input", None, [5])
    p = f["producer"]
    assert (p["made_by"], p["worker"], p["sample_indices"]) == ("outside-torch",
                                                                0 if workers else None, [21])
    assert "already non-finite when it reached torch" in f["explanation"]


def test_scan_does_not_trace_a_batch_the_data_does_not_give_again(tmp_path):
    data = {"entrypoint": "data_code:batches", "args": {"augment": True}}
    config = _config(tmp_path, data)
    text = json.loads(open(config).read())
    text["model"] = {"entrypoint": "data_code:build_model", "args": {"dropout": 0.5}}
    open(config, "w").write(json.dumps(text))
    result = scan(config, "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert (f["where"], f["cause"], f["op"]) == ("input", "nonfinite-input", None)
    assert f["producer"]["made_by"] == "not-localized"
    assert "gave a different batch 2" in f["producer"]["note"]


# --- Sentinel ----------------------------------------------------------------------------------

def test_sentinel_says_plainly_it_cannot_trace_the_loops_data_code():
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sentinel = Sentinel(model, optimizer)
    with pytest.raises(NonFiniteError) as raised:
        for step in range(3):
            x = torch.rand(4, 3)
            x = torch.log(x * (step != 2))             # the loop's own data code
            loss = model(x).pow(2).mean()
            loss.backward()
            sentinel.check(step, x, loss)
            optimizer.step()
            optimizer.zero_grad()
    f = raised.value.report.finding
    assert (f.step, f.where, f.cause, f.op) == (2, "input", "nonfinite-input", None)
    assert f.producer.made_by == "not-localized" and "nanaudit run" in f.producer.note
