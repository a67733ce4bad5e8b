"""The synthetic generator's C kernel (`pfactory.synth.native`, `pfactory/synth/_shade.c`) against its NumPy
reference: byte-identical camera images and lidar surfaces on both layouts, and the NumPy fallback (disabled,
no compiler, a refused cache folder or library file) gives the same bytes.

Each render and each lidar `surface()` call of real frames runs both paths on the same inputs (the C
path's wrappers are wrapped), so the comparison costs one ray cast per frame; the frames are checked to
cover every primitive kind, façade windows, contact shadows and shiny materials.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from pfactory.synth import native, sensors
from pfactory.synth.dataset import generate_frame
from pfactory.synth.materials import MATERIAL_SPECULAR, Mat
from pfactory.synth.raycast import HIT_GROUND, KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, KIND_PRISM

needs_c = pytest.mark.skipif(not native.available(), reason=f"no C kernel here: {native.status()}")


class _BothPaths:
    """Wraps `native.shade`, `native.blur_noise` and `native.surface`: each call also runs the NumPy reference
    on the same inputs, asserts the same bytes and records what the pixels covered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: set[int] = set()
        self.counts = {"window": 0, "shadowed": 0, "shiny": 0, "renders": 0, "lidar": 0}
        shade, blur_noise, surface = native.shade, native.blur_noise, native.surface

        def both_shade(scene, grid, t, prim, ehaze, shadowing):
            got = shade(scene, grid, t, prim, ehaze, shadowing)
            want = sensors._shade_numpy(scene, grid, t, prim, ehaze, shadowing)
            _assert_same(got, want, "shaded render")
            self._cover(scene, grid, t, prim, shadowing)
            return got

        def both_blur_noise(img, noise):
            got = blur_noise(img, noise)
            _assert_same(got, sensors._blur_noise_numpy(img, noise), "blur + noise")
            return got

        def both_surface(scene, points, prim):
            got = surface(scene, points, prim)
            want = sensors._surface_numpy(scene, points, prim)
            for name, g, w in zip(("normals", "material", "rgb", "reflectance"), got, want):
                _assert_same(g, w, f"lidar surface {name}")
            self.counts["lidar"] += 1
            return got

        monkeypatch.setattr(native, "shade", both_shade)
        monkeypatch.setattr(native, "blur_noise", both_blur_noise)
        monkeypatch.setattr(native, "surface", both_surface)

    def _cover(self, scene, grid, t, prim, shadowing) -> None:
        self.counts["renders"] += 1
        p = prim.ravel()
        on_prim = p[p >= 0]
        self.kinds |= {int(k) for k in np.unique(scene.prims.kind[on_prim])}
        hit = np.flatnonzero(p != -2)
        pts = (
            grid.origin.astype(np.float32)
            + sensors.rows_of(grid.d32, hit) * t.ravel()[hit].astype(np.float32)[:, None]
        )
        _n, mat, _rgb, _r = sensors._surface_numpy(scene, pts, p[hit])
        facade = scene.prims.material[np.maximum(p[hit], 0), 0] == Mat.FACADE
        self.counts["window"] += int(((p[hit] >= 0) & facade & (mat == Mat.GLASS)).sum())
        self.counts["shiny"] += int((MATERIAL_SPECULAR[mat] > 0).sum())
        g = np.flatnonzero(p[hit] == HIT_GROUND)
        if shadowing.any() and len(g):
            self.counts["shadowed"] += int(
                (sensors._contact_shadow(scene.boxes[shadowing], pts[g]) < 1).sum()
            )


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    )
    if got.tobytes() != want.tobytes():
        bad = np.argwhere(got != want)
        raise AssertionError(f"{what}: C and NumPy differ at {len(bad)} values, first {bad[:3].tolist()}")


@needs_c
@pytest.mark.parametrize(("cameras", "frames"), [(1, range(10)), (6, range(10))], ids=["kitti", "nuscenes"])
def test_c_kernel_matches_numpy_byte_for_byte(monkeypatch, cameras, frames):
    both = _BothPaths(monkeypatch)
    for i in frames:
        generate_frame(3, i, cameras=cameras)
    assert both.counts["renders"] == len(frames) * cameras and both.counts["lidar"] == len(frames)
    # The frames exercise every branch of the kernel: each primitive kind, façade windows, contact shadows
    # under the labelled objects and the Blinn-Phong highlight of paint, glass, metal and lamps.
    assert both.kinds == {KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, KIND_PRISM}
    assert both.counts["window"] > 0 and both.counts["shadowed"] > 0 and both.counts["shiny"] > 0, both.counts


