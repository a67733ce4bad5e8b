"""File readers every dataset layout shares: float32 point files, image headers, image decode.

Each raises `DatasetError` naming the file and what was expected. Layout-specific parsing (KITTI
calib/labels, nuScenes tables) stays with its reader.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from pfactory.sensors.errors import DatasetError, error_text

# At most this many points in one sweep (a 128-beam lidar returns ~0.3 M; 10 M is far beyond any sensor).
# A bigger file is refused from its size before it is read, so memory stays bounded (a 2 GB sparse file).
MAX_POINTS = 10_000_000


def max_point_bytes(dims: int) -> int:
    """The largest point file of `dims` float32 columns accepted (`MAX_POINTS` records)."""
    return MAX_POINTS * dims * 4


def decode_image(data: bytes, path: str | Path = "<bytes>") -> np.ndarray:
    """Decode PNG/JPEG bytes into `[H, W, 3]` uint8 RGB, fully (truncation is an error)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # PIL raises several types for corrupt data
        raise DatasetError(path, "image", f"a decodable PNG/JPEG image ({error_text(e)})") from e


def read_points(path: str | Path, dims: int = 4) -> np.ndarray:
    """Read a float32 point file `[N, dims]`; DatasetError on empty, ragged or non-finite data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_point_bytes(dims):
            raise DatasetError(
                path,
                "points",
                f"a lidar sweep of at most {MAX_POINTS} points (float32 x{dims}), got {size} bytes",
            )
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(path, "points", f"a readable file ({error_text(e)})") from e
    if len(raw) == 0:
        raise DatasetError(path, "points", f"float32 x{dims} records, got an empty file")
    if len(raw) % (4 * dims):
        raise DatasetError(
            path, "points", f"a size that is a multiple of {4 * dims} bytes (float32 x{dims}), got {len(raw)}"
        )
    pts = np.frombuffer(raw, dtype=np.float32).reshape(-1, dims)
    if not np.all(np.isfinite(pts)):
        bad = int((~np.isfinite(pts)).any(1).sum())
        raise DatasetError(path, "points", f"finite values, {bad} of {len(pts)} points are NaN/Inf")
    return pts


def image_size(path: str | Path) -> tuple[int, int]:
    """`(width, height)` from the image header (no full decode)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except Exception as e:
        raise DatasetError(path, "image", f"a readable PNG/JPEG header ({error_text(e)})") from e
