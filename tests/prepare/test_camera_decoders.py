"""prepare where NVIDIA DALI is not installed: the Pillow decoder, said once, recorded, within tolerance.

DALI is hidden from a subprocess (`sys.modules["nvidia.dali"] = None`: every `import nvidia.dali` fails as
on macOS or Linux on ARM); the same raw frames prepared here with DALI give the reference shards. The
tolerance is the one of `pil_reference` (docs/DATA.md, "DALI vs PIL + NumPy"): the decoders agree exactly,
the resize filters within 1.1 grey levels away from the image border and up to 24 on its outermost
row/column. Everything but the images is the same bytes' worth of values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pfactory.prepare.camera import PillowCamera, dali_available
from pfactory.prepare.params import PrepareParams
from pfactory.prepare.stage import prepare_dataset
from tests.prepare.conftest import small_params

ROOT = Path(__file__).resolve().parents[2]
HIDE_DALI = "import sys; sys.modules['nvidia.dali'] = None\n"
STD = np.asarray(PrepareParams().image_std, dtype=np.float32)
STD_FLAT = np.repeat(STD, 128 * 416)  # per value of a flattened [3, 128, 416] image


def _prepare_without_dali(raw: Path, out: Path, params: PrepareParams) -> subprocess.CompletedProcess:
    code = HIDE_DALI + (
        "import json, sys\n"
        "from pfactory.prepare.params import PrepareParams\n"
        "from pfactory.prepare.stage import prepare_dataset\n"
        "params = PrepareParams(**json.loads(sys.argv[3]))\n"
        "prepare_dataset(sys.argv[1], sys.argv[2], params)\n"
    )
    args = [sys.executable, "-c", code, str(raw), str(out), params.model_dump_json()]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)


def _images(prepared: Path) -> dict[str, np.ndarray]:
    """frame id -> its camera images [C, 3 * H * W] float16 (stored as raw bytes), over every shard."""
    out = {}
    for shard in sorted(prepared.glob("*/shard-*.parquet")):
        table = pq.read_table(shard).to_pylist()
        for row in table:
            out[row["frame_id"]] = np.stack([np.frombuffer(b, dtype=np.float16) for b in row["cam_image"]])
    return out


def _other_columns(prepared: Path) -> dict[str, list]:
    return {
        shard.relative_to(prepared).as_posix(): pq.read_table(shard).drop(["cam_image"]).to_pylist()
        for shard in sorted(prepared.glob("*/shard-*.parquet"))
    }


@pytest.mark.skipif(not dali_available(), reason="the reference shards need DALI")
def test_prepare_without_dali_uses_pillow_within_the_documented_tolerance(
    real_kitti_dir: Path, tmp_path: Path
) -> None:
    params = small_params(image_size=[416, 128])
    with_dali, without = tmp_path / "dali", tmp_path / "pillow"
    prepare_dataset(real_kitti_dir, with_dali, params)
    res = _prepare_without_dali(real_kitti_dir, without, params)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("prepare: camera decoder")]
    assert said == [
        "prepare: camera decoder pillow (NVIDIA DALI is not installed here; its pixels vs DALI: docs/GPU.md)"
    ]
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (with_dali, without)]
    assert manifests[0]["image"]["decoder"] == "dali-cpu" and manifests[1]["image"]["decoder"] == "pillow"
    assert _other_columns(with_dali) == _other_columns(without)
    a, b = _images(with_dali), _images(without)
    assert sorted(a) == sorted(b) and len(a) == 6
    diff = {k: np.abs(a[k].astype(np.float32) - b[k].astype(np.float32)) * 255 * STD_FLAT for k in a}
    levels = np.concatenate([d.ravel() for d in diff.values()])
    # inside the image's border: KITTI's 1242 x 375 resized to 416 x 126 (then padded to 128 rows)
    inner = np.concatenate([d.reshape(-1, 3, 128, 416)[..., 1:125, 1:415].ravel() for d in diff.values()])
    differing = sum(int((a[k].view(np.uint16) != b[k].view(np.uint16)).sum()) * 2 for k in a)
    print(
        f"pillow vs DALI: max {levels.max():.2f} grey levels, inside the border {inner.max():.2f}, mean "
        f"{levels.mean():.3f}; {differing} of {levels.size * 2} image bytes differ"
    )
    assert levels.max() <= 24.5 and inner.max() <= 1.1 and levels.mean() < 0.2


def test_an_image_pillow_cannot_decode_fails_its_batch_and_is_named_alone(real_kitti_dir: Path) -> None:
    good = next((real_kitti_dir / "training" / "image_2").glob("*.png")).read_bytes()
    camera = PillowCamera((104, 32), [0.5] * 3, [0.25] * 3, 4, 2, "cpu")
    out = camera.run([good, good], [(32, 104), (32, 104)])
    assert out.images.shape == (2, 3, 32, 104) and out.images.dtype == np.float16
    assert out.decoded_hw.tolist() == [[375, 1242], [375, 1242]]
    results = camera.run_each([good, good[: len(good) // 3]], [(32, 104), (32, 104)])
    assert not isinstance(results[0], str)
    assert isinstance(results[1], str) and results[1].startswith("Pillow decode failed: ")


def test_gpu_is_refused_in_one_line_without_dali() -> None:
    code = HIDE_DALI + (
        "from pfactory.prepare.camera import decoder_name, open_camera\n"
        "print(decoder_name('auto'))\n"
        "try:\n    open_camera((104, 32), [0.5] * 3, [0.25] * 3, 4, 1, 'gpu')\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.stdout.splitlines() == [
        "pillow",
        "prepare.device = gpu, but NVIDIA DALI is not installed here (use auto or cpu)",
    ]
