"""Camera shading and the lidar's surface() in C (pfactory/synth/_shade.c), built on first use, via ctypes.

    available() -> bool      whether the library is built and loaded (the first call builds it: ~1 s)
    status() -> str          "native", or why the NumPy path is used (disabled, no compiler, build refused)
    shade(scene, grid, t, prim, ehaze, shadowing) -> rgb [H, W, 3] uint8   the C twin of `sensors._shade_numpy`
    blur_noise(img, noise) -> [H, W, 3] uint8            the C twin of `sensors._blur_noise_numpy`
    surface(scene, points, prim) -> normals, mat, rgb, refl   the C twin of `sensors._surface_numpy`

Why: shading a 1242x375 render in NumPy is ~25 passes over ~465k pixels (~95 ms: `surface()`, normals,
façade windows, texture hash, light, haze, exposure); one C loop does it in a few ms. The two give
byte-identical images (the dataset must not depend on whether a machine has a compiler): the C code does
NumPy's IEEE operations in NumPy's order and precision (the rules are in the C file's header), and what C
cannot reproduce bit for bit (NumPy's SIMD cos, sin and exp) is computed by NumPy and passed in
(tests/synth/test_synth_native.py compares both paths on every primitive kind and both layouts).

Build, modelled on kernels/native.py (not imported: `kernels` imports torch, which would cost the
spawned synth workers seconds): `cc -O3 -march=native -ffp-contract=off -fno-math-errno -shared -fPIC`
(no -ffast-math: it would reorder and contract the float operations) into a private folder: `$PFK_NATIVE_CACHE_DIR`
alone when set, else the checkout's `artifacts/.state/native`, else the user's cache folder
(`~/.cache/pfactory/native`), else `<temp>/pfk-native-<uid>`; a folder is used only if this user owns it
and no one else can write to it (created 0700). The file name is a hash of the source, the flags, the
compiler's version and this CPU's model and flags; written to a temp name and renamed (atomic); a library
file not owned by this user or writable by others is refused. `PFK_NATIVE=0` turns it off; that, no C
compiler, no private folder or a failed build falls back to the NumPy path with one line on the
`pfk.synth` logger (stderr when logging is not set up) saying why, once per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from pfactory.synth.layout import GROUND_REFLECTANCE
from pfactory.synth.materials import MATERIAL_EMISSION, MATERIAL_SPECULAR, MATERIAL_TEXTURE, N_MAT, Mat
from pfactory.synth.raycast import HIT_GROUND, HIT_NONE, KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, KIND_PRISM

log = logging.getLogger("pfk.synth")

_SOURCE = Path(__file__).with_name("_shade.c")
# -ffp-contract=off: no fused multiply-adds (NumPy rounds every product); no -ffast-math (no reordering)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_status = "not loaded"

_f32, _f64, _i32 = np.float32, np.float64, np.int32
_TABLES = (
    ("n_prim", ctypes.c_int64), ("kind", _i32), ("prm", _f32), ("yaw", _f32), ("taper", _f32), ("material", _i32),
    ("color", _f32),
)  # fmt: skip
_LAYOUT = (("road", _f64), ("n_lines", ctypes.c_int64), ("lines", _f64), ("ground_rgb", _f32))
# The exported functions' parameters in C order: (name, NumPy dtype of a pointer's array, or a scalar's ctype)
_PARAMS: dict[str, tuple[tuple[str, object], ...]] = {
    "pfs_shade": (
        ("n", ctypes.c_int64), ("t", _f64), ("prim", _i32), ("d32", _f32), ("view", _f32), ("w_sky", _f32),
        ("ehaze", _f32), ("origin", _f32), *_TABLES, *_LAYOUT, ("mat_tab", _f32), ("lf", _f32), ("ld", _f64),
        ("n_shadow", ctypes.c_int64), ("shadow", _f64), ("out", np.uint8),
    ),
    "pfs_surface": (
        ("n", ctypes.c_int64), ("points", _f64), ("prim", _i32), *_TABLES, ("reflectance", _f32), *_LAYOUT[:3],
        ("ground_rgb", _f32), ("ground_refl", _f32), ("normals", _f32), ("mat", np.int16), ("rgb", _f32),
        ("refl", _f32),
    ),
    "pfs_blur_noise": (("h", ctypes.c_int64), ("w", ctypes.c_int64), ("img", np.uint8), ("noise", np.uint8),
                       ("out", np.uint8)),
}  # fmt: skip


def _is_scalar(want: object) -> bool:
    return isinstance(want, type) and issubclass(want, ctypes._SimpleCData)


def _cpu_signature() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def folder_problem(path: Path) -> str | None:
    """Why `path` must not hold code: not a folder, another user's, or writable by group/others; None if private."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_candidates() -> list[Path]:
    """Where the build cache may live, best first (module docstring): `$PFK_NATIVE_CACHE_DIR` alone when set."""
    given = os.environ.get("PFK_NATIVE_CACHE_DIR")
    if given:
        return [Path(given)]
    out: list[Path] = []
    root = Path(__file__).resolve().parents[2]
    if (root / "dvc.yaml").is_file() and (root / "params.yaml").is_file():
        out.append(root / "artifacts" / ".state" / "native")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if not xdg:
        with contextlib.suppress(RuntimeError, KeyError):  # no home folder
            xdg = str(Path.home() / ".cache")
    if xdg:
        out.append(Path(xdg) / "pfactory" / "native")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    out.append(Path(tempfile.gettempdir()) / f"pfk-native-{uid}")
    return out


