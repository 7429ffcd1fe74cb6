"""`nanaudit run` on pytorch/examples gat/main.py's shape (scripts/gat_loop.py): a graph read
from local Cora-format files, one full-graph step per epoch with `output[mask_train]`, and a
`no_grad` evaluation inside each step. The fault is the user's data: a graph smaller than the
split's fixed sizes leaves the training split empty, and NLLLoss averages over no target."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import line_of, plain

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

GAT = Path(__file__).parent / "scripts" / "gat_loop.py"
CLASSES = ("Theory", "Neural_Networks", "Rule_Learning")


def write_cora(folder: Path, nodes: int) -> None:
    """Cora's format: `<paper id> <0/1 word features> <class>` and `<cited id> <citing id>`."""
    rng = np.random.default_rng(0)
    ids = rng.choice(10 ** 6, nodes, replace=False)
    (folder / "cora").mkdir()
    (folder / "cora" / "cora.content").write_text("".join(
        f"{i}\t" + "\t".join(str(int(v)) for v in rng.random(12) < 0.3)
        + f"\t{CLASSES[k % 3]}\n" for k, i in enumerate(ids)))
    (folder / "cora" / "cora.cites").write_text("".join(
        f"{a}\t{b}\n" for a, b in (rng.choice(ids, 2, replace=False) for _ in range(3 * nodes))))


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def without_times(text: str) -> str:
    return re.sub(r"\(\d+\.\d+s\)", "(s)", text)


def test_gat_clean_run_prints_what_python_prints(folder, capsys):
    write_cora(folder, 40)
    plain(str(GAT))
    printed = capsys.readouterr().out
    report = run_script(ScriptTarget(path=str(GAT), args=()), ScriptOptions())
    assert exit_code(report) == 0 and len(report.timeline) == 3
    assert without_times(capsys.readouterr().out) == without_times(printed)


def test_a_graph_smaller_than_the_split_is_an_empty_training_loss_named_in_process(folder):
    # 16 nodes: 12 test, 4 validation, none left to train on; NLLLoss's mean over no target
    # is 0/0 at the first step, in the script's loss code (the model's output is finite).
    write_cora(folder, 16)
    report = run_script(ScriptTarget(path=str(GAT), args=()), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.where, f.value) == (0, "forward", "nan")
    assert (f.op, f.cause) == ("aten.nll_loss_forward.default", "degenerate-reduction")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert f.source.line == line_of(GAT, "loss = criterion(output[mask_train]")
    assert "the loss got no targets at all (input of shape [0, 3]" in f.explanation
    assert "ignore_index" not in f.explanation and "drop_last" not in f.fix
    assert f.fix.startswith("skip an empty batch or selection")
