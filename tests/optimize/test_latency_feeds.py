"""The optimize stage's latency frames are its parity frames rebatched (`calibration.rebatch`): the same
arrays `load_feeds` reads at that batch size, without reading and decoding the frames again."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """12 synthetic frames (KITTI layout, 208x64 images) prepared into small shards (~9 train frames)."""
    from pfactory.prepare.stage import prepare_dataset
    from pfactory.synth.dataset import generate_dataset
    from tests.prepare.conftest import small_params

    root = tmp_path_factory.mktemp("rebatch")
    generate_dataset(root / "raw", frames=12, seed=7, cameras=1, image_size=(208, 64))
    prepare_dataset(root / "raw", root / "prepared", small_params())
    return root / "prepared"


@pytest.mark.parametrize(("batch", "frames"), [(4, 8), (3, 7), (1, 4)])
def test_rebatched_parity_frames_equal_the_loaders_batches(prepared, batch, frames):
    from pfactory.optimize.calibration import load_feeds, rebatch

    single = load_feeds(prepared, "train", 1, 8, num_threads=1)
    assert single.num_frames == 8, "the fixture needs 8 train frames"
    got = rebatch(single, batch, frames)
    want = load_feeds(prepared, "train", batch, frames, num_threads=1)
    assert got is not None
    assert got.frame_ids == want.frame_ids
    assert len(got.feeds) == len(want.feeds)
    sizes = {int(f["num_points"].max()) for f in want.feeds}
    assert len(sizes) > 1 or batch == 1, "frames of different point counts exercise the padding"
    for a, b in zip(got.feeds, want.feeds):
        assert sorted(a) == sorted(b)
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_rebatch_refuses_what_it_cannot_rebuild(prepared):
    from pfactory.optimize.calibration import load_feeds, rebatch

    single = load_feeds(prepared, "train", 1, 4, num_threads=1)
    assert rebatch(single, 4, 8) is None  # fewer frames than asked: read them
    pairs = load_feeds(prepared, "train", 2, 4, num_threads=1)
    assert rebatch(pairs, 4, 4) is None  # not one frame per feed
