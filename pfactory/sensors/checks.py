"""Checks every dataset layout shares, and the result of checking one frame.

`FrameCheck` holds a frame's problems (each `{"frame_id", "file", "field", "reason"}`, where
`reason` says what was expected), the read `Frame` when clean and optionally the decoded images.
The per-layout inspections live with their readers (`KittiDataset.inspect`,
`NuScenesDataset.inspect`); `validate.py` runs them over a dataset and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.frame import Frame
from pfactory.sensors.io import MAX_POINTS, max_point_bytes

Problem = dict[str, Any]  # {"frame_id": str | None, "file": str, "field": str, "reason": str}

# A real spinning lidar returns 1e4..1e5 points per sweep (KITTI 1.1e5-1.3e5, nuScenes 3.5e4);
# under 100 is a stub, a crop or a broken dump, not a scan to train on.
MIN_POINTS = 100
# Beyond 1 km is not a lidar return but garbage bytes read as float32 (the HDL-64 reaches 120 m).
MAX_RANGE_M = 1000.0
# Principal point: must lie within this fraction of the image size from the centre.
PRINCIPAL_POINT_TOL = 0.25
# Rotation blocks: |R R^T - I| below this. KITTI prints 7 significant digits (error ~1e-7).
ORTHONORMAL_TOL = 1e-3
# Image extensions a KITTI image_2 file might carry; only `.png` is read.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# Points exactly at the sensor origin are no returns (a zero-filled or sparse file); more than this share is
# a broken sweep.
MAX_ORIGIN_FRACTION = 0.5
# Focal lengths (pixels) of a real camera: a 1600 px wide image at 170 deg FOV has f ~ 70 px; 1e5 px would
# be a 0.2-degree telescope at 4K. f = 1e-5 maps the whole scene onto one pixel.
FOCAL_RANGE_PX = (1.0, 1e5)
# Boxes: objects on a road, in metres. Beyond these it is garbage (a 1,000 km box, rotation_y = 1e9).
MAX_BOX_SIZE_M = 100.0
MAX_BOX_RANGE_M = 1000.0
MAX_ABS_ANGLE = 2 * 3.141592653589793 + 1e-6
# Objects in one frame: a dense urban KITTI/nuScenes frame has < 200; 1000 is generous. More is not a
# label file (and a boxes x points count per frame would not be bounded).
MAX_OBJECTS = 1000
# PIL modes of 8-bit images that convert to RGB exactly as DALI decodes them (tests/faults: grayscale and
# palette PNGs give the same pixels through PIL's convert("RGB") and DALI). 16-bit and other modes are refused.
IMAGE_MODES = ("RGB", "RGBA", "L", "LA", "P")


class Problems(list):
    """The problems of one frame: `add(path, field, reason)` records one, the path relative to `root`."""

    def __init__(self, frame_id: str, root: Path) -> None:
        super().__init__()
        self.frame_id, self.root = frame_id, root

    def add(self, path: Path | str, field: str, reason: str) -> None:
        self.append(problem(self.frame_id, rel_path(path, self.root), field, reason))


def problem(frame_id: str | None, file: str | Path, field: str, reason: str) -> Problem:
    return {"frame_id": frame_id, "file": str(file), "field": field, "reason": reason}


def absent(path: Path) -> str:
    """Why a file a frame needs cannot be read: `missing`, or what is there instead."""
    if path.is_symlink() and not path.exists():
        return f"a broken symbolic link to {_readlink(path)}"
    if path.is_dir():
        return "a directory, not a file"
    if path.exists():
        return "not a regular file"
    return "missing"


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return "?"


def read_checked(path: Path, max_bytes: int) -> tuple[bytes | None, str]:
    """`(bytes, "")`, or `(None, why)` when the file is larger than `max_bytes` (checked before reading)."""
    size = path.stat().st_size
    if size > max_bytes:
        return None, f"at most {max_bytes} bytes, got {size} bytes ({size / 2**30:.2f} GiB)"
    return path.read_bytes(), ""


def check_points_file(
    path: Path, dims: int, intensity_range: tuple[float, float], min_points: int = MIN_POINTS
) -> list[tuple[str, str]]:
    """`check_points_bytes` of a file, refusing one too big for a sweep from its size alone (not read)."""
    raw, why = read_checked(path, max_point_bytes(dims))
    if raw is None:
        return [("points", f"a lidar sweep of at most {MAX_POINTS} points (float32 x{dims}): {why}")]
    return check_points_bytes(raw, dims, intensity_range, min_points)


def check_focal(fx: float, fy: float) -> str:
    """Empty when both focal lengths (pixels) are plausible (FOCAL_RANGE_PX), else why not."""
    lo, hi = FOCAL_RANGE_PX
    if lo <= fx <= hi and lo <= fy <= hi:
        return ""
    return f"focal lengths of a real camera ({lo:g}..{hi:g} pixels), got fx={fx:g}, fy={fy:g}"



@dataclass
class FrameCheck:
    """Result of checking one frame.

    `problems`: every problem found (empty when the frame is fine). `frame`: the frame as its
    reader returns it, None unless `problems` is empty. `images`: decoded RGB `[H, W, 3]`
    uint8 per camera name (only with `keep_images=True`), for callers that go on to use the
    pixels (prepare) instead of decoding a second time.
    """

    frame_id: str
    problems: list[Problem]
    frame: Frame | None = None
    images: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_points_bytes(
    raw: bytes, dims: int, intensity_range: tuple[float, float], min_points: int = MIN_POINTS
) -> list[tuple[str, str]]:
    """Problems of a float32 `[N, dims]` point file given its bytes, as `(field, reason)` pairs; intensities
    (column 3) must lie in `intensity_range` (the reader's units: `DatasetReader.intensity_range`)."""
    if len(raw) == 0:
        return [("points", f"float32 x{dims} records, got an empty (0-byte) file")]
    if len(raw) % (4 * dims):
        return [
            (
                "points",
                f"a size that is a multiple of {4 * dims} bytes (float32 x{dims}), got {len(raw)} bytes",
            )
        ]
    pts = np.frombuffer(raw, dtype=np.float32).reshape(-1, dims)  # [N, dims]
    out = []
    finite = np.isfinite(pts).all(1)  # [N]
    n_bad = len(pts) - int(finite.sum())
    if n_bad:
        out.append(("points", f"finite values, {n_bad} of {len(pts)} points have NaN/Inf"))
    if len(pts) < min_points:
        out.append(("points", f"at least {min_points} points for a lidar sweep, got {len(pts)}"))
    good = pts if n_bad == 0 else pts[finite]  # no copy of ~2 MB in the common, clean case
    if len(good):
        at_origin = int((good[:, :3] == 0).all(1).sum())
        if at_origin > MAX_ORIGIN_FRACTION * len(pts):
            out.append(
                (
                    "points",
                    f"lidar returns, {at_origin} of {len(pts)} points are exactly at the sensor origin "
                    "(0, 0, 0): a zero-filled or broken sweep",
                )
            )
        far = int((np.abs(good[:, :3]) > MAX_RANGE_M).any(1).sum())
        if far:
            out.append(("points", f"coordinates within +-{MAX_RANGE_M:g} m, {far} points beyond"))
        lo, hi = intensity_range
        inten = good[:, 3]
        n_out = int(((inten < lo) | (inten > hi)).sum())
        if n_out:
            out.append(
                (
                    "intensity",
                    f"values in [{lo:g}, {hi:g}], {n_out} points outside "
                    f"(min {inten.min():.4g}, max {inten.max():.4g})",
                )
            )
    return out


def decode_image_checked(
    data: bytes, keep: bool = False, decode: bool = True, expect: str | None = None
) -> tuple[np.ndarray | None, tuple[int, int], str]:
    """Fully decode PNG/JPEG bytes: `(rgb [H, W, 3] uint8 or None, (width, height), error)`.

    `error` is "" when the image is fine. Truncation is caught twice: by PIL's full decode
    (which raises while `ImageFile.LOAD_TRUNCATED_IMAGES` is False, PIL's default) and by
    the file's end marker, which also catches a PNG cut after its last image data (PIL
    decodes that silently) and truncation when some library flipped the PIL flag.
    `decode=False`, for a caller that decodes the image itself right after and refuses what
    its decoder refuses (prepare: DALI), so the pixels are not decoded twice: a PNG is checked
    by header and end marker only (DALI's libpng refuses what PIL's decode refuses, and more:
    it checks the IDAT CRCs); a JPEG is still entropy-decoded in full, but at 1/8 scale
    (libjpeg DCT scaling, ~half the cost of a full decode), because DALI's JPEG decoder decodes
    some corrupt scans that PIL refuses, and libjpeg raises on those while reading the coded
    stream, which the scaled decode reads completely (tests/prepare/test_camera.py).
    `expect` ("PNG" / "JPEG", from the file name): data of the other format is refused, so a file is what
    its name says. Refused too, the same for `factory data check` and prepare: an EXIF orientation other
    than 1 (DALI applies it, PIL does not: the pixels would not be where the calibration puts them) and
    pixel formats other than 8-bit (`IMAGE_MODES`: a 16-bit PNG is not decoded alike by every decoder).
    """
    import io

    from PIL import Image

    from pfactory.sensors.errors import error_text

    if not data:
        return None, (0, 0), "a PNG/JPEG image, got an empty (0-byte) file"
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            size = im.size  # from the header (a draft below would change im.size)
            mode = im.mode
            # JPEG: EXIF sits in the header. PNG: PIL's getexif() would decode the image to reach an eXIf
            # chunk after the pixels, so the chunks are walked here instead (`_png_orientation`).
            orientation = im.getexif().get(0x0112, 1) if fmt == "JPEG" else _png_orientation(data)
            if decode or keep:
                im.load()
            elif fmt == "JPEG":
                im.draft(None, (max(1, size[0] // 8), max(1, size[1] // 8)))
                im.load()
            rgb = np.asarray(im.convert("RGB")) if keep else None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... for corrupt data
        return None, (0, 0), f"a decodable PNG/JPEG image ({error_text(e)})"
    # End markers: PNG's IEND chunk (type + fixed CRC), JPEG's EOI. Looked for in the last
    # 4 KiB, not at the very end, so trailing padding/metadata some writers append is fine.
    # (In JPEG entropy-coded data 0xFF is always stuffed, so FF D9 can only be a marker.)
    tail = data[-4096:]
    if fmt == "PNG" and b"IEND\xaeB`\x82" not in tail:
        return None, size, "a complete PNG ending with its IEND chunk (the file is truncated)"
    if fmt == "JPEG" and b"\xff\xd9" not in tail:
        return None, size, "a complete JPEG ending with its EOI marker (the file is truncated)"
    if fmt not in ("PNG", "JPEG"):
        return None, size, f"a PNG or JPEG image, got {fmt}"
    if expect is not None and fmt != expect:
        return None, size, f"{expect} data as the file name says, got {fmt} data (rename or convert it)"
    if fmt == "PNG" and len(data) > 24 and data[12:16] == b"IHDR" and data[24] == 16:
        return None, size, (
            "an 8-bit PNG, got 16 bits per channel (decoders differ in how they reduce it): convert it to "
            "8-bit RGB"
        )
    if mode not in IMAGE_MODES:
        return None, size, (
            f"an 8-bit image (RGB, RGBA, grayscale or palette), got PIL mode {mode!r}: convert it to 8-bit RGB"
        )
    if orientation not in (1, None):
        return None, size, (
            f"an image without EXIF rotation, got EXIF orientation {orientation}: decoders that apply it "
            "would turn the pixels away from the calibration; save it with the rotation applied"
        )
    return rgb, size, ""


def _png_orientation(data: bytes) -> int:
    """The EXIF orientation of a PNG's eXIf chunk (1 when there is none), from the chunk list only."""
    import struct

    from PIL import Image

    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == b"eXIf":
            exif = Image.Exif()
            exif.load(data[pos + 8 : pos + 8 + length])
            return int(exif.get(0x0112, 1))
        if kind in (b"IEND", b""):
            break
        pos += 12 + length
    return 1


def image_format_of(path: Path | str) -> str | None:
    """The format a file name promises: "PNG" for .png, "JPEG" for .jpg/.jpeg, else None."""
    return {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG"}.get(Path(path).suffix.lower())


def check_principal_point(K: np.ndarray, size: tuple[int, int]) -> str:
    """Empty if the principal point of `K [3, 3]` fits an image of `size` (w, h), else why not."""
    w, h = size
    cx, cy = float(K[0, 2]), float(K[1, 2])
    inside = 0 < cx < w and 0 < cy < h
    centred = abs(cx - w / 2) < PRINCIPAL_POINT_TOL * w and abs(cy - h / 2) < PRINCIPAL_POINT_TOL * h
    if inside and centred:
        return ""
    return (
        f"an image whose size fits the calibration: principal point (cx, cy) = ({cx:.1f}, {cy:.1f}) "
        f"inside the image and within {PRINCIPAL_POINT_TOL:.0%} of its centre, "
        f"got a {w}x{h} image (centre {w / 2:.1f}, {h / 2:.1f})"
    )


def orthonormal(R: np.ndarray) -> bool:
    return bool(np.abs(R @ R.T - np.eye(3)).max() < ORTHONORMAL_TOL and np.linalg.det(R) > 0)


def rel_path(path: Path | str, root: Path, resolve: bool = False) -> str:
    """`path` relative to `root` when inside it (posix), else as given. `resolve`: compare the two
    after resolving links and `..` (a dataset reached through a symlink)."""
    p = Path(path)
    try:
        if resolve:
            return p.resolve().relative_to(Path(root).resolve()).as_posix()
        return p.relative_to(root).as_posix()
    except ValueError:
        return str(p)


def finish_check(ds: Any, frame_id: str, probs: list[Problem], images: dict[str, np.ndarray]) -> FrameCheck:
    """Read the frame through its reader when the part checks found nothing.

    The reader is the last word: anything it refuses that the checks above missed becomes a
    problem too. The files were just read, so this second read comes from the page cache
    (~1 ms for a KITTI frame, against ~10 ms for the PNG decode that is not repeated).
    """
    if probs:
        return FrameCheck(frame_id, probs, None, images)
    try:
        frame = ds.read(frame_id)
    except DatasetError as e:
        return FrameCheck(
            frame_id, [problem(frame_id, rel_path(e.file, ds.root), e.field, e.expected)], None, images
        )
    return FrameCheck(frame_id, [], frame, images)