def _cache_dir() -> Path:
    """The first candidate that is (or can be created as) a folder private to this user; RuntimeError if none."""
    refused = []
    for path in cache_candidates():
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            refused.append(f"{path} ({e.strerror})")
            continue
        problem = folder_problem(path)
        if problem is None:
            return path
        refused.append(f"{path} ({problem})")
    raise RuntimeError("no private build cache: refused " + "; ".join(refused))


def _check_library_file(lib: Path) -> None:
    """Refuse a built library that another user owns or that others can write (RuntimeError)."""
    st = os.stat(lib)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"refusing {lib}: owned by uid {st.st_uid} (you: {uid}), mode {stat.S_IMODE(st.st_mode):o}"
        )


def _constants() -> dict[str, int]:
    """The enum values the C source repeats from Python (hit codes, primitive kinds, materials)."""
    return {
        "HIT_GROUND": HIT_GROUND, "HIT_NONE": HIT_NONE, "KIND_BOX": KIND_BOX, "KIND_CYLINDER": KIND_CYLINDER,
        "KIND_ELLIPSOID": KIND_ELLIPSOID, "KIND_PRISM": KIND_PRISM, "MAT_ASPHALT": int(Mat.ASPHALT),
        "MAT_LANE_PAINT": int(Mat.LANE_PAINT), "MAT_GLASS": int(Mat.GLASS), "MAT_FACADE": int(Mat.FACADE),
        "N_MAT": N_MAT,
    }  # fmt: skip


def check_constants(text: str) -> None:
    """RuntimeError unless every `NAME = value` of `_constants()` appears in the C source `text`."""
    for name, value in _constants().items():
        if not re.search(rf"\b{name} = {value}\b", text):
            raise RuntimeError(f"{_SOURCE.name}: `{name}` is not {value} as in Python; the C enums are stale")


