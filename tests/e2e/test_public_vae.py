"""`nanaudit run` on pytorch/examples vae/main.py's shape (scripts/vae_loop.py): a model whose
forward draws `randn_like`, a loss function of its three outputs, a `no_grad` test pass and
files saved each epoch. Faults come from the data file, as a user's would: pixels left in
[0, 255] (ToTensor's scaling forgotten) make BCELoss raise, and a NaN pixel reaches the model."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from helpers import plain

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

VAE = str(Path(__file__).parent / "scripts" / "vae_loop.py")


@pytest.fixture
def images(tmp_path, monkeypatch) -> torch.Tensor:
    monkeypatch.chdir(tmp_path)
    return torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def audited(*args: str):
    return run_script(ScriptTarget(path=VAE, args=args), ScriptOptions())


def plain_frames(*args: str) -> list[tuple[str, int, str]]:
    """The frames of the traceback `python vae_loop.py ARGS` ends with (run in this process)."""
    try:
        plain(VAE, *args)
    except RuntimeError as exc:
        frames = [(f.filename, f.lineno or 0, f.name)
                  for f in traceback.extract_tb(exc.__traceback__)]
        first = next(i for i, f in enumerate(frames) if f[0] == VAE)
        return frames[first:]          # from the script's own module on, as nanaudit runs it
    raise AssertionError("the script did not raise")


def test_vae_clean_run_prints_what_python_prints_and_saves_its_files(images, tmp_path, capsys):
    torch.save(images, tmp_path / "digits.pt")
    args = ("--data=digits.pt",)
    plain(VAE, *args)
    printed = capsys.readouterr().out
    report = audited(*args)
    assert exit_code(report) == 0 and capsys.readouterr().out == printed
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "reconstruction_1.pt", "reconstruction_2.pt", "sample_1.pt", "sample_2.pt"]


def test_unscaled_pixels_raise_in_bce_with_the_traceback_python_prints(images, tmp_path):
    # BCELoss refuses targets above 1: the script's error, exit 4, with exactly the frames a
    # plain run shows (none of torch's dispatch into the loss-code recorder's mode).
    torch.save(images * 255, tmp_path / "digits.pt")
    expected = plain_frames("--data=digits.pt")
    report = audited("--data=digits.pt")
    assert exit_code(report) == 4 and report.finding is None
    assert report.error.exception == "RuntimeError"
    assert [(f.file, f.line, f.function) for f in report.error.frames] == expected
    assert not any(f.file.endswith("overrides.py") for f in report.error.frames)


def test_nan_pixel_is_the_data_sets_sample_though_bce_raised_on_it(images, tmp_path):
    images[40, 0, 3, 5] = float("nan")
    torch.save(images, tmp_path / "digits.pt")
    report = audited("--data=digits.pt")
    f = report.finding
    assert exit_code(report) == 1 and (f.where, f.cause) == ("input", "nonfinite-input")
    assert f.producer.made_by == "outside-torch" and f.producer.sample_indices == [40]
    assert f.explanation.endswith("the script then raised RuntimeError: all elements of input "
                                  "should be between 0 and 1")
    assert report.error.exception == "RuntimeError"
