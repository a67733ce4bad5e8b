"""Sensor models of the synthetic generator: a spinning multi-beam lidar and pinhole cameras.

Both cast rays against the same `Scene` (`raycast.cast`), so what the lidar hits is
exactly what the camera sees. Frames: lidar frame (x forward, y left, z up, metres), lidar at
the origin; cameras x right, y down, z forward with `T_cam_from_lidar [4, 4]` and `K [3, 3]`,
pixel centres at integer coordinates (the `pfactory.sensors.geometry.project_to_image` convention).

Lidar: HDL-64E-like beam table (+2 deg .. -24.8 deg, two blocks with 1/3 and 1/2 deg
spacing), `n_azimuth` steps per turn with a random start phase. Per return: range noise
(Gaussian, 2 cm), material effects (glass drops most beams, foliage lets beams penetrate),
a detection probability from a link budget `reflectance * cos(incidence) / range^2` (far,
dark, grazing surfaces fade out as on a real sensor, e.g. the ground past ~40 m), random
dropout, and an intensity in [0, 1] quantised to 0.01 like KITTI's.

Camera: per-pixel ray cast (exact z-buffer, no painter's-algorithm errors), Lambert + ambient
+ a Blinn-Phong highlight on paint and glass, self-lit lamps (white/yellow head, red tail), value-noise textures, lane markings, façade
windows, dark contact patches under vehicles, a sky gradient, distance haze, exposure, a
slight optical blur and sensor noise. An object-id buffer and each labelled object's
unoccluded silhouette come back too (for KITTI's occlusion levels).

The per-pixel shading and `surface()` have a C twin (`native`, `_shade.c`) used where a compiler
is available; the NumPy functions here (`_shade_numpy`, `_blur_noise_numpy`, `_surface_numpy`)
are the reference it must match byte for byte, and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pfactory.synth import native
from pfactory.synth.layout import GROUND_REFLECTANCE, GROUND_Z
from pfactory.synth.materials import (
    MATERIAL_DROPOUT,
    MATERIAL_EMISSION,
    MATERIAL_PENETRATION,
    MATERIAL_SPECULAR,
    MATERIAL_TEXTURE,
    N_MAT,
    Mat,
)
from pfactory.synth.raycast import (
    HIT_GROUND,
    HIT_NONE,
    Window,
    camera_windows,
    cast,
    lidar_windows,
    put_rows,
    rows_of,
    surface_normals,
)
from pfactory.synth.scene import Scene

# HDL-64E: an upper block of 32 lasers at ~1/3 deg spacing and a lower block of 32 at ~1/2 deg;
# KITTI quotes +2.0 .. -24.8 deg overall.
HDL64_ELEVATION_DEG = np.concatenate([np.linspace(2.0, -8.33, 32), np.linspace(-8.83, -24.8, 32)])
# A real unit's lasers are not exactly where the table says; a fixed small offset per laser
# (the same for every frame, like a calibration residual) breaks the perfectly regular rings.
HDL64_ELEVATION_DEG = HDL64_ELEVATION_DEG + np.random.default_rng(64).normal(0, 0.02, 64)


@dataclass
class LidarSpec:
    """A spinning lidar: beam elevations (deg, descending), azimuth steps per turn, max range
    (m), range noise sigma (m), random dropout probability and the link-budget constants."""

    elevation_deg: np.ndarray
    n_azimuth: int = 2000  # HDL-64E at 10 Hz: ~2080 firings per laser per turn
    max_range_m: float = 100.0
    range_sigma_m: float = 0.02
    dropout: float = 0.06
    # Detection: p = 1 - exp(-gain * refl * cos / (r / ref_range)^2). Chosen so that asphalt
    # (refl 0.3) at grazing incidence returns ~85% at 30 m and ~35% at 50 m, in line with the
    # ground-return fall-off of the real KITTI scans in ../shared/data/real (few ground points
    # beyond 40 m, intensity ~0 there) while cars stay visible to 70+ m.
    gain: float = 40.0
    ref_range_m: float = 50.0


def hdl64() -> LidarSpec:
    return LidarSpec(HDL64_ELEVATION_DEG.copy())


@dataclass
class CameraSpec:
    """One pinhole camera: channel name, `K [3, 3]`, `T_cam_from_lidar [4, 4]`, `(width, height)`."""

    name: str
    K: np.ndarray
    T_cam_from_lidar: np.ndarray
    image_size: tuple[int, int]


# --- shared surface model ---------------------------------------------------------------------


def _ground_tables(scene: Scene) -> tuple[np.ndarray, np.ndarray]:
    rgb = np.zeros((N_MAT, 3), dtype=np.float32)
    refl = np.zeros(N_MAT, dtype=np.float32)
    for m, c in scene.layout.colors.items():
        rgb[m] = c
    for m, r in GROUND_REFLECTANCE.items():
        refl[m] = r
    return rgb, refl


def surface(scene: Scene, points: np.ndarray, prim: np.ndarray):
    """Surface properties at hit points `points [N, 3]` on `prim [N]` (>= 0, or HIT_GROUND).

    Returns `normals [N, 3]` float32, `material [N]` int16, `rgb [N, 3]` float32 albedo and
    `reflectance [N]` float32 (lidar, 905 nm). In C (`pfactory.synth.native`) for float64 points
    (the lidar's) where a compiler is available, else `_surface_numpy`: the same bytes either way.
    """
    if points.dtype == np.float64 and native.available():
        return native.surface(scene, points, prim)
    return _surface_numpy(scene, points, prim)


def _surface_numpy(scene: Scene, points: np.ndarray, prim: np.ndarray):
    """`surface`'s NumPy reference (`pfactory/synth/_shade.c` repeats it operation by operation).

    Ground rows read `points` as they come (float64 promoted from float32 ones), primitive rows
    their float32 rounding.
    """
    n = len(points)
    normals = np.zeros((n, 3), dtype=np.float32)
    normals[:, 2] = 1.0
    mat = np.zeros(n, dtype=np.int16)
    rgb = np.zeros((n, 3), dtype=np.float32)
    refl = np.zeros(n, dtype=np.float32)
    g = np.flatnonzero(prim == HIT_GROUND)
    if len(g):
        g_rgb, g_refl = _ground_tables(scene)
        mg = scene.layout.ground(points[g, 0], points[g, 1])
        mat[g], rgb[g], refl[g] = mg, g_rgb[mg], g_refl[mg]
    o = np.flatnonzero(prim != HIT_GROUND)
    if len(o):
        p = prim[o]
        nrm, top = surface_normals(scene.prims, rows_of(points, o), p)
        flat = 2 * p + top  # (primitive, sides/top) flattened: one gather instead of two
        put_rows(normals, o, nrm)
        mat[o] = scene.prims.material.reshape(-1)[flat]
        put_rows(rgb, o, rows_of(scene.prims.color.reshape(-1, 3), flat))
        refl[o] = scene.prims.reflectance.reshape(-1)[flat]
        _facade_windows(scene, points, prim, o, mat, rgb, refl, normals)
    return normals, mat, rgb, refl


def _facade_windows(scene, points, prim, rows, mat, rgb, refl, normals) -> None:
    """Windows on building façades: a grid of glass panes (shop windows on the ground floor).

    `rows` index the primitive hits among `points [N, 3]` / `prim [N]`; façade walls get panes.
    """
    f = rows[(mat[rows] == Mat.FACADE) & (np.abs(normals[rows, 2]) < 0.5)]
    if len(f) == 0:
        return
    params32 = scene.prims.params.astype(np.float32)
    pf = prim[f]
    p = params32[pf]  # [F, 7]
    # float32 cos/sin of each primitive's yaw, computed per primitive then gathered (the C kernel takes the
    # same per-primitive table: NumPy's SIMD cos is not libm's)
    cw, sw = np.cos(params32[:, 6])[pf], np.sin(params32[:, 6])[pf]
    d = points[f].astype(np.float32) - p[:, :3]
    lx, ly = cw * d[:, 0] + sw * d[:, 1], -sw * d[:, 0] + cw * d[:, 1]
    along = np.where(np.abs(lx) / p[:, 3] > np.abs(ly) / p[:, 4], ly, lx)  # coordinate in the face
    z = d[:, 2] + 0.5 * p[:, 5]  # height above the façade's foot
    # Each building gets its own window rhythm from its size (deterministic, no RNG needed).
    period = 2.6 + np.mod(p[:, 3] * 7.31, 1.2)
    zf = np.mod(z - 3.6, 3.1)
    upper = (z > 3.6) & (np.mod(along, period) < 0.55 * period) & (zf > 0.9) & (zf < 2.4)
    shop = (z > 0.5) & (z < 3.0) & (np.mod(along, 2 * period) < 1.4 * period)
    win = f[(upper | shop) & (z < p[:, 5] - 0.8)]
    mat[win] = Mat.GLASS
    rgb[win] = (0.16, 0.2, 0.25)
    refl[win] = 0.05


def _hash01(cells: np.ndarray) -> np.ndarray:
    """Deterministic value noise `[N]` float32 in [0, 1) from integer cells `[N, 3]` int32
    (a uint32 wrap-around hash: the same bits on every platform)."""
    h = cells.view(np.uint32)
    x = h[:, 0] * np.uint32(73856093) ^ h[:, 1] * np.uint32(19349663) ^ h[:, 2] * np.uint32(83492791)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0x5BD1E995)
    x ^= x >> np.uint32(15)
    return (x & np.uint32(0xFFFF)).astype(np.float32) * np.float32(1.0 / 65536.0)


# --- lidar ------------------------------------------------------------------------------------


@dataclass
class LidarSweep:
    """One turn: `points [N, 4]` float32 (x, y, z, intensity) lidar frame; `owner [N]` int32
    labelled-object index of the surface each point came from (-1: ground or clutter)."""

    points: np.ndarray
    owner: np.ndarray


def simulate_lidar(scene: Scene, rng: np.random.Generator, spec: LidarSpec) -> LidarSweep:
    """Ray-cast one lidar turn against `scene` (see the module docstring for the sensor model)."""
    el = np.radians(spec.elevation_deg)  # [B]
    step = 2 * np.pi / spec.n_azimuth
    az0 = -np.pi + rng.uniform(0, step)  # the turn starts at a random phase
    az = az0 + step * np.arange(spec.n_azimuth)  # [A]
    ce, se = np.cos(el)[:, None], np.sin(el)[:, None]
    dx, dy = ce * np.cos(az)[None], ce * np.sin(az)[None]  # [B, A]
    dz = np.broadcast_to(se, dx.shape)
    prims = scene.prims
    origin = np.zeros(3)
    windows = lidar_windows(prims.params, el, az0, step, spec.n_azimuth)
    # Nearest possible range of each primitive; casting near-to-far lets the z-test skip
    # primitives hidden behind closer ones (façades behind parked cars, back rows of trees).
    min_t = np.maximum(
        np.linalg.norm(prims.params[:, :3], axis=1) - 0.5 * np.linalg.norm(prims.params[:, 3:6], axis=1), 0.0
    )
    res = cast(
        prims,
        origin,
        (dx, dy, dz),
        windows,
        GROUND_Z,
        spec.max_range_m,
        np.argsort(min_t, kind="stable"),
        min_t,
    )
    hit = np.flatnonzero(res.prim.ravel() != HIT_NONE)  # beam-major order, like a ring buffer
    t = res.t.ravel()[hit]
    prim = res.prim.ravel()[hit]
    d = np.stack([dx.ravel()[hit], dy.ravel()[hit], dz.ravel()[hit]], 1)  # [N, 3] unit
    pts = d * t[:, None]
    normals, mat, _rgb, refl = surface(scene, pts, prim)
    cos_inc = np.clip(np.abs(np.einsum("ij,ij->i", normals, d)), 0.0, 1.0)
    link = refl * cos_inc / (t / spec.ref_range_m) ** 2
    p_det = (1.0 - spec.dropout) * (1.0 - np.exp(-spec.gain * link)) * (1.0 - MATERIAL_DROPOUT[mat])
    u_det = rng.random(len(t))
    noise = rng.normal(0.0, spec.range_sigma_m, len(t))
    pen_mean = MATERIAL_PENETRATION[mat]
    penetration = rng.exponential(1.0, len(t)) * pen_mean
    i_noise = rng.normal(0.0, 0.015, len(t))
    keep = u_det < p_det
    r = t + noise + penetration
    keep &= r < spec.max_range_m
    # Intensity: reflectance, mildly angle dependent (the HDL-64E's returns are calibrated
    # per laser), fading to 0 for weak returns as KITTI's far ground does.
    weak = np.clip(spec.gain * link / 3.0, 0.0, 1.0)
    intensity = np.clip(refl * (0.8 + 0.2 * cos_inc) * weak + i_noise, 0.0, 1.0)
    xyz = d[keep] * r[keep, None]
    out = np.empty((int(keep.sum()), 4), dtype=np.float32)
    out[:, :3] = np.round(xyz, 3)  # millimetre resolution, as the sensor's packets carry
    out[:, 3] = np.round(intensity[keep], 2)
    owner = np.where(prim[keep] >= 0, prims.owner[np.maximum(prim[keep], 0)], -1).astype(np.int32)
    return LidarSweep(out, owner)


# --- camera -----------------------------------------------------------------------------------


@dataclass
class CameraImage:
    """One render: `rgb [H, W, 3]` uint8; `ids [H, W]` int32 labelled-object index per pixel
    (-1: ground, sky or clutter); `visible [M]` / `silhouette [M]` pixel counts of each labelled
    object as seen (occluded) and alone (unoccluded), both within the image."""

    rgb: np.ndarray
    ids: np.ndarray
    visible: np.ndarray
    silhouette: np.ndarray


def camera_rays(cam: CameraSpec) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Camera centre in the lidar frame `[3]` and per-pixel ray directions `(dx, dy, dz)`, each
    `[H, W]`, scaled so the camera-z component is 1 (ray parameter t = depth)."""
    width, height = cam.image_size
    K = np.asarray(cam.K, dtype=np.float64)
    R, tr = cam.T_cam_from_lidar[:3, :3], cam.T_cam_from_lidar[:3, 3]
    u = np.arange(width, dtype=np.float64)
    v = np.arange(height, dtype=np.float64)
    # Pinhole without skew: camera-frame direction (x, y, 1) per pixel.
    xc = (u - K[0, 2]) / K[0, 0]  # [W]
    yc = (v - K[1, 2]) / K[1, 1]  # [H]
    Rt = R.T  # camera axes expressed in the lidar frame, as columns
    dirs = tuple(Rt[i, 0] * xc[None, :] + Rt[i, 1] * yc[:, None] + Rt[i, 2] for i in range(3))
    return -Rt @ tr, dirs  # type: ignore[return-value]


@dataclass(frozen=True)
class CameraGrid:
    """What a camera's pixels need in every frame, computed once per camera (`camera_grid`).

    `origin [3]` and `dirs (dx, dy, dz) [H, W]` float64 as `camera_rays`; per pixel, flattened
    row-major `[H*W]`: `d32 [H*W, 3]` the directions in float32, `d_len [H*W]` their length and
    `view [H*W, 3]` the unit vector back to the camera (both float32), `w_sky [H*W]` float32 the
    zenith colour's weight in the sky gradient. All read-only.
    """

    origin: np.ndarray
    dirs: tuple[np.ndarray, np.ndarray, np.ndarray]
    d32: np.ndarray
    d_len: np.ndarray
    view: np.ndarray
    w_sky: np.ndarray


_GRIDS: dict[bytes, CameraGrid] = {}
_MAX_GRIDS = 8  # a nuScenes rig has 6 cameras; ~25 MB each at 1242x375


def camera_grid(cam: CameraSpec) -> CameraGrid:
    """`cam`'s `CameraGrid`, cached per process by its intrinsics, pose and image size (each
    frame's render reads the same arrays instead of recomputing them: every value is the same
    as computing it per frame, element by element)."""
    key = np.asarray(cam.K, np.float64).tobytes() + np.asarray(cam.T_cam_from_lidar, np.float64).tobytes()
    key += np.asarray(cam.image_size, np.int64).tobytes()
    grid = _GRIDS.get(key)
    if grid is not None:
        return grid
    origin, dirs = camera_rays(cam)
    dx, dy, dz = (a.ravel() for a in dirs)
    d32 = np.stack([dx, dy, dz], 1).astype(np.float32)  # [H*W, 3]
    d_len = np.sqrt(np.einsum("ij,ij->i", d32, d32))
    view = d32 * (np.float32(-1.0) / d_len)[:, None]
    # Sky: horizon colour blending into the zenith colour with the ray's elevation.
    el = dz / np.sqrt(dx**2 + dy**2 + dz**2)
    w_sky = (np.clip(el / 0.4, 0, 1) ** 0.7).astype(np.float32)
    arrays = (origin, *dirs, d32, d_len, view, w_sky)
    for a in arrays:
        a.setflags(write=False)
    if len(_GRIDS) >= _MAX_GRIDS:
        _GRIDS.pop(next(iter(_GRIDS)))
    grid = _GRIDS[key] = CameraGrid(origin, dirs, d32, d_len, view, w_sky)
    return grid


def render_camera(
    scene: Scene, cam: CameraSpec, rng: np.random.Generator, track_objects: bool = False
) -> CameraImage:
    """Render `scene` through `cam`; with `track_objects` also count each labelled object's
    visible and unoccluded pixels (used for KITTI occlusion levels)."""
    grid = camera_grid(cam)
    origin, (dx, dy, dz) = grid.origin, grid.dirs
    prims = scene.prims
    windows, min_depth = camera_windows(prims.params, cam.T_cam_from_lidar, cam.K, cam.image_size)
    m = len(scene.boxes)
    owner_windows: dict[int, Window] = {}
    if track_objects and m:
        obj_windows, _ = camera_windows(scene.boxes, cam.T_cam_from_lidar, cam.K, cam.image_size)
        owner_windows = {i: w for i, w in enumerate(obj_windows) if w is not None}
    res = cast(
        prims, origin, (dx, dy, dz), windows, GROUND_Z, 400.0,
        np.argsort(min_depth, kind="stable"), min_depth, owner_windows,
    )  # fmt: skip
    ids = np.where(res.prim >= 0, prims.owner[np.maximum(res.prim, 0)], -1).astype(np.int32)
    visible = np.bincount(ids[ids >= 0].ravel(), minlength=m)[:m] if m else np.zeros(0, np.int64)
    img = _shade(scene, grid, res.t, res.prim, rng, visible > 0)
    silhouette = np.zeros(m, dtype=np.int64)
    for i, (_w, mask) in res.owner_masks.items():
        silhouette[i] = int(mask.sum())
    return CameraImage(img, ids, visible, silhouette)


def _shade(scene: Scene, grid: CameraGrid, t, prim, rng, shadowing: np.ndarray) -> np.ndarray:
    """Colour every pixel `[H, W, 3]` uint8 from the first hits `t, prim [H, W]` of `grid`'s rays.

    `shadowing [M]` bool: labelled objects that darken the ground under them (the visible
    ones; a hidden object's patch would be hidden too, and it may be dropped from the labels).
    The shading runs in C (`pfactory.synth.native`) where a compiler is available, else in NumPy
    (`_shade_numpy`): the same bytes either way. Then an optical blur and sensor noise.
    """
    # The haze's exponential, in NumPy for both paths (NumPy's SIMD exp is not libm's): float32
    # `exp(-(t * |d|) / haze_m)` per pixel [H*W] (0 for sky pixels, whose t is inf).
    ehaze = np.exp(-(t.astype(np.float32).reshape(-1) * grid.d_len) * np.float32(1.0 / scene.light.haze_m))
    # Sensor noise: the sum of two uniform 0..3 draws minus 3 (triangular, sigma 1.6 DN) from one
    # random byte per value: 1 ms instead of 28 ms for Gaussian draws, and visually the same.
    height, width = t.shape
    noise = np.frombuffer(rng.bytes(height * width * 3), dtype=np.uint8).reshape(height, width, 3)
    if native.available():
        return native.blur_noise(native.shade(scene, grid, t, prim, ehaze, shadowing), noise)
    return _blur_noise_numpy(_shade_numpy(scene, grid, t, prim, ehaze, shadowing), noise)


def _blur_noise_numpy(img: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Optical blur and sensor noise on `img [H, W, 3]` uint8 -> `[H, W, 3]` uint8; `noise [H, W, 3]`
    uint8 random bytes, one per value.

    Optics: no real lens is pixel-sharp. A 3x3 binomial kernel (~Gaussian sigma 0.7 px), rounded half
    up, `(S + 8) >> 4`, on interior pixels; border rows and columns stay as they are. These are the
    bytes of Pillow's `ImageFilter.Kernel((3, 3), (1, 2, 1, 2, 4, 2, 1, 2, 1))` (its float sums of
    multiples of 1/16 are exact), in integers here and in `pfactory/synth/_shade.c`.
    Noise: `(b & 3) + ((b >> 2) & 3) - 3` per value (triangular, sigma 1.6 DN), clipped to 0..255.
    """
    out = img.astype(np.int16)
    height, width, _ = img.shape
    if height >= 3 and width >= 3:
        a = img.astype(np.uint16)
        rows = a[:-2] + 2 * a[1:-1] + a[2:]  # [H-2, W, 3] vertical (1, 2, 1)
        s = rows[:, :-2] + 2 * rows[:, 1:-1] + rows[:, 2:]  # [H-2, W-2, 3] horizontal (1, 2, 1)
        out[1:-1, 1:-1] = (s + 8) >> 4
    out += (noise & 3).astype(np.int16) + ((noise >> 2) & 3) - 3
    return np.clip(out, 0, 255).astype(np.uint8)


def _dot3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot products `[N]` of `a [N, 3]` and `b [N, 3]` (or `[3]`) as `(a0*b0 + a1*b1) + a2*b2`:
    the rounding the C kernel reproduces (einsum and BLAS may sum in another order or fuse)."""
    b0, b1, b2 = (b[..., k] for k in range(3))
    return a[:, 0] * b0 + a[:, 1] * b1 + a[:, 2] * b2


def _pow40(x: np.ndarray) -> np.ndarray:
    """`x**40` by repeated squaring (`x^32 * x^8`), which C reproduces exactly (libm's powf may not)."""
    x2 = x * x
    x4 = x2 * x2
    x8 = x4 * x4
    x16 = x8 * x8
    return (x16 * x16) * x8


def _shade_numpy(
    scene: Scene, grid: CameraGrid, t, prim, ehaze: np.ndarray, shadowing: np.ndarray
) -> np.ndarray:
    """The shading's NumPy reference: `rgb [H, W, 3]` uint8 before blur and noise (see `_shade`).

    `ehaze [H*W]` float32 the haze exponential. `pfactory/synth/_shade.c` repeats every operation
    here in the same order and precision; change both together (tests/synth/test_synth_native.py).
    """
    light = scene.light
    height, width = t.shape
    prim_f, t_f = prim.ravel(), t.ravel()
    out = np.empty((height * width, 3), dtype=np.float32)
    sky = np.flatnonzero(prim_f == HIT_NONE)
    w_sky = np.take(grid.w_sky, sky)[:, None]
    put_rows(out, sky, (light.horizon * (1 - w_sky) + light.zenith * w_sky).astype(np.float32))
    hit = np.flatnonzero(prim_f != HIT_NONE)
    p_idx = prim_f[hit]
    f32 = np.float32
    # float32 from here on: colours need no more, and it halves the memory traffic.
    d = rows_of(grid.d32, hit)  # [Nh, 3]
    th = t_f[hit].astype(f32)
    pts = grid.origin.astype(f32) + d * th[:, None]
    normals, mat, rgb, _refl = _surface_numpy(scene, pts, p_idx)
    view = rows_of(grid.view, hit)
    n_dot_v = _dot3(normals, view)
    normals[n_dot_v < 0] *= -1  # seen from behind (thin parts): light the visible side
    # Texture: value noise on a per-material cell grid, so asphalt, grass and leaves look grainy.
    tex_amp, tex_cell = MATERIAL_TEXTURE.astype(f32).T
    cells = np.floor(pts * (f32(1.0) / tex_cell)[mat][:, None]).astype(np.int32)
    cells[:, 0] += mat.astype(np.int32) * 7919  # different materials, different patterns
    tex = f32(1.0) + tex_amp[mat] * (f32(2.0) * _hash01(cells) - f32(1.0))
    sun = light.sun.astype(f32)
    ndl = np.clip(_dot3(normals, sun), 0.0, 1.0)
    # Sky light comes mostly from above; the sun adds Lambertian light.
    shade = f32(light.ambient) * (f32(0.75) + f32(0.25) * normals[:, 2]) + f32(light.sun_strength) * ndl
    spec_k = MATERIAL_SPECULAR.astype(f32)[mat]
    shiny = np.flatnonzero(spec_k > 0)
    spec = np.zeros(len(hit), dtype=f32)
    if len(shiny):
        half = sun + rows_of(view, shiny)
        half /= np.sqrt(_dot3(half, half))[:, None]
        n_dot_h = np.clip(_dot3(rows_of(normals, shiny), half), 0, 1)
        spec[shiny] = spec_k[shiny] * _pow40(n_dot_h) * f32(light.sun_strength)
    col = rgb * (tex * shade + MATERIAL_EMISSION.astype(f32)[mat])[:, None] + spec[:, None]
    g = np.flatnonzero(p_idx == HIT_GROUND)
    if len(g) and shadowing.any():
        col[g] *= _contact_shadow(scene.boxes[shadowing], pts[g])[:, None]
    haze = (f32(1.0) - np.take(ehaze, hit))[:, None]
    put_rows(out, hit, col * (f32(1.0) - haze) + light.horizon.astype(f32) * haze)
    return np.clip(out.reshape(height, width, 3) * (255.0 * light.exposure) + 0.5, 0, 255).astype(np.uint8)


def _contact_shadow(boxes: np.ndarray, ground_pts: np.ndarray) -> np.ndarray:
    """Darkening factor `[N]` for ground points `[N, 3]` under `boxes [M, 7]` (ambient
    occlusion: there is little sky light under a car, whatever the sun does)."""
    f = np.ones(len(ground_pts), dtype=np.float32)
    for b in boxes:
        r = 0.5 * np.hypot(b[3], b[4]) + 0.4
        near = np.flatnonzero((np.abs(ground_pts[:, 0] - b[0]) < r) & (np.abs(ground_pts[:, 1] - b[1]) < r))
        if len(near) == 0:
            continue
        c, s = np.cos(b[6]), np.sin(b[6])
        q = ground_pts[near, :2] - b[:2]
        lx, ly = (
            np.abs(c * q[:, 0] + s * q[:, 1]) - 0.5 * b[3],
            np.abs(-s * q[:, 0] + c * q[:, 1]) - 0.5 * b[4],
        )
        outside = np.hypot(np.maximum(lx, 0), np.maximum(ly, 0))  # 0 inside the footprint
        dark = np.where(outside > 0, 0.45 + 0.55 * np.clip(outside / 0.35, 0, 1), 0.4)
        f[near] = np.minimum(f[near], dark)
    return f
