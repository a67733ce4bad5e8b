"""Raw datasets the prepare benchmarks run on (bench_prepare.py, prepare_scaleout.py import it by name: a
script's folder is first on sys.path): the real KITTI / nuScenes sample frames replicated to `frames`
(PFACTORY_REAL_DATA, default ../shared/data/real), else synthetic stand-ins with their formats and sizes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `tests.conftest` builds the nuScenes tables around the real files


def build_datasets(work: Path, frames: int) -> dict[str, Path]:
    """{"png": KITTI layout, "jpeg": nuScenes layout}, `frames` frames each (symlinked)."""
    from pfactory.prepare.replicate import replicate_kitti, replicate_nuscenes

    real = Path(os.environ.get("PFACTORY_REAL_DATA", ROOT.parent / "shared/data/real"))
    out = {}
    if (real / "kitti/training/velodyne").is_dir() and (real / "nuscenes/mmdet3d_derived").is_dir():
        from tests.conftest import DEMO_TOKEN, build_nuscenes_tables

        out["png"] = replicate_kitti(real / "kitti", work / "kitti", frames)
        base = build_nuscenes_tables(real / "nuscenes", work / "nuscenes_base")
        out["jpeg"] = replicate_nuscenes(base.root, work / "nuscenes", frames, samples=[DEMO_TOKEN])
    else:  # synthetic stand-ins with the real formats and sizes
        from pfactory.synth.dataset import generate_dataset

        generate_dataset(work / "synth_kitti", frames=8, seed=0, cameras=1, image_size=(1242, 375))
        generate_dataset(work / "synth_nus", frames=4, seed=0, cameras=6, image_size=(1600, 900))
        out["png"] = replicate_kitti(work / "synth_kitti", work / "kitti", frames)
        out["jpeg"] = replicate_nuscenes(work / "synth_nus", work / "nuscenes", frames)
    return out
