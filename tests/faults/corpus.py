"""The bad-input corpus: corrupt and hostile inputs, each planted in one frame of a copy of a clean dataset.

A `Case` says how to plant the fault (`plant(p)` on a `Planted` copy, victim frame `p.fid`) and what must
happen (`tests/faults/test_bad_inputs.py` checks it for every case):
    refuse   `factory data check` exits 1 naming the file and field (a problem of the victim frame only);
             `factory prepare` refuses exactly that frame (rejected.jsonl, same file and field) and keeps
             every other frame; nothing prints a traceback.
    accept   a valid variant (CRLF, a BOM, DontCare-only labels, a grayscale PNG, stray files...): check
             exits 0, prepare keeps every frame; with `reference`, the victim's prepared image equals the
             one prepared from the reference planting (converted correctly, never mis-decoded).
    dataset  the dataset as a whole is unreadable (a nuScenes table that is not JSON): check exits 1 naming
             the file, prepare exits 1 with one line and writes nothing.
`roi=True`: the frame is fine as a dataset file but useless to prepare's region of interest (all points
behind the sensor): check (which applies the prepare parameters) and prepare both refuse it.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Planted:
    """A writable copy of a clean dataset and its victim frame."""

    root: Path  # the dataset root given to the CLI
    layout: str  # "kitti" | "nuscenes"
    fid: str  # the victim frame id
    frame_ids: list[str]

    # --- KITTI ---------------------------------------------------------------------------
    @property
    def split(self) -> Path:
        return self.root / "training"

    def k(self, part: str, fid: str | None = None) -> Path:
        ext = {"velodyne": ".bin", "image_2": ".png", "calib": ".txt", "label_2": ".txt"}[part]
        return self.split / part / f"{fid or self.fid}{ext}"

    def points(self, dims: int = 4) -> np.ndarray:
        path = self.k("velodyne") if self.layout == "kitti" else self.nfile("LIDAR_TOP")
        return np.fromfile(path, dtype=np.float32).reshape(-1, dims)

    def set_points(self, pts: np.ndarray) -> None:
        path = self.k("velodyne") if self.layout == "kitti" else self.nfile("LIDAR_TOP")
        np.ascontiguousarray(pts, dtype=np.float32).tofile(path)

    def edit(self, path: Path, fn: Callable[[str], str]) -> None:
        path.write_text(fn(path.read_text()))

    def label_lines(self) -> list[str]:
        return self.k("label_2").read_text().splitlines()

    def set_label(self, lines: list[str]) -> None:
        self.k("label_2").write_text("".join(line + "\n" for line in lines))

    def calib_line(self, key: str, values: list[float] | str) -> None:
        def fn(text: str) -> str:
            out = []
            for line in text.splitlines():
                if line.split(":", 1)[0].strip() == key:
                    v = values if isinstance(values, str) else " ".join(f"{x:.12e}" for x in values)
                    line = f"{key}: {v}"
                out.append(line)
            return "\n".join(out) + "\n"

        self.edit(self.k("calib"), fn)

    def calib_values(self, key: str) -> list[float]:
        for line in self.k("calib").read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return [float(v) for v in line.split(":", 1)[1].split()]
        raise KeyError(key)

    # --- nuScenes ------------------------------------------------------------------------
    @property
    def tdir(self) -> Path:
        return next(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("v1.0-"))

    def table(self, name: str) -> list[dict]:
        return json.loads((self.tdir / f"{name}.json").read_text())

    def save(self, name: str, rows: list[dict]) -> None:
        (self.tdir / f"{name}.json").write_text(json.dumps(rows, indent=1))

    def sd(self, channel: str) -> dict:
        """The victim's key-frame sample_data record of `channel`."""
        cs = {c["token"]: c for c in self.table("calibrated_sensor")}
        sensors = {s["token"]: s["channel"] for s in self.table("sensor")}
        for r in self.table("sample_data"):
            if (
                r["sample_token"] == self.fid
                and sensors[cs[r["calibrated_sensor_token"]]["sensor_token"]] == channel
            ):
                return r
        raise KeyError(channel)

    def nfile(self, channel: str) -> Path:
        return self.root / self.sd(channel)["filename"]

    def edit_record(self, table: str, token: str, fn: Callable[[dict], None]) -> None:
        rows = self.table(table)
        for r in rows:
            if r["token"] == token:
                fn(r)
        self.save(table, rows)

    def victim_annotation(self) -> dict:
        return next(a for a in self.table("sample_annotation") if a["sample_token"] == self.fid)


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    plant: Callable[[Planted], None]
    outcome: str = "refuse"  # refuse | accept | dataset
    # Frames the planting itself creates (a stray `1.bin` beside `000001.bin` is frame "1") may be refused
    # too: every frame of the clean dataset but the victim must still be kept.
    file: str = (
        ""  # the problem's file ends with this ("{fid}" = the victim id; nuScenes: "{LIDAR_TOP}" = its file)
    )
    field: str = ""  # the problem's field contains this
    words: str = ""  # the reason contains this
    roi: bool = False
    reference: Callable[[Planted], None] | None = None


