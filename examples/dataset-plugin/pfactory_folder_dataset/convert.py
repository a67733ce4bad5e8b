"""Write the folder-per-frame layout from any dataset the factory reads (KITTI, nuScenes, the synthetic data,
another plugin's): `convert(src, out, frames=None)` or `pfactory-folder-convert SRC OUT [--frames N]`.

Per frame (its reader's `Frame`, already in the lidar frame): the points as `lidar.npy` (float32 [N, 4],
intensity in [0, 1] as every reader returns it), the first camera's image as `camera.jpg` (a JPEG source is
copied byte for byte, any other is re-encoded at quality 95), its `K` and `T_cam_from_lidar` as `calib.json`
and the boxes with their class names as `labels.json`. Each file is written atomically. KITTI's DontCare
regions and 2D boxes have no place in this layout and are dropped.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from pfactory.sensors.frame import Frame
from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_text


def _jpeg(path: Path) -> bytes:
    data = Path(path).read_bytes()
    if data[:3] == b"\xff\xd8\xff":
        return data
    from PIL import Image

    buf = io.BytesIO()
    with Image.open(io.BytesIO(data)) as im:
        im.convert("RGB").save(buf, "JPEG", quality=95)
    return buf.getvalue()


def write_frame(folder: Path, frame: Frame) -> None:
    """Write one `Frame` (lidar frame, >= 1 camera) as `folder/{lidar.npy, camera.jpg, calib.json, labels.json}`."""
    if not frame.cameras:
        raise ValueError(f"frame {frame.frame_id}: the folder layout needs a camera, the frame has none")
    cam = frame.cameras[0]
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(frame.points, dtype=np.float32).reshape(-1, 4), allow_pickle=False)
    atomic_write_bytes(folder / "lidar.npy", buf.getvalue())
    atomic_write_bytes(folder / "camera.jpg", _jpeg(Path(cam.image_path)))
    calib = {"intrinsics": np.asarray(cam.K).tolist(), "lidar_to_camera": np.asarray(cam.T_cam_from_lidar).tolist()}
    atomic_write_text(folder / "calib.json", json.dumps(calib, indent=1) + "\n")
    labels = [{"name": str(n), "box": [float(v) for v in b]} for n, b in zip(frame.boxes.names, frame.boxes.boxes)]
    atomic_write_text(folder / "labels.json", json.dumps(labels, indent=1) + "\n")


def convert(src: str | Path, out: str | Path, frames: int | None = None) -> Path:
    """Every frame of the dataset `src` (any layout `open_dataset` reads; the first `frames` when given) as
    a folder `out/<frame_id>/`. Raises the reader's `DatasetError` for a frame it cannot read. Returns `out`."""
    from pfactory.sensors.datasets import open_dataset

    ds = open_dataset(src)
    out = Path(out)
    for fid in ds.frame_ids()[:frames]:
        write_frame(out / fid, ds.read(fid))
    return out


def main(argv: list[str] | None = None) -> None:
    """`pfactory-folder-convert SRC OUT [--frames N]` (also `python -m pfactory_folder_dataset.convert`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a dataset the factory reads (any registered layout)")
    ap.add_argument("out", type=Path, help="the folder-per-frame dataset to write")
    ap.add_argument("--frames", type=int, default=None, help="only the first N frames")
    a = ap.parse_args(argv)
    convert(a.src, a.out, a.frames)
    print(f"{a.out}: {len([d for d in a.out.iterdir() if d.is_dir()])} frames")


if __name__ == "__main__":
    main()
