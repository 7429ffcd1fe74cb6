"""The listing of the working folder taken before the first run (script/scratch.py)."""

import os
import time

from nanaudit.script import scratch
from nanaudit.script.scratch import FolderState


def test_the_listing_names_every_file_by_its_relative_path(tmp_path):
    (tmp_path / "data" / "shards").mkdir(parents=True)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "data" / "shards" / "0.bin").write_bytes(b"abc")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref\n")
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"x" * 10)
    os.symlink(outside, tmp_path / "linked")              # a linked folder is not followed
    os.symlink(tmp_path / "train.py", tmp_path / "alias.py")   # a linked file is listed
    os.symlink(tmp_path / "gone", tmp_path / "dangling")        # a broken link is not
    state = FolderState.take(str(tmp_path))
    assert state is not None
    assert state.files == {"train.py", os.path.join("data", "shards", "0.bin"), "alias.py"}
    assert state.size() == len("print(1)\n") * 2 + 3      # alias.py counts its target's


def test_the_files_the_first_run_changed_are_those_modified_since_it_started(tmp_path):
    (tmp_path / "config.yaml").write_text("a: 1\n")
    (tmp_path / "log.txt").write_text("old\n")
    old = time.time_ns() - 3_600 * 10**9            # an hour before the run
    for name in ("config.yaml", "log.txt"):
        os.utime(tmp_path / name, ns=(old, old))
    state = FolderState.take(str(tmp_path))
    assert state is not None and state.changed() == []
    with open(tmp_path / "log.txt", "a") as log:     # the first run appends to its log ...
        log.write("new\n")
    (tmp_path / "ckpt.pt").write_bytes(b"x")          # ... and saves a checkpoint (not listed)
    assert state.changed() == ["log.txt"]


def test_a_file_written_just_before_the_start_is_changed_only_if_written_again(tmp_path):
    # A test (or a user) writes the script and its data, then runs at once: within the file
    # system clock's slack of the start, which alone must not count as the first run's change.
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "log.txt").write_text("old\n")
    state = FolderState.take(str(tmp_path))
    assert state is not None and state.changed() == []
    with open(tmp_path / "log.txt", "a") as log:
        log.write("new\n")
    later = time.time_ns() + 10**9                    # the clock's next tick, whatever it is
    os.utime(tmp_path / "log.txt", ns=(later, later))
    assert state.changed() == ["log.txt"]


def test_a_folder_past_the_limit_is_not_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch, "MAX_FILES", 3)
    for i in range(2):
        (tmp_path / f"{i}.txt").write_text("x")
    assert FolderState.take(str(tmp_path)) is not None
    (tmp_path / "deep").mkdir()
    for i in range(2):
        (tmp_path / "deep" / f"{i}.txt").write_text("x")
    assert FolderState.take(str(tmp_path)) is None


def test_a_script_outside_the_copied_folder_is_named_by_its_absolute_path(tmp_path,
                                                                          monkeypatch):
    """`nanaudit run ../train.py`: the re-run runs in the scratch copy of the working folder,
    where the relative path names nothing (before: FileNotFoundError, the re-run failed)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("x")
    (tmp_path / "train.py").write_text("print(1)\n")
    monkeypatch.chdir(work)
    state = FolderState.take(str(work))
    copy = scratch.prepare(state, tmp_path / "scratch")
    assert copy.folder == str(tmp_path / "scratch")
    assert scratch.inside("../train.py", state, copy) == str(tmp_path / "train.py")
    assert scratch.inside("notes.txt", state, copy) == str(tmp_path / "scratch" / "notes.txt")
