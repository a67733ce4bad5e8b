"""Hostile parameters and paths: every one refused in one line naming the file or key, nothing deleted.

Parameters: a params.yaml that is not YAML, not UTF-8, a directory, an alias bomb (bounded in memory and time,
and the message never prints the expansion), wrong types, non-finite values, absurd sizes and thread counts.
Paths: `--out` on the user's own files, a regular file, a symlink, `/`, the home directory, a mount point,
the input itself, inside the input or around it; `--raw` a file; frame ids that are paths.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.faults.conftest import SMALL_PREPARE, copy_dataset, factory, factory_subprocess, one_line_error

BOMB = "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['x'] * 9)}]\n"
    for p, c in zip(["", *"abcdefgh"], "abcdefghi")
)  # 9 lines, ~350 bytes: 9^9 = 387 million strings once expanded


def tree_digest(root: Path) -> str:
    """sha256 over every path and file content under `root` (symlinks by target)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


PARAM_FILES = {
    "params-not-yaml": ("train: [unclosed\n", "not valid YAML (line 2"),
    "params-not-utf8": (b"train:\n  lr: \xff\xfe\n", "not UTF-8"),
    "params-top-level-list": ("- train\n- lr\n", "mapping of sections"),
    "params-wrong-type-lr": ("train:\n  lr: fast\n", "train.lr"),
    "params-wrong-type-section": ("prepare: [1, 2]\n", "prepare"),
    "params-float-epochs": ("train:\n  epochs: 1.5\n", "train.epochs"),
    "params-unknown-key": ("train:\n  learning_rate: 1\n", "train.learning_rate: unknown key"),
    "params-inf-lr": ("train:\n  lr: .inf\n", "train.lr: expected a finite number"),
}


@pytest.mark.parametrize("name", sorted(PARAM_FILES))
def test_hostile_params_file(name: str, tmp_path: Path, ledger) -> None:
    text, words = PARAM_FILES[name]
    path = tmp_path / "params.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = factory("params", "--params", str(path))
    ok = r.code == 2 and one_line_error(r) and words in r.err and len(r.err.strip().splitlines()) <= 3
    ledger.record("params", name, ok, detail=r.err.strip()[:160])
    assert ok, r.text


OVERRIDES = {
    "override-lr-inf": ("train.lr=.inf", "train.lr: expected a finite number"),
    "override-lr-nan": ("train.lr=.nan", "train.lr: expected a finite number"),
    "override-image-size-100000": ("prepare.image_size=[100000,100000]", "prepare.image_size"),
    "override-num-threads-100000": (
        "prepare.num_threads=100000",
        "prepare.num_threads: expected at most 256",
    ),
    "override-workers-100000": ("evaluate.workers=100000", "evaluate.workers: expected at most 256"),
    "override-alias-bomb": ("train.lr=" + "[" + BOMB.replace("\n", ",") + "]", "YAML"),
    "override-not-a-section": ("train=3", "train: expected a valid dictionary"),
    "override-bad-yaml": ("train.lr=[1,", "not valid YAML"),
}


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_hostile_override(name: str, ledger) -> None:
    override, words = OVERRIDES[name]
    r = factory("params", "-S", override)
    ok = r.code == 2 and one_line_error(r) and words in r.err and len(r.err) < 600
    ledger.record("params", name, ok, detail=r.err.strip()[:160])
    assert ok, r.text[:2000]


def test_alias_bomb_is_bounded_and_not_printed(tmp_path: Path, ledger) -> None:
    """A ~350-byte alias bomb (387 million values expanded) as params.yaml: refused in seconds, in little
    memory, and the message is one line that does not print the expansion (it once printed it, using GBs)."""
    path = tmp_path / "params.yaml"
    path.write_text(BOMB)
    proc, seconds, peak_mib = factory_subprocess("params", "--params", str(path), timeout=120)
    ok = proc.returncode == 2 and seconds < 60 and peak_mib < 600 and len(proc.stderr) < 600
    ok = ok and "alias" in proc.stderr and "Traceback" not in proc.stderr
    ledger.record("input/memory", "params-alias-bomb", ok,
                  detail=f"exit {proc.returncode} in {seconds:.1f} s, peak {peak_mib:.0f} MiB: {proc.stderr.strip()[:120]}")  # fmt: skip
    assert ok, (proc.returncode, seconds, peak_mib, proc.stderr[:1000])


# ---------------------------------------------------------------------------------------------------------
# --out / --raw


@pytest.fixture
def raw(clean_kitti: Path, tmp_path: Path) -> Path:
    return copy_dataset(clean_kitti, tmp_path / "raw")


PREPARE = SMALL_PREPARE


def _user_dir(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "thesis.tex").write_text("\\documentclass{article} six months of work")
    (path / "sub" / "results.csv").write_text("a,b\n1,2\n")
    return path


def _out_case(name: str, stage_args: list[str], out: Path, protect: list[Path], ledger, words: str) -> None:
    before = {p: tree_digest(p) if p.is_dir() else p.read_bytes() for p in protect}
    r = factory(*stage_args, "--out", str(out))
    after = {p: tree_digest(p) if p.is_dir() else p.read_bytes() for p in protect}
    lost = sum(before[p] != after[p] for p in protect)
    ok = r.code == 2 and one_line_error(r) and words in r.err and lost == 0
    ledger.record("paths", name, ok, lost=lost, detail=r.err.strip()[:200])
    assert ok, (r.text[-1500:], lost)


def test_prepare_out_on_user_files(raw: Path, tmp_path: Path, ledger) -> None:
    out = _user_dir(tmp_path / "mine")
    _out_case("prepare --out <user's non-empty dir>", ["prepare", "--raw", str(raw), *PREPARE], out, [out, raw],
              ledger, "did not write")  # fmt: skip


