"""The DALI GPU loader is used only after its self-check (`pfactory.prepare.loader`, path `dali.gpu_loader`).

No GPU here: the check itself (`check_gpu_loader`: the first batch of a small prepared shard written for
it, DALI vs the PyTorch loader on the CPU) is run with DALI's CPU pipeline, and the gate in `make_loader`
is exercised by registering, under the same path, a real check that applies to the CPU: DALI reading a
copy of the shard whose points are 1 cm off (a loader that returns wrong data) against the reference
reading the right one. It must be caught, said in one warning line naming the path and the figure, and
bypassed: `make_loader` hands out the PyTorch loader. The real GPU run: tests/prepare/test_loader.py's gpu
test and `factory doctor` on a GPU machine.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from kernels import selfcheck
from pfactory.prepare import loader
from pfactory.prepare.loader import (
    BATCH_ATOL,
    GPU_LOADER,
    DaliLoader,
    TorchLoader,
    check_batch,
    check_frames,
    check_gpu_loader,
    compare_batches,
    make_loader,
    write_prepared,
)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh verdict store; the real loader check registered again afterwards."""
    monkeypatch.setenv("PFK_SELFCHECK_DIR", str(tmp_path / "selfcheck"))
    selfcheck.forget()
    yield tmp_path / "selfcheck"
    selfcheck.register(loader.gpu_loader_check())
    selfcheck.forget()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "pfk.selfcheck" and r.levelno == logging.WARNING
    ]


def _planted(good: Path, bad: Path, name: str) -> selfcheck.Check:
    def run(device) -> dict[str, float]:
        return compare_batches(check_batch(bad, str(device), "dali"), check_batch(good, "cpu", "torch"))

    return selfcheck.Check(GPU_LOADER, run, lambda: name, ("cpu",), "planted: DALI on CPU vs the reference")


def test_the_check_passes_for_dali_and_skips_without_cuda() -> None:
    figures = check_gpu_loader(torch.device("cpu"))
    assert set(figures) == {"images", "proj", "cam_valid", "points", "num_points", "boxes", "labels",
                            "num_boxes", "aug"}  # fmt: skip
    assert all(v <= BATCH_ATOL.get(k, 0.0) for k, v in figures.items()), figures
    assert figures["images"] == 0.0 and figures["num_points"] == 0.0
    if not torch.cuda.is_available():
        with pytest.raises(selfcheck.Skip, match="no CUDA device"):
            check_gpu_loader(torch.device("cuda", 0))
        assert loader.gpu_loader_trusted("cpu")  # DALI's CPU pipeline is not what this check gates


def test_a_wrong_loader_is_caught_said_once_and_the_reference_used(tmp_path, store, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pfk.selfcheck")
    good = write_prepared(tmp_path / "good", check_frames())
    frames = check_frames()
    for f in frames:
        f.points[:, 0] += 0.01
    bad = write_prepared(tmp_path / "bad", frames)
    selfcheck.register(_planted(good, bad, "planted-wrong"))
    first = make_loader(good, "train", 2, backend="dali", device="cpu", workers=1)
    second = make_loader(good, "train", 2, backend="dali", device="cpu", workers=1)
    assert isinstance(first, TorchLoader) and isinstance(second, TorchLoader)
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"pfk self-check: {GPU_LOADER} on cpu: ")
    # 1 cm, scaled by the frame's augmentation
    assert re.search(
        r"FAILED \(points: max\|err\| 0\.01\d* > tol 2e-05\); using the reference path$", lines[0]
    )
    assert next(iter(first)).points.shape[0] == 2


def test_a_verified_loader_is_used(tmp_path, store) -> None:
    good = write_prepared(tmp_path / "good", check_frames())
    selfcheck.register(_planted(good, good, "planted-right"))
    assert isinstance(make_loader(good, "train", 2, backend="dali", device="cpu", workers=1), DaliLoader)
    assert selfcheck.used()[-1].status == selfcheck.VERIFIED