def build(source: Path = _SOURCE, out_dir: Path | None = None) -> ctypes.CDLL:
    """Compile `source` (cached by source, flags, compiler and CPU) and load it, each `_PARAMS` function typed.

    Raises RuntimeError (no compiler, a failed build, a cache folder or library file refused) or OSError."""
    text = source.read_text()
    check_constants(text)  # first: a source whose enums disagree with Python is never built or loaded
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([text, " ".join(_FLAGS), version, _cpu_signature()]).encode()).hexdigest()
    if out_dir is None:
        out_dir = _cache_dir()
    else:
        problem = folder_problem(out_dir)
        if problem:
            raise RuntimeError(f"refusing the build cache {out_dir}: {problem}")
    lib = out_dir / f"pfs_shade_{key[:16]}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=out_dir)
        os.close(fd)
        try:
            res = subprocess.run(
                [cc, *_FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300
            )
            if res.returncode:
                raise RuntimeError(f"{cc} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
            os.chmod(tmp, 0o700)
            os.replace(tmp, lib)  # atomic: a concurrent builder's identical file may win, either is fine
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _check_library_file(lib)
    cdll = ctypes.CDLL(str(lib))
    for name, params in _PARAMS.items():
        fn = getattr(cdll, name)
        fn.argtypes = [p if _is_scalar(p) else ctypes.c_void_p for _, p in params]
        fn.restype = ctypes.c_int
    return cdll


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _status
    if os.environ.get("PFK_NATIVE", "1") == "0":
        _status = "off (PFK_NATIVE=0)"
    else:
        try:
            lib = build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _status = f"unavailable ({e})"
        else:
            _status = "native"
            return lib
    log.warning(
        "pfactory.synth: camera shading and surface() run in NumPy (same bytes, slower): the C kernel is %s",
        _status,
    )
    return None


def available() -> bool:
    """True when the C kernel is built and loaded (the first call builds it, ~1 s, or says why not)."""
    return _library() is not None


def status() -> str:
    """ "native", or why the NumPy path is used instead."""
    _library()
    return _status


def _call(lib: ctypes.CDLL, name: str, **arguments: object) -> int:
    """Call C function `name` with every parameter by its C name: arrays C-contiguous of the declared dtype."""
    params = _PARAMS[name]
    if set(arguments) != {p for p, _ in params}:
        raise TypeError(f"{name}: arguments {sorted(arguments)} do not match {[p for p, _ in params]}")
    values: list[object] = []
    for pname, want in params:
        v = arguments[pname]
        if _is_scalar(want):
            values.append(int(v))  # type: ignore[call-overload]
            continue
        if not isinstance(v, np.ndarray) or v.dtype != want or not v.flags.c_contiguous:
            raise TypeError(f"{name}: `{pname}` must be a C-contiguous {np.dtype(want)} array")  # type: ignore[call-overload]
        values.append(v.ctypes.data)
    return getattr(lib, name)(*values)


@functools.cache
def _material_table() -> np.ndarray:
    """`[N_MAT, 4]` float32: texture amplitude, 1 / texture cell (float32 division), specular, emission."""
    tex = MATERIAL_TEXTURE.astype(np.float32)
    tab = np.stack(
        [tex[:, 0], np.float32(1.0) / tex[:, 1], MATERIAL_SPECULAR.astype(np.float32),
         MATERIAL_EMISSION.astype(np.float32)], 1,
    )  # fmt: skip
    tab.setflags(write=False)
    return np.ascontiguousarray(tab)


def _tables(scene) -> dict[str, object]:
    """The primitive and layout tables `pfs_shade` and `pfs_surface` read, each value as NumPy's reference
    computes it (the float64 cos/sin of the yaws rounded to float32 for the normals, NumPy's float32 cos/sin
    of the float32 yaws for the façade windows, the road's cos/sin)."""
    prims, layout = scene.prims, scene.layout
    params32 = prims.params.astype(np.float32)
    yaw = np.stack(
        [np.cos(prims.params[:, 6]).astype(np.float32), np.sin(prims.params[:, 6]).astype(np.float32),
         np.cos(params32[:, 6]), np.sin(params32[:, 6])], 1,
    ).reshape(-1, 4)  # fmt: skip
    road = [float(np.cos(layout.road_yaw)), float(np.sin(layout.road_yaw)), float(layout.stall_offset)]
    for side in layout.sides:
        perpendicular = 1.0 if side.parking == "perpendicular" else 0.0
        road += [
            float(side.sign),
            float(side.lane_edge),
            float(side.asphalt_edge),
            perpendicular,
            float(side.ground),
        ]
    lines = [(u, 1.0 if dashed else 0.0) for u, dashed in layout.lines]
    ground_rgb = np.zeros((N_MAT, 3), dtype=np.float32)  # as `sensors._ground_tables`
    for m, c in layout.colors.items():
        ground_rgb[m] = c
    return {
        "n_prim": len(prims),
        "kind": prims.kind.astype(np.int32),
        "prm": params32,
        "yaw": np.ascontiguousarray(yaw),
        "taper": prims.taper.astype(np.float32),
        "material": prims.material.astype(np.int32),
        "color": np.ascontiguousarray(prims.color, np.float32),
        "road": np.array(road, dtype=np.float64),
        "n_lines": len(lines),
        "lines": np.array(lines, dtype=np.float64).reshape(-1, 2),
        "ground_rgb": ground_rgb,
    }


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"pfactory.synth.native: the C kernel is {_status}")
    return lib


def shade(
    scene, grid, t: np.ndarray, prim: np.ndarray, ehaze: np.ndarray, shadowing: np.ndarray
) -> np.ndarray:
    """The C twin of `sensors._shade_numpy`: `rgb [H, W, 3]` uint8 (before optical blur and sensor noise).

    `grid` the camera's `CameraGrid`; `t [H, W]` float64 and `prim [H, W]` int32 the first hits;
    `ehaze [H*W]` float32 `exp(-(t * d_len) / haze_m)` as NumPy computes it; `shadowing [M]` bool the
    labelled objects that darken the ground under them. Requires `available()`."""
    lib = _lib()
    light = scene.light
    height, width = t.shape
    n = height * width
    if prim.shape != t.shape or grid.d32.shape != (n, 3) or grid.view.shape != (n, 3) or ehaze.shape != (n,):
        raise ValueError(f"shade: t {t.shape}, prim {prim.shape}, grid and ehaze {ehaze.shape} disagree")
    boxes = scene.boxes[shadowing] if len(scene.boxes) else np.zeros((0, 7))
    shadow = np.zeros((len(boxes), 7), dtype=np.float64)
    for k, b in enumerate(boxes):  # each value as `sensors._contact_shadow` computes it
        shadow[k] = (b[0], b[1], b[3], b[4], np.cos(b[6]), np.sin(b[6]), 0.5 * np.hypot(b[3], b[4]) + 0.4)
    lf = np.concatenate(
        [light.sun.astype(np.float32), np.array([light.ambient, light.sun_strength], dtype=np.float32),
         light.horizon.astype(np.float32), np.array([255.0 * light.exposure], dtype=np.float32)]
    )  # fmt: skip
    out = np.empty((height, width, 3), dtype=np.uint8)
    code = _call(
        lib, "pfs_shade", n=height * width, t=np.ascontiguousarray(t, np.float64).reshape(-1),
        prim=np.ascontiguousarray(prim, np.int32).reshape(-1), d32=grid.d32, view=grid.view, w_sky=grid.w_sky,
        ehaze=ehaze, origin=grid.origin.astype(np.float32), **_tables(scene), mat_tab=_material_table(), lf=lf,
        ld=np.concatenate([light.horizon, light.zenith]).astype(np.float64), n_shadow=len(shadow),
        shadow=shadow, out=out,
    )  # fmt: skip
    if code:
        raise RuntimeError(f"pfactory.synth.native: pfs_shade refused its arguments (code {code})")
    return out


def surface(scene, points: np.ndarray, prim: np.ndarray):
    """The C twin of `sensors._surface_numpy`: surface properties at hit points `points [N, 3]` (float64,
    lidar frame) on `prim [N]` (>= 0, or HIT_GROUND) -> `normals [N, 3]` float32, `material [N]` int16,
    `rgb [N, 3]` float32 albedo, `reflectance [N]` float32. Requires `available()`."""
    lib = _lib()
    n = len(points)
    if points.shape != (n, 3) or prim.shape != (n,):
        raise ValueError(f"surface: points {points.shape} and prim {prim.shape} disagree")
    normals = np.empty((n, 3), dtype=np.float32)
    mat = np.empty(n, dtype=np.int16)
    rgb = np.empty((n, 3), dtype=np.float32)
    refl = np.empty(n, dtype=np.float32)
    code = _call(
        lib, "pfs_surface", n=n, points=np.ascontiguousarray(points, np.float64),
        prim=np.ascontiguousarray(prim, np.int32), **_tables(scene),
        reflectance=np.ascontiguousarray(scene.prims.reflectance, np.float32),
        ground_refl=_ground_reflectance(), normals=normals, mat=mat, rgb=rgb, refl=refl,
    )  # fmt: skip
    if code:
        raise RuntimeError(f"pfactory.synth.native: pfs_surface refused its arguments (code {code})")
    return normals, mat, rgb, refl


@functools.cache
def _ground_reflectance() -> np.ndarray:
    """`[N_MAT]` float32 lidar reflectance of the ground materials (as `sensors._ground_tables`)."""
    refl = np.zeros(N_MAT, dtype=np.float32)
    for m, r in GROUND_REFLECTANCE.items():
        refl[m] = r
    refl.setflags(write=False)
    return refl


def blur_noise(img: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The C twin of `sensors._blur_noise_numpy`: `img [H, W, 3]` uint8 blurred, plus the sensor noise drawn
    from `noise [H, W, 3]` uint8 random bytes -> `[H, W, 3]` uint8. Requires `available()`."""
    lib = _lib()
    for name, a in (("img", img), ("noise", noise)):
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or not a.flags.c_contiguous:
            raise TypeError(f"blur_noise: `{name}` must be a C-contiguous [H, W, 3] uint8 array")
    if noise.shape != img.shape:
        raise TypeError(f"blur_noise: noise {noise.shape} and img {img.shape} differ")
    out = np.empty_like(img)
    _call(lib, "pfs_blur_noise", h=img.shape[0], w=img.shape[1], img=img, noise=noise, out=out)
    return out
