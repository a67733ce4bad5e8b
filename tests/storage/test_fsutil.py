"""pfactory.storage.fsutil: owned output directories, stale temporary siblings, a full disk named."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pfactory.storage.fsutil import (
    OUTPUT_MARKER,
    OutputRefused,
    atomic_directory,
    atomic_write_bytes,
    check_output_dir,
    output_owner,
    raise_disk_full,
    remove_stale_temps,
)


def _build(path: Path, stage: str = "evaluate") -> None:
    with atomic_directory(path, stage=stage) as tmp:
        (tmp / "kpis.json").write_text("{}")


def test_new_empty_and_own_outputs_are_built_and_marked(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    _build(out)
    assert output_owner(out) == "evaluate" and (out / "kpis.json").is_file()
    _build(out)  # its own output: replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    _build(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "eval"]  # no temp left


@pytest.mark.parametrize(
    "kind, words",
    [
        ("user files", "did not write"),
        ("file", "not a directory"),
        ("symlink", "symbolic link"),
        ("other stage", "output of the prepare stage"),
        ("legacy with a user file", "did not write"),
    ],
)
def test_foreign_outputs_are_refused_and_kept(tmp_path: Path, kind: str, words: str) -> None:
    out = tmp_path / "out"
    if kind == "user files":
        out.mkdir()
        (out / "thesis.tex").write_text("mine")
    elif kind == "file":
        out.write_text("mine")
    elif kind == "symlink":
        (tmp_path / "target").mkdir()
        out.symlink_to(tmp_path / "target")
    elif kind == "other stage":
        out.mkdir()
        (out / OUTPUT_MARKER).write_text('{"stage": "prepare"}')
    else:
        out.mkdir()
        (out / "kpis.json").write_text("{}")
        (out / "notes.txt").write_text("mine")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(OutputRefused, match=words):
        _build(out)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_legacy_output_without_marker_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    (out / "report").mkdir(parents=True)
    (out / "kpis.json").write_text("{}")
    _build(out)
    assert output_owner(out) == "evaluate"


@pytest.mark.parametrize(
    "rel, words", [(".", "also an input"), ("sub", "inside the input"), ("..", "contains")]
)
def test_outputs_overlapping_an_input_are_refused(tmp_path: Path, rel: str, words: str) -> None:
    inp = tmp_path / "data" / "raw"
    inp.mkdir(parents=True)
    (inp / "frame.bin").write_bytes(b"x")
    with pytest.raises(OutputRefused, match=words):
        check_output_dir((inp / rel).resolve() if rel != "sub" else inp / "sub", "prepare", [inp])
    assert (inp / "frame.bin").read_bytes() == b"x"


def test_root_and_home_are_refused(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(OutputRefused, match="root of the file system"):
        check_output_dir("/", "prepare")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(OutputRefused, match="home directory"):
        check_output_dir(tmp_path, "prepare")


def test_stale_temps_of_dead_writers_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.pt"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    stale = tmp_path / f".checkpoint.pt.{pid}-abcd.tmp"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".checkpoint.pt.{os.getppid()}-abcd.tmp"  # a live process's temp stays
    live.write_bytes(b"being written")
    atomic_write_bytes(target, b"new", clean_stale=True)
    assert target.read_bytes() == b"new" and not stale.exists() and live.exists()
    assert remove_stale_temps(target) == []


def test_an_output_left_with_only_a_killed_writers_temp_is_replaced(tmp_path: Path) -> None:
    """`dvc exp run` removes a stage's outputs before it runs; a checkout killed mid-write left its temp in the
    directory: that debris does not make the directory foreign (a live writer's temp still does)."""
    out = tmp_path / "eval"
    out.mkdir()
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True).stdout)  # fmt: skip
    (out / f".kpis.json.{pid}.tmp").write_text("{}")
    _build(out)
    assert output_owner(out) == "evaluate"
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "kpis.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / f".kpis.json.{os.getppid()}-ab12.tmp").write_text("{}")  # a live process is writing it
    with pytest.raises(OutputRefused, match="did not write"):
        check_output_dir(other, "evaluate")


def test_a_full_disk_names_the_target(tmp_path: Path) -> None:
    err = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as info:
        raise_disk_full(err, tmp_path / "prepared")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "prepared")
    raise_disk_full(ValueError("not a disk"), tmp_path)  # anything else passes through
