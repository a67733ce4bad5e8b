"""Fixtures for the data-layer tests: small synthetic datasets and their prepared shards.

Synthetic frames come from `pfactory.synth` at a reduced image size (208x64, KITTI's
aspect) so a dataset builds in ~1 s; the real frames come from tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pfactory.prepare.params import PrepareParams

# Tiny model input for tests: DALI's work scales with the *input* image, and 104x32 keeps
# every shard small; the geometry is checked at this size too.
TEST_IMAGE_SIZE = [104, 32]


def small_params(**overrides) -> PrepareParams:
    """Prepare params for tests: tiny images, small batches and shards, everything kept."""
    base = {
        "image_size": TEST_IMAGE_SIZE,
        "batch_size": 4,
        "shard_max_frames": 4,
        "val_fraction": 0.25,
        "max_reject_fraction": 0.5,
    }
    return PrepareParams(**{**base, **overrides})


@pytest.fixture(scope="session")
def synth_kitti(tmp_path_factory) -> Path:
    """10 synthetic frames in the KITTI layout (images 208x64)."""
    from pfactory.synth.dataset import generate_dataset

    out = tmp_path_factory.mktemp("synth") / "kitti"
    generate_dataset(out, frames=10, seed=3, cameras=1, image_size=(208, 64))
    return out


@pytest.fixture(scope="session")
def synth_nuscenes(tmp_path_factory) -> Path:
    """6 synthetic frames in the nuScenes layout with 3 cameras (images 208x64)."""
    from pfactory.synth.dataset import generate_dataset

    out = tmp_path_factory.mktemp("synth") / "nuscenes"
    generate_dataset(out, frames=6, seed=5, cameras=3, image_size=(208, 64))
    return out


@pytest.fixture(scope="session")
def prepared_kitti(synth_kitti, tmp_path_factory) -> Path:
    from pfactory.prepare.stage import prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "kitti"
    prepare_dataset(synth_kitti, out, small_params())
    return out


@pytest.fixture(scope="session")
def prepared_nuscenes(synth_nuscenes, tmp_path_factory) -> Path:
    from pfactory.prepare.stage import prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "nuscenes"
    prepare_dataset(synth_nuscenes, out, small_params(pc_range=[-50.0, -50.0, -3.0, 50.0, 50.0, 1.0]))
    return out