# -------------------------------------------------------------------------------------------------
# Planting helpers


def _png(arr: np.ndarray, mode: str | None = None, **save: object) -> bytes:
    from PIL import Image

    im = Image.fromarray(arr, mode) if mode else Image.fromarray(arr)
    buf = io.BytesIO()
    im.save(buf, format="PNG", **save)
    return buf.getvalue()


def _rgb(p: Planted) -> np.ndarray:
    from PIL import Image

    with Image.open(p.k("image_2")) as im:
        return np.asarray(im.convert("RGB"))


def _grayscale(p: Planted) -> None:
    from PIL import Image

    p.k("image_2").write_bytes(_png(np.asarray(Image.fromarray(_rgb(p)).convert("L"))))


def _grayscale_ref(p: Planted) -> None:
    from PIL import Image

    p.k("image_2").write_bytes(_png(np.asarray(Image.fromarray(_rgb(p)).convert("L").convert("RGB"))))


def _palette(p: Planted) -> None:
    from PIL import Image

    im = Image.fromarray(_rgb(p)).quantize(64)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    p.k("image_2").write_bytes(buf.getvalue())


def _palette_ref(p: Planted) -> None:
    from PIL import Image

    p.k("image_2").write_bytes(_png(np.asarray(Image.fromarray(_rgb(p)).quantize(64).convert("RGB"))))


def _png16(p: Planted) -> None:
    """A 16-bit grayscale PNG (PIL writes mode I;16 as 16-bit)."""
    from PIL import Image

    gray = np.asarray(Image.fromarray(_rgb(p)).convert("L")).astype(np.uint16) * 257
    buf = io.BytesIO()
    Image.fromarray(gray).save(buf, format="PNG")  # uint16 -> mode I;16, a 16-bit PNG
    p.k("image_2").write_bytes(buf.getvalue())


def _jpeg_named_png(p: Planted) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_rgb(p)).save(buf, format="JPEG", quality=90)
    p.k("image_2").write_bytes(buf.getvalue())


