"""One-line errors instead of tracebacks: each of these once printed a raw traceback (or the wrong reason).

A truncated or planted checkpoint (and never torch's advice to retry with `weights_only=False`), a missing
or wrong model directory, a raw dataset where prepared data is expected, a directory where a file is
expected, a diverging run -- each is one line naming the file and an exit code, nothing else.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.faults.conftest import SMALL_PREPARE, TINY_TRAIN, copy_dataset, factory, one_line_error, overrides

PREPARE = [*SMALL_PREPARE, *overrides("prepare.val_fraction=0.34")]
TRAIN = TINY_TRAIN


@pytest.fixture(scope="module")
def prepared(clean_kitti: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("errors") / "prepared"
    r = factory("prepare", "--raw", str(clean_kitti), "--out", str(out), *PREPARE)
    assert r.code == 0, r.text
    return out


class Planted:
    """`__reduce__` runs `touch <marker>` when unpickled: a proof that nothing executed it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def malicious_pickle(marker: Path) -> bytes:
    return pickle.dumps({"model": Planted(marker)})


def _record(ledger, case: str, r, words: str, extra_ok: bool = True) -> None:
    ok = one_line_error(r) and words in r.text and "weights_only=False" not in r.text and extra_ok
    ok = ok and len(r.err.strip().splitlines()) <= 3
    ledger.record("errors", case, ok, detail=r.err.strip()[:200])
    assert ok, r.text[-2000:]


def _config(model: Path, fmt: int) -> None:
    doc = {"format": fmt, "arch": "painted_pillars", "plugin": None, "model": {}, "image_size": [104, 32],
           "classes": ["Car"], "pc_range": [0.0, -40.0, -3.0, 70.4, 40.0, 1.0], "cameras": ["image_2"]}  # fmt: skip
    (model / "model_config.json").write_text(json.dumps(doc))


def test_truncated_checkpoint(prepared: Path, tmp_path: Path, ledger) -> None:
    import torch

    out = tmp_path / "model"
    out.mkdir()
    path = out / "checkpoint.pt"
    torch.save({"format": 1, "model": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:300])
    r = factory("train", "--data", str(prepared), "--out", str(out), *TRAIN)
    _record(
        ledger, "train resuming a truncated checkpoint.pt", r, "checkpoint.pt: not a readable PyTorch file"
    )


def test_malicious_checkpoint(prepared: Path, tmp_path: Path, ledger) -> None:
    out = tmp_path / "model"
    out.mkdir()
    marker = tmp_path / "PWNED"
    (out / "checkpoint.pt").write_bytes(malicious_pickle(marker))
    r = factory("train", "--data", str(prepared), "--out", str(out), *TRAIN)
    _record(ledger, "train resuming a malicious checkpoint.pt", r, "refused", not marker.exists())


def test_optimize_model_missing(prepared: Path, tmp_path: Path, ledger) -> None:
    r = factory(
        "optimize", "--model", str(tmp_path / "nope"), "--data", str(prepared), "--out", str(tmp_path / "o")
    )
    _record(ledger, "optimize --model <missing dir>", r, "nope: missing")


def test_optimize_model_is_a_file(prepared: Path, tmp_path: Path, ledger) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    r = factory("optimize", "--model", str(f), "--data", str(prepared), "--out", str(tmp_path / "o"))
    _record(ledger, "optimize --model <a file>", r, "not a directory")


def test_optimize_weights_are_a_directory(prepared: Path, tmp_path: Path, ledger) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.pt").mkdir()
    from pfactory.detectors.io import CONFIG_FORMAT

    _config(model, CONFIG_FORMAT)
    r = factory("optimize", "--model", str(model), "--data", str(prepared), "--out", str(tmp_path / "o"))
    _record(ledger, "optimize --model <model.pt is a directory>", r, "is a directory")


def test_optimize_malicious_weights(prepared: Path, tmp_path: Path, ledger) -> None:
    model = tmp_path / "model"
    model.mkdir()
    marker = tmp_path / "PWNED"
    (model / "model.pt").write_bytes(malicious_pickle(marker))
    from pfactory.detectors.io import CONFIG_FORMAT

    _config(model, CONFIG_FORMAT)
    r = factory("optimize", "--model", str(model), "--data", str(prepared), "--out", str(tmp_path / "o"))
    _record(ledger, "optimize --model <a malicious model.pt>", r, "refused", not marker.exists())


def test_train_on_a_raw_dataset(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    raw = copy_dataset(clean_kitti, tmp_path / "raw")
    r = factory("train", "--data", str(raw), "--out", str(tmp_path / "model"), *TRAIN)
    _record(ledger, "train --data <a raw dataset>", r, "raw dataset")


def test_train_lr_that_diverges(prepared: Path, tmp_path: Path, ledger) -> None:
    """A finite but absurd learning rate: the run stops at the first non-finite loss, no model is written."""
    out = tmp_path / "model"
    r = factory(
        "train",
        "--data",
        str(prepared),
        "--out",
        str(out),
        *TRAIN,
        "-S",
        "train.lr=1e30",
        "-S",
        "train.epochs=3",
    )
    _record(ledger, "train -S train.lr=1e30 (diverges)", r, "diverged", not (out / "model.pt").exists())


def test_data_check_on_a_file(tmp_path: Path, ledger) -> None:
    f = tmp_path / "data.bin"
    f.write_bytes(b"x")
    r = factory("data", "check", str(f))
    _record(ledger, "data check <a file>", r, "an existing directory")


def test_stale_checkpoint_temp_of_a_killed_writer_is_removed(prepared: Path, tmp_path: Path, ledger) -> None:
    """A train killed while writing checkpoint.pt leaves `.checkpoint.pt.<pid>-<random>.tmp` (7 MB with the
    default model); the next `factory train --out` into the same directory removes it."""
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    out = tmp_path / "model"
    out.mkdir()
    stale = out / f".checkpoint.pt.{dead.stdout.strip()}-0a1b2c3d.tmp"
    stale.write_bytes(b"\0" * 1_000_000)
    r = factory("train", "--data", str(prepared), "--out", str(out), *TRAIN, "-S", "train.max_steps=1")
    ok = r.code == 0 and not stale.exists() and (out / "model.pt").is_file()
    ledger.record("crash", "stale checkpoint temp left by a killed train, then train --out again", ok,
                  detail="removed by the next checkpoint write" if ok else r.text[-200:])  # fmt: skip
    assert ok, r.text[-2000:]
