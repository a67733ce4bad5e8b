"""The train stage (`tasks/train.py`) on real prepared data: synth -> prepare -> the stage's `run`
with the DALI loader, and `python -m tasks.train` (what dvc.yaml runs) with overrides. The trainer's
own tests (determinism, resume, DDP, tracking) are in tests/train/test_trainer.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def prepared_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real prepared directory: 15 synthetic frames (KITTI layout) through the prepare stage."""
    import tasks.prepare
    from flows.params import Params
    from pfactory.synth.dataset import generate_dataset

    root = tmp_path_factory.mktemp("synth")
    generate_dataset(root / "raw", frames=15, seed=3, workers=1)  # frame ids 13 and 14 hash into val
    tasks.prepare.run(Params(), root / "raw", root / "prepared", track=False)
    return root / "prepared"


TINY_OVERRIDES = [
    "model.painted_pillars.image_channels=8", "model.painted_pillars.point_channels=16", "model.painted_pillars.bev_channels=[16,16,32]", "model.painted_pillars.up_channels=16",
    "model.painted_pillars.head_channels=16", "train.epochs=1", "train.torch_threads=1", "train.loader_workers=1",
]  # fmt: skip


def test_train_on_prepared_synthetic_data_with_dali(prepared_synth: Path, tmp_path: Path) -> None:
    """The real chain: synth -> prepare -> `run` with the DALI shard loader -> outputs that load."""
    import tasks.train
    from flows.params import load_params
    from pfactory.detectors.io import load_model

    params = load_params(None, [*TINY_OVERRIDES, "train.loader=dali"])
    summary = tasks.train.run(params, prepared_synth, tmp_path / "model", track=False, progress=False)
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"])  # 13 train frames, batch 4
    assert summary["val"]["classes"].keys() == {"Car", "Pedestrian", "Cyclist"}
    _model, config = load_model(tmp_path / "model")
    assert config["image_size"] == params.prepare.image_size and config["cameras"] == ["image_2"]


def test_dvc_entry_point_trains_with_overrides(prepared_synth: Path, tmp_path: Path, capsys) -> None:
    """`python -m tasks.train --data D --out O -S ...` (what dvc.yaml runs), PyTorch loader, no tracking."""
    import tasks.train

    argv = ["--data", str(prepared_synth), "--out", str(tmp_path / "model"), "--params", str(tmp_path / "none.yaml"),
            "--no-track", *[a for o in [*TINY_OVERRIDES, "train.loader=torch"] for a in ("-S", o)]]  # fmt: skip
    tasks.train.main(argv)
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 4 and (tmp_path / "model" / "model.pt").is_file()
    with pytest.raises(SystemExit) as e:
        tasks.train.main([*argv, "-S", "train.lr=-1"])
    assert e.value.code == 2  # a bad parameter is a usage error naming the key