def _half_size(p: Planted) -> None:
    from PIL import Image

    im = Image.fromarray(_rgb(p))
    p.k("image_2").write_bytes(_png(np.asarray(im.resize((im.width // 2, im.height // 2)))))


def _png_exif_rotated(p: Planted) -> None:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6
    p.k("image_2").write_bytes(_png(_rgb(p), exif=exif.tobytes()))


def _label_field(index: int, value: str) -> Callable[[Planted], None]:
    def plant(p: Planted) -> None:
        lines = p.label_lines()
        parts = lines[0].split()
        parts[index] = value
        p.set_label([" ".join(parts), *lines[1:]])

    return plant


def _outside(p: Planted, path: Path) -> None:
    """Move `path` outside the dataset root and leave a symlink to it: a link is the filesystem owner's choice
    (DVC's symlink cache, a shared mirror, a replicated benchmark dataset) and is followed; its content is
    validated like any file's."""
    target = p.root.parent / f"outside-{path.name}"
    os.replace(path, target)
    path.symlink_to(target)


def _link_to_secret(p: Planted, path: Path) -> None:
    """A link out of the root to a file that is not sensor data (a key, /etc/passwd): refused by its content,
    never published (37 bytes: not float32 records, not an image)."""
    secret = p.root.parent / "id_rsa"
    secret.write_text("ssh-rsa AAAAB3NzaC1yc2EAAA user@host\n")
    path.unlink()
    path.symlink_to(secret)


def _dir_instead(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_text("x")


def _kitti_roi(p: Planted) -> None:
    pts = p.points()
    pts[:, 0] = -np.abs(pts[:, 0]) - 5.0  # every point behind the sensor: outside pc_range (x >= 0)
    p.set_points(pts)


def _crlf(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))


def _bom(path: Path) -> None:
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())


KITTI: list[Case] = [
    # lidar
    Case("kitti/lidar-length-not-multiple-of-16", "kitti",
         lambda p: p.k("velodyne").write_bytes(p.k("velodyne").read_bytes() + b"\0\0\0"),
         file="velodyne/{fid}.bin", field="points", words="multiple of 16"),
    Case("kitti/lidar-all-nan", "kitti", lambda p: p.set_points(np.full_like(p.points(), np.nan)),
         file="velodyne/{fid}.bin", field="points", words="NaN"),
    Case("kitti/lidar-some-inf", "kitti",
         lambda p: p.set_points(np.where(np.arange(len(p.points()))[:, None] % 7 == 0, np.inf, p.points())),
         file="velodyne/{fid}.bin", field="points", words="NaN/Inf"),
    Case("kitti/lidar-coordinates-1e30", "kitti", lambda p: p.set_points(p.points() * np.float32(1e30)),
         file="velodyne/{fid}.bin", field="points", words="within"),
    Case("kitti/lidar-zero-bytes", "kitti", lambda p: p.k("velodyne").write_bytes(b""),
         file="velodyne/{fid}.bin", field="points", words="empty"),
    Case("kitti/lidar-all-at-origin", "kitti", lambda p: p.set_points(np.zeros_like(p.points())),
         file="velodyne/{fid}.bin", field="points", words="origin"),
    Case("kitti/lidar-intensity-out-of-range", "kitti",
         lambda p: p.set_points(np.concatenate([p.points()[:, :3], np.full((len(p.points()), 1), 7.0)], 1)),
         file="velodyne/{fid}.bin", field="intensity"),
    Case("kitti/lidar-too-few-points", "kitti", lambda p: p.set_points(p.points()[:20]),
         file="velodyne/{fid}.bin", field="points", words="at least"),
    Case("kitti/lidar-all-outside-roi", "kitti", _kitti_roi, file="velodyne/{fid}.bin", field="points",
         words="pc_range", roi=True),
    # images
    Case("kitti/image-zero-bytes", "kitti", lambda p: p.k("image_2").write_bytes(b""),
         file="image_2/{fid}.png", field="image", words="empty"),
    Case("kitti/image-wrong-magic", "kitti",
         lambda p: p.k("image_2").write_bytes(b"GIF89a" + p.k("image_2").read_bytes()[6:]),
         file="image_2/{fid}.png", field="image", words="decodable"),
    Case("kitti/image-truncated", "kitti",
         lambda p: p.k("image_2").write_bytes(p.k("image_2").read_bytes()[: len(p.k("image_2").read_bytes()) // 2]),
         file="image_2/{fid}.png", field="image"),
    Case("kitti/image-jpeg-named-png", "kitti", _jpeg_named_png, file="image_2/{fid}.png", field="image",
         words="PNG data"),
    Case("kitti/image-wrong-size-for-calib", "kitti", _half_size, file="image_2/{fid}.png", field="image size",
         words="principal point"),
    Case("kitti/image-png-16-bit", "kitti", _png16, file="image_2/{fid}.png", field="image", words="16 bits"),
    Case("kitti/image-png-grayscale", "kitti", _grayscale, outcome="accept", reference=_grayscale_ref),
    Case("kitti/image-png-palette", "kitti", _palette, outcome="accept", reference=_palette_ref),
    Case("kitti/image-exif-rotation", "kitti", _png_exif_rotated, file="image_2/{fid}.png", field="image",
         words="EXIF orientation 6"),
    # calibration
    Case("kitti/calib-missing-P2", "kitti",
         lambda p: p.edit(p.k("calib"), lambda t: "".join(x + "\n" for x in t.splitlines() if not x.startswith("P2:"))),
         file="calib/{fid}.txt", field="P2", words="missing"),
    Case("kitti/calib-P2-11-numbers", "kitti", lambda p: p.calib_line("P2", p.calib_values("P2")[:11]),
         file="calib/{fid}.txt", field="P2", words="12 values"),
    Case("kitti/calib-R0-nan", "kitti", lambda p: p.calib_line("R0_rect", "nan " * 9),
         file="calib/{fid}.txt", field="R0_rect", words="finite"),
    Case("kitti/calib-P2-singular", "kitti", lambda p: p.calib_line("P2", [0.0] * 12),
         file="calib/{fid}.txt", field="P2"),
    Case("kitti/calib-focal-1e-5", "kitti",
         lambda p: p.calib_line("P2", [1e-5, 0, p.calib_values("P2")[2], 0, 0, 1e-5, p.calib_values("P2")[6], 0,
                                       0, 0, 1, 0]),
         file="calib/{fid}.txt", field="P2", words="focal lengths of a real camera"),
    Case("kitti/calib-Tr-not-rigid", "kitti",
         lambda p: p.calib_line("Tr_velo_to_cam", [v * 3.0 for v in p.calib_values("Tr_velo_to_cam")]),
         file="calib/{fid}.txt", field="Tr_velo_to_cam", words="rigid"),
    Case("kitti/calib-not-utf8", "kitti", lambda p: p.k("calib").write_bytes(b"P0: \xff\xfe\x00garbage\n"),
         file="calib/{fid}.txt", field="calib", words="UTF-8"),
    Case("kitti/calib-with-bom-and-crlf", "kitti", lambda p: (_bom(p.k("calib")), _crlf(p.k("calib"))),
         outcome="accept"),
    # labels
    Case("kitti/label-14-fields", "kitti",
         lambda p: p.set_label([" ".join(p.label_lines()[0].split()[:14]), *p.label_lines()[1:]]),
         file="label_2/{fid}.txt", field="line 1", words="15 space-separated fields"),
    Case("kitti/label-nan-height", "kitti", _label_field(8, "nan"), file="label_2/{fid}.txt",
         field="line 1 height", words="finite"),
    Case("kitti/label-negative-size", "kitti", _label_field(9, "-1.5"), file="label_2/{fid}.txt",
         field="line 1 dimensions", words="positive"),
    Case("kitti/label-unknown-class", "kitti", _label_field(0, "Spaceship"), file="label_2/{fid}.txt",
         field="line 1 type", words="Spaceship"),
    Case("kitti/label-1000-km-box", "kitti", _label_field(10, "1000000"), file="label_2/{fid}.txt",
         field="line 1 dimensions", words="at most 100 m"),
    Case("kitti/label-1000-km-away", "kitti", _label_field(13, "1000000"), file="label_2/{fid}.txt",
         field="line 1 location", words="within 1000 m"),
    Case("kitti/label-rotation-1e9", "kitti", _label_field(14, "1e9"), file="label_2/{fid}.txt",
         field="line 1 rotation_y", words="[-pi, pi]"),
    Case("kitti/label-behind-camera", "kitti", _label_field(13, "-5"), file="label_2/{fid}.txt",
         field="line 1 z", words="in front of the camera"),
    Case("kitti/label-20000-objects", "kitti", lambda p: p.set_label(p.label_lines()[:1] * 20000),
         file="label_2/{fid}.txt", field="label", words="at most 1000 objects"),
    Case("kitti/label-dontcare-only", "kitti",
         lambda p: p.set_label(["DontCare -1 -1 -10 10.00 20.00 40.00 50.00 -1 -1 -1 -1000 -1000 -1000 -10"]),
         outcome="accept"),
    Case("kitti/label-empty-file", "kitti", lambda p: p.k("label_2").write_text(""), outcome="accept"),
    Case("kitti/label-crlf", "kitti", lambda p: _crlf(p.k("label_2")), outcome="accept"),
    Case("kitti/label-utf8-bom", "kitti", lambda p: _bom(p.k("label_2")), outcome="accept"),
    Case("kitti/label-trailing-spaces", "kitti", lambda p: p.set_label([x + "   \t " for x in p.label_lines()]),
         outcome="accept"),
    Case("kitti/label-not-utf8", "kitti", lambda p: p.k("label_2").write_bytes(b"Car \xff\xfe 0 0\n"),
         file="label_2/{fid}.txt", field="label", words="UTF-8"),
    # structure
    Case("kitti/frame-missing-calib", "kitti", lambda p: p.k("calib").unlink(), file="calib/{fid}.txt",
         field="calib", words="(missing)"),
    Case("kitti/frame-missing-lidar", "kitti", lambda p: p.k("velodyne").unlink(), file="velodyne/{fid}.bin",
         field="velodyne", words="(missing)"),
    Case("kitti/stray-files", "kitti",
         lambda p: [(p.split / d / n).write_text("notes") for d, n in
                    (("velodyne", "README.md"), ("image_2", ".DS_Store"), ("calib", "notes.md"), (".", "LICENSE"))],
         outcome="accept"),
    Case("kitti/two-files-one-frame-png-jpg", "kitti",
         lambda p: (p.split / "image_2" / f"{p.fid}.jpg").write_bytes(p.k("image_2").read_bytes()),
         file="image_2/{fid}.jpg", field="frame id", words="both name frame"),
    Case("kitti/two-files-one-frame-number", "kitti",
         lambda p: (p.split / "velodyne" / f"{int(p.fid)}.bin").write_bytes(p.k("velodyne").read_bytes()),
         file="velodyne/" + "{int}.bin", field="frame id", words="both name frame"),
    Case("kitti/symlink-to-a-sweep-outside-root", "kitti", lambda p: _outside(p, p.k("velodyne")), outcome="accept"),
    Case("kitti/symlink-to-a-secret-outside-root", "kitti", lambda p: _link_to_secret(p, p.k("velodyne")),
         file="velodyne/{fid}.bin", field="points", words="multiple of 16"),
    Case("kitti/directory-instead-of-file", "kitti", lambda p: _dir_instead(p.k("label_2")),
         file="label_2/{fid}.txt", field="label_2", words="a directory, not a file"),
    Case("kitti/broken-symlink", "kitti",
         lambda p: (p.k("calib").unlink(), p.k("calib").symlink_to(p.root / "nowhere.txt")),
         file="calib/{fid}.txt", field="calib", words="broken symbolic link"),
]  # fmt: skip


# -------------------------------------------------------------------------------------------------
# nuScenes


def _jpeg_exif_rotated(p: Planted) -> None:
    from PIL import Image

    path = p.nfile("CAM_FRONT")
    with Image.open(path) as im:
        rgb = im.convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    rgb.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    path.write_bytes(buf.getvalue())


def _png_named_jpg(p: Planted) -> None:
    from PIL import Image

    path = p.nfile("CAM_FRONT")
    with Image.open(path) as im:
        path.write_bytes(_png(np.asarray(im.convert("RGB"))))


def _sd_edit(channel: str, fn: Callable[[dict], None]) -> Callable[[Planted], None]:
    return lambda p: p.edit_record("sample_data", p.sd(channel)["token"], fn)


def _cs_edit(channel: str, fn: Callable[[dict], None]) -> Callable[[Planted], None]:
    return lambda p: p.edit_record("calibrated_sensor", p.sd(channel)["calibrated_sensor_token"], fn)


def _ann_edit(fn: Callable[[dict], None]) -> Callable[[Planted], None]:
    return lambda p: p.edit_record("sample_annotation", p.victim_annotation()["token"], fn)


def _focal(r: dict) -> None:
    K = r["camera_intrinsic"]
    K[0][0] = K[1][1] = 1e-5


def _dup_sd_token(p: Planted) -> None:
    rows = p.table("sample_data")
    rows.append(dict(p.sd("CAM_FRONT")))
    p.save("sample_data", rows)


def _dup_ann_token(p: Planted) -> None:
    rows = p.table("sample_annotation")
    rows.append(dict(p.victim_annotation()))
    p.save("sample_annotation", rows)


def _nus_roi(p: Planted) -> None:
    pts = p.points(5)
    pts[:, :2] += (
        300.0  # 300 m away along both horizontal axes: outside pc_range whichever way the lidar faces
    )
    p.set_points(pts)


def _table_bom(p: Planted) -> None:
    for f in p.tdir.glob("*.json"):
        _bom(f)


NUSCENES: list[Case] = [
    Case("nuscenes/lidar-length-not-multiple-of-20", "nuscenes",
         lambda p: p.nfile("LIDAR_TOP").write_bytes(p.nfile("LIDAR_TOP").read_bytes()[:-4]),
         file="{LIDAR_TOP}", field="points", words="multiple of 20"),
    Case("nuscenes/lidar-nan", "nuscenes", lambda p: p.set_points(np.full_like(p.points(5), np.nan)),
         file="{LIDAR_TOP}", field="points", words="NaN"),
    Case("nuscenes/lidar-all-outside-roi", "nuscenes", _nus_roi, file="{LIDAR_TOP}", field="points",
         words="pc_range", roi=True),
    Case("nuscenes/table-names-missing-lidar-file", "nuscenes", lambda p: p.nfile("LIDAR_TOP").unlink(),
         file="{LIDAR_TOP}", field="LIDAR_TOP", words="(missing)"),
    Case("nuscenes/table-names-missing-camera-file", "nuscenes", lambda p: p.nfile("CAM_FRONT").unlink(),
         file="{CAM_FRONT}", field="CAM_FRONT", words="(missing)"),
    Case("nuscenes/filename-dotdot-escape", "nuscenes",
         _sd_edit("CAM_FRONT", lambda r: r.update(filename="../../../../etc/passwd")),
         file="sample_data.json", field=".filename", words="inside the dataset root"),
    Case("nuscenes/filename-absolute", "nuscenes",
         _sd_edit("CAM_FRONT", lambda r: r.update(filename="/etc/passwd")),
         file="sample_data.json", field=".filename", words="inside the dataset root"),
    Case("nuscenes/symlink-to-a-secret-outside-root", "nuscenes", lambda p: _link_to_secret(p, p.nfile("CAM_FRONT")),
         file="{CAM_FRONT}", field="image", words="decodable"),
    Case("nuscenes/directory-instead-of-file", "nuscenes", lambda p: _dir_instead(p.nfile("CAM_FRONT")),
         file="{CAM_FRONT}", field="CAM_FRONT", words="a directory, not a file"),
    Case("nuscenes/duplicate-sample-data-token", "nuscenes", _dup_sd_token, file="sample_data.json",
         field=".token", words="unique tokens"),
    Case("nuscenes/duplicate-annotation-token", "nuscenes", _dup_ann_token, file="sample_annotation.json",
         field=".token", words="unique tokens"),
    Case("nuscenes/jpeg-exif-orientation-6", "nuscenes", _jpeg_exif_rotated, file="{CAM_FRONT}", field="image",
         words="EXIF orientation 6"),
    Case("nuscenes/png-named-jpg", "nuscenes", _png_named_jpg, file="{CAM_FRONT}", field="image",
         words="JPEG data"),
    Case("nuscenes/jpeg-truncated", "nuscenes",
         lambda p: p.nfile("CAM_FRONT").write_bytes(p.nfile("CAM_FRONT").read_bytes()[:-300]),
         file="{CAM_FRONT}", field="image"),
    Case("nuscenes/image-size-differs-from-table", "nuscenes",
         _sd_edit("CAM_FRONT", lambda r: r.update(width=r["width"] * 2)), file="{CAM_FRONT}",
         field="CAM_FRONT size", words="as in sample_data.json"),
    Case("nuscenes/focal-1e-5", "nuscenes", _cs_edit("CAM_FRONT", _focal), file="calibrated_sensor.json",
         field=".camera_intrinsic", words="focal lengths of a real camera"),
    Case("nuscenes/zero-quaternion", "nuscenes",
         _cs_edit("CAM_FRONT", lambda r: r.update(rotation=[0.0, 0.0, 0.0, 0.0])),
         file="calibrated_sensor.json", field=".rotation/translation"),
    Case("nuscenes/unknown-calibrated-sensor", "nuscenes",
         _sd_edit("LIDAR_TOP", lambda r: r.update(calibrated_sensor_token="nope")), file="sample_data.json",
         field="LIDAR_TOP"),
    Case("nuscenes/annotation-negative-size", "nuscenes", _ann_edit(lambda r: r.update(size=[-1.0, 4.0, 1.5])),
         file="sample_annotation.json", field=".size", words="positive"),
    Case("nuscenes/annotation-1000-km-box", "nuscenes", _ann_edit(lambda r: r.update(size=[1e6, 1e6, 1e6])),
         file="sample_annotation.json", field=".size", words="at most 100 m"),
    Case("nuscenes/annotation-1000-km-away", "nuscenes",
         _ann_edit(lambda r: r.update(translation=[1e6, 1e6, 0.0])), file="sample_annotation.json",
         field=".translation", words="within 1000 m"),
    Case("nuscenes/annotation-unknown-instance", "nuscenes", _ann_edit(lambda r: r.update(instance_token="nope")),
         file="sample_annotation.json", field=".instance_token"),
    Case("nuscenes/tables-with-utf8-bom", "nuscenes", _table_bom, outcome="accept"),
    Case("nuscenes/table-not-json", "nuscenes", lambda p: (p.tdir / "sample_data.json").write_text("[{,"),
         outcome="dataset", file="sample_data.json", field="sample_data", words="JSON"),
    Case("nuscenes/table-missing", "nuscenes", lambda p: (p.tdir / "ego_pose.json").unlink(), outcome="dataset",
         file="ego_pose.json", field="ego_pose", words="(missing)"),
]  # fmt: skip

CASES: list[Case] = KITTI + NUSCENES
assert len({c.name for c in CASES}) == len(CASES), "case names are unique"