def test_blur_is_pillows_3x3_binomial_kernel():
    # The reference's integer blur gives Pillow's bytes (which the generator used before), edges included.
    rng = np.random.default_rng(0)
    for h, w in [(188, 621), (3, 3), (2, 9), (9, 2), (5, 4)]:
        for img in (rng.integers(0, 256, (h, w, 3), dtype=np.uint8), np.full((h, w, 3), 255, np.uint8)):
            pil = np.asarray(
                Image.fromarray(img).filter(ImageFilter.Kernel((3, 3), (1, 2, 1, 2, 4, 2, 1, 2, 1)))
            )
            no_noise = np.full(img.shape, 0b0110, np.uint8)  # (b & 3) + ((b >> 2) & 3) - 3 == 0
            np.testing.assert_array_equal(sensors._blur_noise_numpy(img, no_noise), pil)
            if native.available():
                np.testing.assert_array_equal(native.blur_noise(img, no_noise), pil)
                noise = rng.integers(0, 256, img.shape, dtype=np.uint8)
                np.testing.assert_array_equal(
                    native.blur_noise(img, noise), sensors._blur_noise_numpy(img, noise)
                )


def _frame_bytes(seed: int, index: int, cameras: int = 1) -> list[bytes]:
    f = generate_frame(seed, index, cameras=cameras, image_size=(414, 125) if cameras == 1 else (200, 113))
    return [a.tobytes() for a in (*f.images, f.points, f.point_owner, f.boxes, f.num_points)]


@pytest.fixture
def fresh_library(monkeypatch):
    """`native`'s loaded library forgotten before and after the test (so it builds / refuses anew)."""
    native._library.cache_clear()
    yield
    monkeypatch.undo()
    native._library.cache_clear()


def _fallback(monkeypatch, caplog, **env: str) -> str:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native._library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pfk.synth"):
        assert not native.available()
        native.available()  # said once per process, not per call
    lines = [r.getMessage() for r in caplog.records if r.name == "pfk.synth"]
    assert len(lines) == 1 and "NumPy" in lines[0], lines
    caplog.clear()
    return native.status()


@needs_c
def test_fallback_gives_the_same_bytes(monkeypatch, caplog, tmp_path, fresh_library):
    want = _frame_bytes(11, 0) + _frame_bytes(11, 1, cameras=2)
    assert native.status() == "native"
    assert _fallback(monkeypatch, caplog, PFK_NATIVE="0") == "off (PFK_NATIVE=0)"
    assert _frame_bytes(11, 0) + _frame_bytes(11, 1, cameras=2) == want
    monkeypatch.delenv("PFK_NATIVE")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a cache folder others can write: never built into or loaded from
    why = _fallback(monkeypatch, caplog, PFK_NATIVE_CACHE_DIR=str(shared))
    assert "others can write" in why and str(shared) in why
    assert _frame_bytes(11, 0) == want[:5]
    why = _fallback(
        monkeypatch, caplog, PFK_NATIVE_CACHE_DIR=str(tmp_path / "cache"), CC=str(tmp_path / "no-cc")
    )
    assert why.startswith("unavailable")
    assert _frame_bytes(11, 0) == want[:5]


@needs_c
def test_build_is_cached_and_refuses_a_library_others_can_write(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    native.build(out_dir=cache)
    (lib,) = cache.glob("pfs_shade_*.so")
    assert lib.stat().st_mode & 0o077 == 0
    mtime = lib.stat().st_mtime_ns
    native.build(out_dir=cache)  # the same source, flags, compiler and CPU: the same file, not rebuilt
    assert list(cache.glob("pfs_shade_*.so")) == [lib] and lib.stat().st_mtime_ns == mtime
    assert not list(cache.glob("*.tmp"))
    lib.chmod(0o777)
    with pytest.raises(RuntimeError, match="refusing"):
        native.build(out_dir=cache)
    open_cache = tmp_path / "open"
    open_cache.mkdir()
    open_cache.chmod(0o777)
    with pytest.raises(RuntimeError, match="others can write"):
        native.build(out_dir=open_cache)


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_cache_candidates_honour_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PFK_NATIVE_CACHE_DIR", str(tmp_path / "x"))
    assert native.cache_candidates() == [tmp_path / "x"]
    monkeypatch.delenv("PFK_NATIVE_CACHE_DIR")
    root = Path(native.__file__).resolve().parents[2]
    assert native.cache_candidates()[0] == root / "artifacts" / ".state" / "native"


def test_the_c_source_s_enums_agree_with_python():
    text = Path(native.__file__).with_name("_shade.c").read_text()
    native.check_constants(text)
    with pytest.raises(RuntimeError, match="MAT_GLASS"):
        native.check_constants(text.replace("MAT_GLASS = 5", "MAT_GLASS = 6"))
