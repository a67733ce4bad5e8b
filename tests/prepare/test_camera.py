"""Camera path: resize geometry, exact projection after resizing, DALI vs the PIL reference.

Tolerance of DALI vs PIL (same decode/resize/normalize): both decoders are bit-identical on
the real KITTI PNGs and nuScenes JPEGs (measured max |diff| = 0); the linear antialiased
resize agrees within 1.08 grey levels away from the image border (rounding of intermediate
uint8 values), and differs by up to 24 grey levels on the first/last row or column, where
DALI clamps the filter at the edge and PIL renormalises it (measured on the same images).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pfactory.prepare.camera import CameraBatchError, CameraPipeline, pil_reference, resize_geometry

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
GREY = 1.0 / (255.0 * min(STD))  # one grey level in normalized units (the largest channel step)
INTERIOR_TOL_GREY = 1.1  # measured worst 1.08 on real KITTI and nuScenes images
MEAN_TOL_GREY = 0.2  # measured 0.05-0.14 over whole images, border included


def test_resize_geometry_keeps_aspect_within_half_a_pixel() -> None:
    g = resize_geometry((1242, 375), (416, 128))  # KITTI: width-bound
    assert (g.out_w, g.out_h) == (416, 126)
    assert g.sx == 416 / 1242 and g.sy == 126 / 375
    g = resize_geometry((1600, 900), (416, 128))  # nuScenes: height-bound
    assert (g.out_w, g.out_h) == (228, 128)
    for size in [(1224, 370), (1242, 375), (1600, 900), (640, 480), (100, 1000)]:
        g = resize_geometry(size, (416, 128))
        s = min(416 / size[0], 128 / size[1])
        assert abs(g.out_w - size[0] * s) <= 0.5 and abs(g.out_h - size[1] * s) <= 0.5
        assert g.out_w <= 416 and g.out_h <= 128


def _blob_png(size: tuple[int, int], centre: tuple[float, float], sigma: float) -> bytes:
    w, h = size
    u, v = np.meshgrid(np.arange(w), np.arange(h))  # pixel centres at integers
    img = 255.0 * np.exp(-((u - centre[0]) ** 2 + (v - centre[1]) ** 2) / (2 * sigma**2))
    rgb = np.repeat(np.round(img).astype(np.uint8)[..., None], 3, axis=2)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("size", "target", "p_cam"),
    [
        ((1242, 375), (416, 128), (-0.73, 0.04, 12.0)),  # KITTI -> default input
        ((1242, 375), (104, 32), (1.3, -0.5, 9.0)),  # a 12x shrink
        ((1600, 900), (416, 128), (0.2, 0.33, 20.0)),  # nuScenes: height-bound, padded right
    ],
)
def test_adjusted_intrinsics_project_onto_the_resized_pixels(size, target, p_cam) -> None:
    """A blob at the projection of a 3D point lands, after DALI's resize, where K' projects it.

    Measured error of the blob's centroid: <= 0.0041 px over these cases.
    """
    K = np.array([[721.5377, 0.0, 609.5593], [0.0, 721.5377, 172.854], [0.0, 0.0, 1.0]])
    p_cam = np.asarray(p_cam)
    u0, v0 = (K @ p_cam)[:2] / p_cam[2]
    g = resize_geometry(size, target)
    cam = CameraPipeline(target, MEAN, STD, batch_size=1, num_threads=1)
    out = cam.run([_blob_png(size, (u0, v0), sigma=9.0)], [(g.out_h, g.out_w)]).images[0]  # [3, H, W]
    img = out[0].astype(np.float64)
    img = img - img[: g.out_h, : g.out_w].min()  # black background (as float16 rounds it) -> 0
    img[g.out_h :, :] = 0
    img[:, g.out_w :] = 0
    vv, uu = np.mgrid[0 : img.shape[0], 0 : img.shape[1]]
    r, c = np.unravel_index(img.argmax(), img.shape)
    win = (np.abs(vv - r) <= 12) & (np.abs(uu - c) <= 12)  # the blob only: 4 sigma after scaling
    wsum = (img * win).sum()
    centroid = np.array([(uu * img * win).sum() / wsum, (vv * img * win).sum() / wsum])
    expected = (g.intrinsics(K) @ p_cam)[:2] / p_cam[2]
    # Scaling K without the half-pixel terms would be off by (s - 1) / 2 = -0.33..-0.46 px.
    naive = np.array([g.sx * u0, g.sy * v0])
    assert np.abs(centroid - expected).max() < 0.01, (centroid, expected)
    assert np.abs(naive - expected).max() > 0.3


def _images(paths: list[Path]) -> list[bytes]:
    return [p.read_bytes() for p in paths]


@pytest.mark.parametrize("kind", ["kitti_png", "nuscenes_jpeg"])
def test_dali_matches_the_pil_reference(kind: str, real_kitti_dir: Path, real_nuscenes_dir: Path) -> None:
    if kind == "kitti_png":
        paths = sorted((real_kitti_dir / "training" / "image_2").glob("*.png"))
    else:
        paths = sorted((real_nuscenes_dir / "samples").glob("CAM_*/*.jpg"))
    datas = _images(paths)
    target = (416, 128)
    geos = [resize_geometry(Image.open(io.BytesIO(d)).size, target) for d in datas]
    cam = CameraPipeline(target, MEAN, STD, batch_size=len(datas), num_threads=2)
    out = cam.run(datas, [(g.out_h, g.out_w) for g in geos])
    assert out.images.shape == (len(datas), 3, 128, 416) and out.images.dtype == np.float16
    for d, g, img in zip(datas, geos, out.images):
        ref = pil_reference(d, g, target, MEAN, STD)
        diff = np.abs(img.astype(np.float32) - ref) / GREY  # in grey levels
        interior = diff[:, 1 : g.out_h - 1, 1 : g.out_w - 1]
        assert interior.max() <= INTERIOR_TOL_GREY, interior.max()
        assert diff[:, : g.out_h, : g.out_w].mean() <= MEAN_TOL_GREY
        assert not img[:, g.out_h :, :].any() and not img[:, :, g.out_w :].any()  # padding = 0


def test_an_image_dali_cannot_decode_is_found_per_sample(real_kitti_dir: Path) -> None:
    paths = sorted((real_kitti_dir / "training" / "image_2").glob("*.png"))[1:4]
    datas = _images(paths)
    bad = [datas[0], datas[1][: len(datas[1]) // 2], datas[2]]
    g = resize_geometry((1242, 375), (104, 32))
    sizes = [(g.out_h, g.out_w)] * 3
    cam = CameraPipeline((104, 32), MEAN, STD, batch_size=4, num_threads=2)
    good = cam.run(datas, sizes).images
    with pytest.raises(CameraBatchError):
        cam.run(bad, sizes)
    results = cam.run_each(bad, sizes)
    assert isinstance(results[1], str) and "decoders.image" in results[1]
    np.testing.assert_array_equal(results[0].images[0], good[0])
    np.testing.assert_array_equal(results[2].images[0], good[2])
    np.testing.assert_array_equal(cam.run(datas, sizes).images, good)  # rebuilt, same bytes


@pytest.mark.gpu
def test_gpu_mixed_decode_matches_cpu(real_kitti_dir: Path, real_nuscenes_dir: Path) -> None:
    from pfactory.prepare.camera import cuda_device_count

    if cuda_device_count() == 0:
        pytest.skip("needs CUDA")
    paths = sorted((real_kitti_dir / "training" / "image_2").glob("*.png"))
    paths += sorted((real_nuscenes_dir / "samples").glob("CAM_*/*.jpg"))
    datas = _images(paths)
    geos = [resize_geometry(Image.open(io.BytesIO(d)).size, (416, 128)) for d in datas]
    sizes = [(g.out_h, g.out_w) for g in geos]
    cpu = CameraPipeline((416, 128), MEAN, STD, len(datas), 2, "cpu").run(datas, sizes).images
    gpu = CameraPipeline((416, 128), MEAN, STD, len(datas), 2, "gpu").run(datas, sizes).images
    for c, g, geo in zip(cpu, gpu, geos):
        diff = np.abs(c.astype(np.float32) - g.astype(np.float32)) / GREY
        # nvJPEG's IDCT/upsampling differ from libjpeg-turbo by a few grey levels at edges.
        assert diff[:, : geo.out_h, : geo.out_w].mean() < 1.0


def _flip(data: bytes, frac: float, n: int = 64) -> bytes:
    """`data` with `n` bytes from `frac` of its length XOR-ed (a corruption in the middle)."""
    b = bytearray(data)
    i = int(len(b) * frac)
    b[i : i + n] = bytes(x ^ 0x5A for x in b[i : i + n])
    return bytes(b)


def test_prepare_checks_without_a_second_decode_refuse_what_pil_refuses(
    real_kitti_dir: Path, real_nuscenes_dir: Path
) -> None:
    """Prepare checks images with `decode_image_checked(decode=False)` and lets DALI decode.

    PNG: header + end marker only, and DALI (libpng) refuses the corruptions PIL's decode
    refuses. JPEG: DALI decodes a corrupt scan that PIL refuses (measured), so the check
    entropy-decodes the stream at 1/8 scale, which refuses it as PIL's full decode does.
    """
    from pfactory.sensors.validate import decode_image_checked

    png = sorted((real_kitti_dir / "training" / "image_2").glob("*.png"))[0].read_bytes()
    jpg = sorted((real_nuscenes_dir / "samples").glob("CAM_*/*.jpg"))[0].read_bytes()
    assert decode_image_checked(png, decode=False) == (None, (1224, 370), "")
    assert decode_image_checked(jpg, decode=False) == (None, (1600, 900), "")

    g = resize_geometry((1224, 370), (104, 32))
    cam = CameraPipeline((104, 32), MEAN, STD, batch_size=1, num_threads=1)
    for bad in (_flip(png, 0.5), png[: len(png) // 2] + png[-12:]):  # corrupt IDAT; cut, IEND kept
        assert decode_image_checked(bad)[2]  # PIL's full decode refuses it
        assert decode_image_checked(bad, decode=False)[2] == ""  # the header check passes it...
        assert isinstance(cam.run_each([bad], [(g.out_h, g.out_w)])[0], str)  # ...DALI refuses it

    bad = _flip(jpg, 0.5)  # corrupt scan data, EOI intact
    assert decode_image_checked(bad)[2]
    assert "decodable" in decode_image_checked(bad, decode=False)[2]
    g = resize_geometry((1600, 900), (104, 32))
    assert not isinstance(cam.run_each([bad], [(g.out_h, g.out_w)])[0], str)  # why JPEG is checked