@pytest.mark.parametrize("stage", ["optimize", "evaluate"])
def test_optimize_evaluate_out_on_user_files(stage: str, tmp_path: Path, ledger) -> None:
    out = _user_dir(tmp_path / "mine")
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    _out_case(f"{stage} --out <user's non-empty dir>", [stage, "--model", str(model), "--data", str(data)], out,
              [out], ledger, "did not write")  # fmt: skip


def test_prepare_out_is_a_file(raw: Path, tmp_path: Path, ledger) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    _out_case("prepare --out <a regular file>", ["prepare", "--raw", str(raw), *PREPARE], out, [out], ledger,
              "not a directory")  # fmt: skip


def test_prepare_out_is_a_symlink(raw: Path, tmp_path: Path, ledger) -> None:
    target = _user_dir(tmp_path / "mine")
    out = tmp_path / "link"
    out.symlink_to(target)
    _out_case("prepare --out <a symlink>", ["prepare", "--raw", str(raw), *PREPARE], out, [target], ledger,
              "symbolic link")  # fmt: skip


def test_prepare_out_root(raw: Path, ledger) -> None:
    _out_case("prepare --out /", ["prepare", "--raw", str(raw), *PREPARE], Path("/"), [raw], ledger,
              "root of the file system")  # fmt: skip


def test_prepare_out_home(raw: Path, tmp_path: Path, monkeypatch, ledger) -> None:
    home = _user_dir(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    _out_case("prepare --out $HOME", ["prepare", "--raw", str(raw), *PREPARE], home, [home, raw], ledger,
              "home directory")  # fmt: skip


def test_prepare_raw_equals_out(raw: Path, ledger) -> None:
    _out_case("prepare --raw X --out X", ["prepare", "--raw", str(raw), *PREPARE], raw, [raw], ledger,
              "also an input")  # fmt: skip


def test_prepare_out_inside_raw(raw: Path, ledger) -> None:
    _out_case("prepare --out X/training", ["prepare", "--raw", str(raw), *PREPARE], raw / "training", [raw],
              ledger, "inside the input")  # fmt: skip


def test_prepare_out_contains_raw(raw: Path, ledger) -> None:
    _out_case("prepare --out <parent of the raw dataset>", ["prepare", "--raw", str(raw), *PREPARE], raw.parent,
              [raw], ledger, "contains the input")  # fmt: skip


def test_optimize_out_equals_model(tmp_path: Path, ledger) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.pt").write_bytes(b"weights")
    data = tmp_path / "data"
    data.mkdir()
    _out_case("optimize --out <its --model>", ["optimize", "--model", str(model), "--data", str(data)], model,
              [model], ledger, "also an input")  # fmt: skip


def test_prepare_out_other_stage_output(raw: Path, tmp_path: Path, ledger) -> None:
    from pfactory.storage.fsutil import mark_output

    out = tmp_path / "optimized"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"onnx")
    mark_output(out, "optimize")
    _out_case("prepare --out <optimize's output>", ["prepare", "--raw", str(raw), *PREPARE], out, [out], ledger,
              "output of the optimize stage")  # fmt: skip


def test_prepare_rerun_into_own_output_and_empty_dir(raw: Path, tmp_path: Path, ledger) -> None:
    """What must keep working: an empty directory, and the stage's own earlier output, are replaced."""
    out = tmp_path / "prepared"
    out.mkdir()
    first = factory("prepare", "--raw", str(raw), "--out", str(out), *PREPARE)
    second = factory("prepare", "--raw", str(raw), "--out", str(out), *PREPARE)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    ok = first.code == 0 and second.code == 0 and (out / "manifest.json").is_file() and not leftovers
    ledger.record("paths", "prepare --out <empty dir>, then its own output again", ok, detail="replaced")
    assert ok, (first.text[-800:], second.text[-800:], leftovers)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    return r.returncode == 0


def test_prepare_out_mount_point(raw: Path, tmp_path: Path, ledger) -> None:
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "8m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        (mnt / "keep.txt").write_text("x")
        _out_case("prepare --out <a mount point>", ["prepare", "--raw", str(raw), *PREPARE], mnt, [mnt], ledger,
                  "mount point")  # fmt: skip
        (mnt / "keep.txt").unlink()
        _out_case("prepare --out <an empty mount point>", ["prepare", "--raw", str(raw), *PREPARE], mnt, [], ledger,
                  "mount point")  # fmt: skip
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_data_show_frame_id_is_not_a_path(raw: Path, tmp_path: Path, ledger) -> None:
    for fid in ("../../etc/passwd", "../training/velodyne/000001", "/etc/passwd"):
        r = factory("data", "show", str(raw), fid, "--out", str(tmp_path / "f.png"))
        ok = r.code == 1 and one_line_error(r) and "frame id" in r.err and not (tmp_path / "f.png").exists()
        ledger.record("paths", f"data show DIR {fid}", ok, detail=r.err.strip()[:160])
        assert ok, r.text


def test_raw_is_not_a_dataset(tmp_path: Path, ledger) -> None:
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    for name, raw_path in (("a file", f), ("missing", tmp_path / "nope"), ("an empty dir", tmp_path)):
        r = factory("prepare", "--raw", str(raw_path), "--out", str(tmp_path / "out"), *PREPARE)
        ok = r.code == 1 and one_line_error(r) and str(raw_path) in r.err
        ledger.record("paths", f"prepare --raw <{name}>", ok, detail=r.err.strip()[:160])
        assert ok, r.text
