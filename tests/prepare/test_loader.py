"""Train loader: DALI pipeline == PyTorch reference, exact resume, consistent augmentation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pfactory.prepare.augment import AugmentParams
from pfactory.prepare.loader import Batch, make_loader
from pfactory.prepare.shards import MANIFEST, SCHEMA_VERSION, PreparedFrame, SplitWriter, arrow_schema

FIELDS = ("images", "proj", "cam_valid", "points", "num_points", "boxes", "labels", "num_boxes", "aug")
# DALI's coord_transform computes in float32, the reference in float64 then rounds: points and
# boxes agree to ~1 ulp of their magnitude (< 1e-5 m); projections (entries ~1e3) to 3e-5.
ATOL = {"proj": 1e-4, "points": 2e-5, "boxes": 2e-5}


def _assert_batches_equal(a: Batch, b: Batch) -> None:
    assert a.frame_ids == b.frame_ids
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert x.shape == y.shape and x.dtype == y.dtype, (k, x.shape, y.shape, x.dtype, y.dtype)
        torch.testing.assert_close(x.cpu(), y.cpu(), atol=ATOL.get(k, 0.0), rtol=0, msg=k)


def test_dali_loader_equals_the_torch_reference(prepared_nuscenes: Path) -> None:
    kw = {"batch_size": 2, "shuffle": True, "augment": AugmentParams(), "seed": 3, "device": "cpu"}
    dali = make_loader(prepared_nuscenes, "train", workers=1, **kw)
    ref = make_loader(prepared_nuscenes, "train", backend="torch", **kw)
    n = dali.source.num_rows
    for epoch in range(2):
        a, b = list(dali), list(ref)
        assert len(a) == len(b) == len(dali) == -(-n // 2)
        for x, y in zip(a, b):
            _assert_batches_equal(x, y)
        ids = [f for x in a for f in x.frame_ids]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == n  # each frame once per epoch
        if epoch == 0:
            first = ids
    assert ids != first  # a new order in the next epoch
    x = a[0]
    B, C = x.images.shape[:2]
    assert C == 3 and x.images.dtype == torch.float32 and x.cam_valid.all()
    assert x.points.shape[0] == B and x.points.shape[2] == 4 and x.num_points.dtype == torch.int64
    assert (x.labels[torch.arange(x.labels.shape[1]) >= x.num_boxes[:, None]] == -1).all()


def test_set_epoch_and_skip_batches_resume_exactly(prepared_kitti: Path) -> None:
    kw = {
        "batch_size": 2,
        "shuffle": True,
        "augment": AugmentParams(),
        "seed": 11,
        "device": "cpu",
        "workers": 1,
    }
    full = make_loader(prepared_kitti, "train", **kw)
    full.set_epoch(4)
    expected = list(full)
    resumed = make_loader(prepared_kitti, "train", **kw)
    resumed.set_epoch(4)
    resumed.skip_batches(2)
    got = list(resumed)
    assert len(got) == len(expected) - 2
    for x, y in zip(got, expected[2:]):
        _assert_batches_equal(x, y)
    # The next epoch continues without a rebuild and matches a fresh loader's epoch 5.
    nxt = list(resumed)
    fresh = make_loader(
        prepared_kitti, "train", backend="torch", **{k: v for k, v in kw.items() if k != "workers"}
    )
    fresh.set_epoch(5)
    for x, y in zip(nxt, fresh):
        _assert_batches_equal(x, y)


def test_augmented_points_project_where_the_originals_did(prepared_kitti: Path) -> None:
    plain = next(iter(make_loader(prepared_kitti, "train", 3, backend="torch", device="cpu")))
    aug = next(
        iter(
            make_loader(prepared_kitti, "train", 3, augment=AugmentParams(), seed=1, device="cpu", workers=1)
        )
    )
    assert plain.frame_ids == aug.frame_ids
    assert not torch.allclose(plain.points, aug.points)
    for i in range(3):
        n = int(plain.num_points[i])
        p0 = torch.cat([plain.points[i, :n, :3].double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        p1 = torch.cat([aug.points[i, :n, :3].double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        uvw0 = p0 @ plain.proj[i, 0].double().T  # [n, 3]
        uvw1 = p1 @ aug.proj[i, 0].double().T
        front = uvw0[:, 2] > 1.0
        uv0 = uvw0[front, :2] / uvw0[front, 2:]
        uv1 = uvw1[front, :2] / uvw1[front, 2:]
        assert front.sum() > 100
        torch.testing.assert_close(uv1, uv0, atol=2e-3, rtol=0)  # float32 storage of points/P


def test_drop_last_and_unshuffled_order(prepared_kitti: Path) -> None:
    ld = make_loader(prepared_kitti, "train", 4, drop_last=True, backend="torch", device="cpu")
    batches = list(ld)
    n = ld.source.num_rows
    assert len(batches) == n // 4 and all(len(b.frame_ids) == 4 for b in batches)
    ids = [f for b in batches for f in b.frame_ids]
    assert ids == sorted(ids)  # shards keep dataset order within a split


def test_missing_cameras_are_flagged_invalid(tmp_path: Path) -> None:
    shape = (3, 4, 6)
    w = SplitWriter(tmp_path, "train", arrow_schema(shape), max_frames=10, row_group_frames=10)
    for i, cams in enumerate([["CAM_B"], ["CAM_A", "CAM_B"], []]):
        c = len(cams)
        w.add(
            PreparedFrame(
                f"f{i}", "train", "nuscenes", "0" * 64, np.eye(4), np.ones((5 + i, 4), np.float32), 9, cams,
                [np.full(shape, k + 1, np.float16) for k in range(c)], np.ones((c, 3, 4)), np.ones((c, 3, 3)),
                np.ones((c, 4, 4)), np.ones((c, 2), np.int32), np.ones((c, 2), np.int32), np.ones((c, 2)),
                np.zeros((0, 7), np.float32), np.zeros(0, np.int16), [], np.zeros(0, np.int8), np.zeros(0, np.int32),
            )
        )  # fmt: skip
    shards = w.close()
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "passed": True,
        "image": {"shape": list(shape)},
        "cameras": ["CAM_A", "CAM_B"],
        "classes": ["Car"],
        "splits": {"train": {"frames": 3, "shards": [{"file": s.file} for s in shards]}},
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    for backend in ("torch", "dali"):
        b = next(iter(make_loader(tmp_path, "train", 3, backend=backend, device="cpu", workers=1)))
        assert b.cam_valid.tolist() == [[False, True], [True, True], [False, False]]
        assert b.images[0, 0].abs().sum() == 0 and (b.images[0, 1] == 1).all()
        assert (b.images[1, 0] == 1).all() and (b.images[1, 1] == 2).all()
        assert b.num_boxes.tolist() == [0, 0, 0] and b.boxes.shape == (3, 0, 7)
        assert b.num_points.tolist() == [5, 6, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_batches_are_resident_and_equal_the_reference(prepared_nuscenes: Path) -> None:
    kw = {"batch_size": 2, "shuffle": True, "augment": AugmentParams(), "seed": 3}
    a = next(iter(make_loader(prepared_nuscenes, "train", device="cuda", **kw)))
    b = next(iter(make_loader(prepared_nuscenes, "train", backend="torch", device="cpu", **kw)))
    assert a.images.is_cuda and a.points.is_cuda and a.proj.is_cuda
    _assert_batches_equal(a, b)


def test_dali_loader_works_in_a_process_that_imported_dask_distributed(prepared_kitti: Path) -> None:
    """`import distributed` installs tblib's exception pickling; the DALI workers' end-of-epoch signal
    must still reach the parent (regression: the second epoch died with an UnpicklingError)."""
    code = (
        "import sys, distributed\n"
        "from pfactory.prepare.loader import make_loader\n"
        "loader = make_loader(sys.argv[1], 'train', batch_size=2, workers=1, device='cpu', backend='dali')\n"
        "print([len(list(loader)) for _ in range(2)])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(prepared_kitti)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    n = -(
        -make_loader(prepared_kitti, "train", batch_size=2, backend="torch", device="cpu").source.num_rows
        // 2
    )
    assert r.stdout.strip().splitlines()[-1] == f"[{n}, {n}]"
