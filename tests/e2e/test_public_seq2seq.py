"""`nanaudit run` on pytorch/tutorials' seq2seq translation loop (scripts/seq2seq_loop.py): many
model calls in one step (the encoder once per input token, the decoder once per target token),
each taking the state the previous call returned, the model's outputs written into a buffer
the script made before the step, the loss summed over the decoder's calls, one backward and two
optimizers stepped after it (each optimizer's step is a step of the audit)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from helpers import plain
from rich.console import Console

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.report.console import print_report
from nanaudit.script.target import ScriptOptions, ScriptTarget

SEQ2SEQ = str(Path(__file__).parent / "scripts" / "seq2seq_loop.py")
PAIRS = ("je suis froid\ti am cold\nil est grand\the is tall\nelle a faim\tshe is hungry\n"
         "nous sommes ici\twe are here\n")


@pytest.fixture
def pairs(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.txt").write_text(PAIRS)
    return "--pairs=pairs.txt"


def audited(*args: str, **options):
    return run_script(ScriptTarget(path=SEQ2SEQ, args=args), ScriptOptions(**options))


def test_seq2seq_clean_run_prints_what_python_prints_and_no_loss_is_drawn_bad(pairs, capsys):
    plain(SEQ2SEQ, pairs)
    printed = capsys.readouterr().out
    report = audited(pairs)
    assert exit_code(report) == 0 and capsys.readouterr().out == printed
    # 12 iterations, two optimizer steps each; the decoder's step hears no loss of its own.
    assert len(report.timeline) == 24
    assert [e.loss is None for e in report.timeline] == [False, True] * 12
    out = io.StringIO()
    print_report(report, Console(file=out, width=100, color_system=None))
    loss_row = next(line for line in out.getvalue().splitlines() if "  loss  " in line)
    assert "✗" not in loss_row and loss_row.count("·") == 12


def test_seq2seq_huge_learning_rate_is_replayed_in_process_across_the_steps_calls(pairs):
    # lr 1e30: the encoder's first update makes its weights ~1e29; at the next iteration its
    # GRU's addmm overflows float32. The step's window is 4 encoder and up to 4 decoder calls,
    # each taking the previous call's hidden state and the buffer the encoder's outputs were
    # written into: the replay runs them on its own values, so it reproduces the run in-process.
    report = audited(pairs, "--lr=1e30")
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.where) == (2, "forward")
    assert report.run.replay.status == "reproduced" and f.localized_by == "in-process"
    assert report.run.rerun is None
    assert (f.op, f.module) == ("aten.addmm.default", "gru")
    assert f.source.file == SEQ2SEQ and f.source.code == "output, hidden = self.gru(embedded, hidden)"
    assert any(s.max >= 1e28 for s in f.inputs)
