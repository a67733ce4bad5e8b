"""Scene sampling for the synthetic generator: a street, labelled road users and clutter.

Everything is in the lidar frame (x forward, y left, z up, metres; the lidar at the origin,
`LIDAR_HEIGHT_M` above a flat ground at `z = GROUND_Z`). A scene is a straight street whose
axis passes near the sensor (yaw within a few degrees of +x), with:
- driving lanes both ways (right-hand traffic), optional parking (parallel strip or a
  perpendicular lot) and raised sidewalks on each side;
- beyond each sidewalk a zone of building façades (with windows), vegetation (trees, bushes,
  hedges) or a wall/fence; street lamps, sign poles, person-high posts, bollards and bins on
  the sidewalks;
  a few traffic cones. None of this is labelled;
- labelled road users: Car, Pedestrian, Cyclist and the other vehicle classes Van and Truck,
  with KITTI-like sizes. Cars are a body, a glass cabin and wheels; vans and trucks have their
  own shapes; pedestrians are legs, torso, arms and head; cyclists a rider on a bicycle. The
  label is the 3D box around the whole shape, bottom on the surface it stands on.

Placement is a BEV (+ height range) collision check against everything placed before, so
objects never interpenetrate but do occlude each other. `mode="front"` keeps labelled objects
in front of the sensor (the caller's `accept` checks the camera's field of view, KITTI);
`mode="around"` places them all around (nuScenes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from pfactory.sensors.synth_raycast import (
    KIND_BOX,
    KIND_CYLINDER,
    KIND_ELLIPSOID,
    PrimitiveBuilder,
    Primitives,
)

LIDAR_HEIGHT_M = 1.73  # KITTI's HDL-64E sits 1.73 m above the road
GROUND_Z = -LIDAR_HEIGHT_M

# Labelled classes and their size ranges (l, w, h in metres), close to KITTI's statistics
# (e.g. mean Car 3.88 x 1.63 x 1.53, Pedestrian 0.84 x 0.66 x 1.76, Cyclist 1.76 x 0.60 x 1.73).
SIZE_RANGES: dict[str, tuple[tuple[float, float], tuple[float, float], tuple[float, float]]] = {
    "Car": ((3.5, 4.8), (1.6, 1.9), (1.4, 1.7)),
    "Van": ((4.5, 5.5), (1.8, 2.1), (1.9, 2.3)),
    "Truck": ((6.0, 12.0), (2.3, 2.6), (2.8, 3.8)),
    "Pedestrian": ((0.5, 0.9), (0.5, 0.8), (1.55, 1.95)),
    "Cyclist": ((1.6, 1.9), (0.5, 0.7), (1.6, 1.9)),
}
# Share of Car / Pedestrian / Cyclist among the main labelled objects: KITTI is ~80% cars, but
# a detector needs enough vulnerable road users to learn them.
MAIN_CLASS_P = {"Car": 0.60, "Pedestrian": 0.25, "Cyclist": 0.15}
MAX_RANGE_M = {"Car": 72.0, "Van": 72.0, "Truck": 72.0, "Pedestrian": 48.0, "Cyclist": 55.0}


class Mat(IntEnum):
    """Surface materials: lidar behaviour and camera texture (see the MATERIAL_* tables)."""

    ASPHALT = 0
    LANE_PAINT = 1
    CONCRETE = 2
    GRASS = 3
    CAR_PAINT = 4
    GLASS = 5
    RUBBER = 6
    CLOTH = 7
    SKIN = 8
    METAL = 9
    SIGN = 10
    BARK = 11
    FOLIAGE = 12
    WALL = 13
    FACADE = 14
    DIRT = 15
    HAIR = 16


N_MAT = len(Mat)
# Extra lidar dropout per material (on top of the sensor's random dropout): glass passes or
# mirrors most of the beam away; foliage has gaps between leaves.
MATERIAL_DROPOUT = np.zeros(N_MAT)
MATERIAL_DROPOUT[[Mat.GLASS, Mat.FOLIAGE, Mat.HAIR]] = (0.55, 0.25, 0.1)
# Mean extra range (m, exponential) from beams entering a porous surface before returning.
MATERIAL_PENETRATION = np.zeros(N_MAT)
MATERIAL_PENETRATION[[Mat.FOLIAGE, Mat.GRASS]] = (0.25, 0.02)
# Camera: texture amplitude (relative albedo variation) and cell size (m) of the value noise.
MATERIAL_TEXTURE = np.zeros((N_MAT, 2))
MATERIAL_TEXTURE[:] = (0.03, 0.2)
MATERIAL_TEXTURE[[Mat.ASPHALT, Mat.CONCRETE, Mat.DIRT]] = ((0.1, 0.05), (0.06, 0.05), (0.2, 0.12))
MATERIAL_TEXTURE[[Mat.GRASS, Mat.FOLIAGE, Mat.BARK]] = ((0.35, 0.1), (0.55, 0.12), (0.3, 0.05))
MATERIAL_TEXTURE[[Mat.CAR_PAINT, Mat.GLASS, Mat.SIGN]] = ((0.02, 0.5), (0.05, 0.5), (0.02, 0.5))
# Camera: specular strength (Blinn-Phong) for shiny surfaces.
MATERIAL_SPECULAR = np.zeros(N_MAT)
MATERIAL_SPECULAR[[Mat.CAR_PAINT, Mat.GLASS, Mat.METAL]] = (0.35, 0.6, 0.2)

_GLASS_RGB = (0.1, 0.12, 0.15)
_RUBBER_RGB = (0.04, 0.04, 0.045)
_CAR_PAINTS = (  # (rgb, share): white, black, silver and grey dominate real traffic
    ((0.86, 0.86, 0.84), 0.24),
    ((0.05, 0.05, 0.06), 0.2),
    ((0.62, 0.63, 0.65), 0.18),
    ((0.35, 0.36, 0.38), 0.12),
    ((0.12, 0.2, 0.45), 0.08),
    ((0.55, 0.07, 0.06), 0.08),
    ((0.12, 0.28, 0.16), 0.03),
    ((0.78, 0.7, 0.45), 0.04),
    ((0.32, 0.2, 0.12), 0.03),
)
_CLOTHES = (
    (0.08, 0.08, 0.1), (0.12, 0.15, 0.3), (0.35, 0.35, 0.37), (0.55, 0.5, 0.38), (0.6, 0.12, 0.1),
    (0.85, 0.85, 0.85), (0.15, 0.3, 0.18), (0.5, 0.35, 0.2), (0.7, 0.55, 0.1), (0.25, 0.12, 0.3),
)  # fmt: skip
_SKINS = ((0.87, 0.7, 0.58), (0.72, 0.53, 0.4), (0.5, 0.35, 0.25), (0.32, 0.22, 0.16))
_HAIRS = ((0.08, 0.06, 0.05), (0.3, 0.2, 0.1), (0.6, 0.5, 0.3), (0.5, 0.5, 0.5))
_FACADES = (
    (0.75, 0.7, 0.62), (0.62, 0.42, 0.32), (0.8, 0.78, 0.75), (0.5, 0.5, 0.52), (0.7, 0.6, 0.45),
    (0.45, 0.32, 0.25), (0.85, 0.82, 0.7),
)  # fmt: skip
_SIGNS = ((0.8, 0.1, 0.1), (0.1, 0.25, 0.7), (0.9, 0.9, 0.9), (0.9, 0.75, 0.1))


def _luma(rgb) -> float:
    return float(0.3 * rgb[0] + 0.59 * rgb[1] + 0.11 * rgb[2])


def _jitter(rng: np.random.Generator, rgb, amount: float = 0.04) -> np.ndarray:
    """Vary a colour's brightness by ~`amount` and its hue a little (greens stay green)."""
    tint = rng.normal(0, min(amount / 3, 0.015), 3)
    return np.clip(np.asarray(rgb) * (1 + rng.normal(0, amount)) + tint, 0, 1)


# --- street layout -----------------------------------------------------------------------------


@dataclass
class Side:
    """One side of the street; distances `a` (m) grow away from the road axis on this side.

    `sign` is +1 for the left side (u > 0) and -1 for the right; `lane_edge` bounds the driving
    lanes, `asphalt_edge` the asphalt (driving lanes + parking); the sidewalk spans
    `[asphalt_edge, sidewalk_out]` raised by `curb_m`; `zone` is what lies beyond it.
    """

    sign: int
    lane_edge: float
    parking: str | None  # None | "parallel" | "perpendicular"
    asphalt_edge: float
    sidewalk_out: float
    curb_m: float
    zone: str  # "buildings" | "vegetation" | "fence"
    ground: Mat


@dataclass
class Layout:
    """The street: axis yaw, lanes `(u_centre, direction)` (direction +1 = along +s, ego's),
    lane lines `(u, dashed)`, the two sides (right first), ground colours and stall offset."""

    road_yaw: float
    lanes: list[tuple[float, int]]
    lines: list[tuple[float, bool]]
    sides: tuple[Side, Side]
    colors: dict[Mat, np.ndarray]
    stall_offset: float

    def to_road(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lidar-frame `(x, y)` -> road coordinates `(s along the road, u to its left)`."""
        c, s = np.cos(self.road_yaw), np.sin(self.road_yaw)
        return c * x + s * y, -s * x + c * y

    def to_world(self, s: float, u: float) -> tuple[float, float]:
        c, sn = np.cos(self.road_yaw), np.sin(self.road_yaw)
        return float(c * s - sn * u), float(sn * s + c * u)

    def side(self, sign: int) -> Side:
        return self.sides[0] if sign < 0 else self.sides[1]

    def ground(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Ground material `[N]` int16 at lidar-frame ground points `(x [N], y [N])`."""
        s, u = self.to_road(x, y)
        mat = np.full(len(x), Mat.ASPHALT, dtype=np.int16)
        for side in self.sides:
            a = u * side.sign
            mat[a > side.asphalt_edge] = side.ground
            if side.parking == "perpendicular":
                lot = (a > side.lane_edge) & (a < side.asphalt_edge)
                stall = np.mod(s - self.stall_offset, 2.6) < 0.12  # stall lines every 2.6 m
                mat[lot & stall] = Mat.LANE_PAINT
        for u_line, dashed in self.lines:
            on = np.abs(u - u_line) < 0.075  # 15 cm wide lines
            if dashed:
                on &= np.mod(s, 9.0) < 3.0  # urban dashes: 3 m line, 6 m gap
            mat[on] = Mat.LANE_PAINT
        return mat


GROUND_REFLECTANCE = {
    Mat.ASPHALT: 0.3,
    Mat.LANE_PAINT: 0.6,
    Mat.GRASS: 0.42,
    Mat.DIRT: 0.3,
    Mat.CONCRETE: 0.34,
}


def sample_layout(rng: np.random.Generator) -> Layout:
    lane_w = rng.uniform(3.0, 3.7)
    n_same = int(rng.choice([1, 2], p=[0.6, 0.4]))
    n_opp = int(rng.choice([0, 1, 2], p=[0.12, 0.55, 0.33]))
    ego_lane = int(rng.integers(n_same))
    u_ego = rng.normal(0, 0.2)  # the ego car is not exactly centred in its lane
    u_centre_line = (ego_lane + 0.5) * lane_w - u_ego
    lanes = [(u_centre_line - (k + 0.5) * lane_w, 1) for k in range(n_same)]
    lanes += [(u_centre_line + (k + 0.5) * lane_w, -1) for k in range(n_opp)]
    lines: list[tuple[float, bool]] = []
    for k in range(1, n_same):
        lines.append((u_centre_line - k * lane_w, True))
    for k in range(1, n_opp):
        lines.append((u_centre_line + k * lane_w, True))
    if n_opp:
        lines.append((u_centre_line, False))
    right_edge, left_edge = u_centre_line - n_same * lane_w, u_centre_line + n_opp * lane_w
    sides = []
    for sign, edge in ((-1, -right_edge), (1, left_edge)):
        parking = rng.choice(["none", "parallel", "perpendicular"], p=[0.35, 0.5, 0.15])
        parking = None if parking == "none" else str(parking)
        asphalt = edge + {None: 0.3, "parallel": 2.2, "perpendicular": 5.5}[parking]
        lines.append((sign * (edge - 0.1), False))  # solid edge line of the driving lanes
        zone = str(rng.choice(["buildings", "vegetation", "fence"], p=[0.5, 0.32, 0.18]))
        ground = {"buildings": Mat.CONCRETE, "vegetation": Mat.GRASS, "fence": Mat.DIRT}[zone]
        sides.append(
            Side(
                sign=sign,
                lane_edge=edge,
                parking=parking,
                asphalt_edge=asphalt,
                sidewalk_out=asphalt + rng.uniform(2.0, 4.5),
                curb_m=rng.uniform(0.1, 0.16),
                zone=zone,
                ground=ground,
            )
        )
    colors = {
        Mat.ASPHALT: _jitter(rng, (0.33, 0.33, 0.34), 0.1),
        Mat.LANE_PAINT: _jitter(rng, (0.86, 0.86, 0.83), 0.03),
        Mat.GRASS: _jitter(rng, (0.26, 0.4, 0.16), 0.1),
        Mat.DIRT: _jitter(rng, (0.45, 0.4, 0.32), 0.08),
        Mat.CONCRETE: _jitter(rng, (0.6, 0.59, 0.56), 0.06),
    }
    return Layout(
        road_yaw=float(rng.normal(0, np.radians(2.5))),
        lanes=lanes,
        lines=lines,
        sides=(sides[0], sides[1]),
        colors=colors,
        stall_offset=float(rng.uniform(0, 2.6)),
    )


# --- collision bookkeeping ---------------------------------------------------------------------


class Occupancy:
    """Footprints placed so far: oriented rectangles with a height range, `[K, 7]` rows of
    `(x, y, l, w, yaw, z0, z1)`. Used to keep objects from interpenetrating."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, ...]] = []
        self._arr: np.ndarray | None = None

    def add(self, x, y, l, w, yaw, z0, z1) -> None:
        self.rows.append((x, y, l, w, yaw, z0, z1))
        self._arr = None

    def collides(self, x, y, l, w, yaw, z0, z1, margin: float = 0.25) -> bool:
        if not self.rows:
            return False
        if self._arr is None:
            self._arr = np.array(self.rows)
        b = self._arr
        # Cheap circle test first; then the separating-axis test on the few candidates.
        r_a = 0.5 * np.hypot(l, w) + margin
        r_b = 0.5 * np.hypot(b[:, 2], b[:, 3])
        near = (np.hypot(b[:, 0] - x, b[:, 1] - y) < r_a + r_b) & (b[:, 5] < z1) & (b[:, 6] > z0)
        if not near.any():
            return False
        b = b[near]
        ca = _rect_corners(np.array([[x, y, l + 2 * margin, w + 2 * margin, yaw]]))[0]  # [4, 2]
        cb = _rect_corners(b[:, :5])  # [K, 4, 2]
        axes = [np.array([np.cos(yaw), np.sin(yaw)]), np.array([-np.sin(yaw), np.cos(yaw)])]
        separated = np.zeros(len(b), dtype=bool)
        for ax in axes:
            pa, pb = ca @ ax, cb @ ax  # [4], [K, 4]
            separated |= (pb.max(1) < pa.min()) | (pb.min(1) > pa.max())
        for ax in (
            np.stack([np.cos(b[:, 4]), np.sin(b[:, 4])], 1),
            np.stack([-np.sin(b[:, 4]), np.cos(b[:, 4])], 1),
        ):
            pa = ca @ ax.T  # [4, K]
            pb = np.einsum("kcd,kd->kc", cb, ax)  # [K, 4]
            separated |= (pb.max(1) < pa.min(0)) | (pb.min(1) > pa.max(0))
        return bool((~separated).any())


def _rect_corners(r: np.ndarray) -> np.ndarray:
    """BEV corners `[K, 4, 2]` of rectangles `[K, 5]` (x, y, l, w, yaw)."""
    c, s = np.cos(r[:, 4]), np.sin(r[:, 4])
    lx = np.array([0.5, -0.5, -0.5, 0.5])[None] * r[:, 2:3]
    ly = np.array([0.5, 0.5, -0.5, -0.5])[None] * r[:, 3:4]
    return np.stack(
        [r[:, 0:1] + c[:, None] * lx - s[:, None] * ly, r[:, 1:2] + s[:, None] * lx + c[:, None] * ly], -1
    )


# --- shapes: parts placed in an object's frame ---------------------------------------------------


class _Shape:
    """Adds parts given in an object frame (x along the heading, y left, z up from `base_z`)."""

    def __init__(self, b: PrimitiveBuilder, x: float, y: float, base_z: float, yaw: float, owner: int):
        self.b, self.x, self.y, self.base_z, self.yaw, self.owner = b, x, y, base_z, yaw, owner
        self.c, self.s = np.cos(yaw), np.sin(yaw)

    def part(self, kind, dx, dy, z0, z1, l, w, mat, rgb, refl, rgb_top=None, dyaw: float = 0.0) -> None:
        x = self.x + self.c * dx - self.s * dy
        y = self.y + self.s * dx + self.c * dy
        z = self.base_z + 0.5 * (z0 + z1)
        self.b.add(kind, (x, y, z, l, w, z1 - z0, self.yaw + dyaw), mat, rgb, refl, self.owner, rgb_top)


def _paint(rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """A car paint colour and its lidar reflectance (brighter paint returns more at 905 nm)."""
    k = rng.choice(len(_CAR_PAINTS), p=[p for _, p in _CAR_PAINTS])
    rgb = _jitter(rng, _CAR_PAINTS[k][0], 0.05)
    return rgb, float(np.clip(0.08 + 0.5 * _luma(rgb) + rng.normal(0, 0.03), 0.03, 0.7))


def _wheels(sh: _Shape, l: float, w: float, d: float, overhang: float, rear_len: float = 0.0) -> None:
    for sx in (1, -1):
        for sy in (1, -1):
            length = d + (rear_len if sx < 0 else 0.0)
            dx = sx * (0.5 * l - overhang - 0.5 * length)
            sh.part(KIND_BOX, dx, sy * (0.5 * w - 0.13), 0.0, d, length, 0.24, Mat.RUBBER, _RUBBER_RGB, 0.05)


def build_car(sh: _Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.15, 0.22)
    belt = h * rng.uniform(0.55, 0.62)
    _wheels(sh, l, w, min(0.64, belt - 0.05), 0.55)
    sh.part(KIND_BOX, 0, 0, clearance, belt, l, w, Mat.CAR_PAINT, paint, refl)
    cab_l = l * rng.uniform(0.45, 0.58)
    sh.part(
        KIND_BOX, -l * rng.uniform(0.02, 0.1), 0, belt, h, cab_l, w * rng.uniform(0.84, 0.92),
        (Mat.GLASS, Mat.CAR_PAINT), _GLASS_RGB, (0.05, refl), rgb_top=paint,
    )  # fmt: skip


def build_van(sh: _Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.2, 0.28)
    _wheels(sh, l, w, 0.66, 0.5)
    # A cargo van: one tall body; the cab's windscreen and front side windows are a glass band
    # flush with the front, the cargo part has no windows.
    sh.part(KIND_BOX, -0.02, 0, clearance, h, l - 0.04, w - 0.04, Mat.CAR_PAINT, paint, refl)
    sh.part(KIND_BOX, 0.5 * l - 0.6, 0, 0.55 * h, 0.88 * h, 1.2, w, Mat.GLASS, _GLASS_RGB, 0.05)


def build_truck(sh: _Shape, l, w, h, rng) -> None:
    cab_rgb, cab_refl = _paint(rng)
    cargo_rgb = _jitter(
        rng, [(0.85, 0.85, 0.83), (0.6, 0.6, 0.62), (0.2, 0.3, 0.55), (0.6, 0.15, 0.1)][rng.integers(4)]
    )
    cab_l = rng.uniform(2.0, 2.5)
    cab_h = h * rng.uniform(0.8, 0.9)
    _wheels(sh, l, w, 1.0, 0.7, rear_len=1.3)
    fx = 0.5 * l - 0.5 * cab_l  # cab centre
    sh.part(KIND_BOX, fx, 0, 0.45, 0.58 * cab_h, cab_l, w, Mat.CAR_PAINT, cab_rgb, cab_refl)
    sh.part(
        KIND_BOX, fx, 0, 0.58 * cab_h, cab_h, cab_l - 0.1, w - 0.06, (Mat.GLASS, Mat.CAR_PAINT),
        _GLASS_RGB, (0.05, cab_refl), rgb_top=cab_rgb,
    )  # fmt: skip
    cargo_l = l - cab_l - 0.3
    sh.part(
        KIND_BOX,
        -0.5 * l + 0.5 * cargo_l,
        0,
        1.05,
        h,
        cargo_l,
        w,
        Mat.METAL,
        cargo_rgb,
        0.1 + 0.5 * _luma(cargo_rgb),
    )
    sh.part(
        KIND_BOX,
        -0.5 * l + 0.5 * (l - cab_l),
        0,
        0.55,
        1.05,
        l - cab_l,
        0.7 * w,
        Mat.METAL,
        (0.1, 0.1, 0.1),
        0.15,
    )


def _person(sh: _Shape, l, w, h, rng, dx0: float = 0.0) -> None:
    """Legs, torso, arms and head inside an `l x w x h` box (x along the heading)."""
    shirt, trousers = (
        _jitter(rng, _CLOTHES[rng.integers(len(_CLOTHES))]),
        _jitter(rng, _CLOTHES[rng.integers(len(_CLOTHES))]),
    )
    skin, hair = _SKINS[rng.integers(len(_SKINS))], _HAIRS[rng.integers(len(_HAIRS))]
    refl_shirt, refl_trousers = 0.08 + 0.45 * _luma(shirt), 0.08 + 0.45 * _luma(trousers)
    r_head = 0.1
    hip = 0.47 * h
    torso_top = h - 2 * r_head - 0.03
    depth = min(0.5 * l - 0.02, rng.uniform(0.12, 0.16))
    half_w = min(0.5 * w - 0.02, rng.uniform(0.19, 0.24))
    r_leg = 0.075
    stride = rng.uniform(0.0, max(0.0, 0.5 * l - r_leg - 0.02))  # walking: legs apart
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER,
            dx0 + sgn * stride,
            sgn * 0.09,
            0.0,
            hip + 0.05,
            2 * r_leg,
            2 * r_leg,
            Mat.CLOTH,
            trousers,
            refl_trousers,
        )
    sh.part(
        KIND_ELLIPSOID, dx0, 0, hip - 0.05, torso_top, 2 * depth, 2 * half_w, Mat.CLOTH, shirt, refl_shirt
    )
    r_arm = 0.045
    arm_y = min(0.5 * w - r_arm - 0.01, half_w + 0.02)
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER,
            dx0,
            sgn * arm_y,
            hip - 0.02,
            torso_top - 0.06,
            2 * r_arm,
            2 * r_arm,
            Mat.CLOTH,
            shirt,
            refl_shirt,
        )
    sh.part(
        KIND_ELLIPSOID, dx0, 0, h - 2 * r_head - 0.02, h, 2 * r_head, 1.7 * r_head, (Mat.SKIN, Mat.HAIR),
        skin, (0.3, 0.12), rgb_top=hair,
    )  # fmt: skip


def build_pedestrian(sh: _Shape, l, w, h, rng) -> None:
    _person(sh, l, w, h, rng)


def build_cyclist(sh: _Shape, l, w, h, rng) -> None:
    frame_rgb = _jitter(rng, _CLOTHES[rng.integers(len(_CLOTHES))])
    r_wheel = 0.34
    for sgn in (1, -1):  # wheels as thin discs
        sh.part(
            KIND_ELLIPSOID,
            sgn * (0.5 * l - r_wheel),
            0,
            0.0,
            2 * r_wheel,
            2 * r_wheel,
            0.05,
            Mat.RUBBER,
            _RUBBER_RGB,
            0.06,
        )
    sh.part(KIND_BOX, 0.0, 0, 0.55, 0.85, 0.55 * l, 0.06, Mat.METAL, frame_rgb, 0.35)  # frame
    sh.part(
        KIND_BOX, 0.5 * l - r_wheel - 0.1, 0, 0.95, 1.02, 0.06, min(w, 0.56), Mat.METAL, (0.1, 0.1, 0.1), 0.3
    )  # bars
    # The rider: seated (no standing legs), legs from saddle to pedals, torso leaning forward.
    saddle = 0.85
    trousers = _jitter(rng, _CLOTHES[rng.integers(len(_CLOTHES))])
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER,
            -0.05,
            sgn * 0.12,
            0.3,
            saddle + 0.1,
            0.14,
            0.14,
            Mat.CLOTH,
            trousers,
            0.08 + 0.45 * _luma(trousers),
        )
    rider_h = h - saddle + 0.05
    _person_upper(sh, l, w, h, saddle, rider_h, rng)


def _person_upper(sh: _Shape, l, w, h, saddle, rider_h, rng) -> None:
    shirt = _jitter(rng, _CLOTHES[rng.integers(len(_CLOTHES))])
    refl = 0.08 + 0.45 * _luma(shirt)
    skin, hair = _SKINS[rng.integers(len(_SKINS))], _HAIRS[rng.integers(len(_HAIRS))]
    r_head = 0.1
    top = h - 2 * r_head - 0.02
    sh.part(KIND_ELLIPSOID, 0.05, 0, saddle, top, 0.36, min(w - 0.04, 0.42), Mat.CLOTH, shirt, refl)
    for sgn in (1, -1):  # arms reaching to the bars
        sh.part(
            KIND_BOX,
            0.3,
            sgn * min(0.5 * w - 0.05, 0.2),
            top - 0.25,
            top - 0.15,
            0.5,
            0.08,
            Mat.CLOTH,
            shirt,
            refl,
        )
    sh.part(
        KIND_ELLIPSOID, 0.12, 0, h - 2 * r_head, h, 2 * r_head, 1.7 * r_head, (Mat.SKIN, Mat.HAIR), skin,
        (0.3, 0.12), rgb_top=hair,
    )  # fmt: skip


BUILDERS = {
    "Car": build_car,
    "Van": build_van,
    "Truck": build_truck,
    "Pedestrian": build_pedestrian,
    "Cyclist": build_cyclist,
}


# --- the scene -----------------------------------------------------------------------------------


@dataclass
class Light:
    """Sun direction `sun [3]` (unit, towards the sun), ambient and sun strengths, sky colours
    (`zenith`, `horizon` RGB in [0, 1]), haze distance (m) and exposure."""

    sun: np.ndarray
    ambient: float
    sun_strength: float
    zenith: np.ndarray
    horizon: np.ndarray
    haze_m: float
    exposure: float


@dataclass
class Scene:
    """Everything two sensors need: layout, primitives, labels and light.

    `boxes [M, 7]` (x, y, z, l, w, h, yaw) lidar frame, z at the box centre; `names [M]` KITTI
    class names; `prims.owner` indexes these boxes for the parts of labelled objects.
    """

    layout: Layout
    prims: Primitives
    boxes: np.ndarray
    names: list[str]
    light: Light
    clutter_counts: dict[str, int] = field(default_factory=dict)


def sample_light(rng: np.random.Generator) -> Light:
    overcast = rng.random() < 0.3
    el, az = np.radians(rng.uniform(20, 65)), rng.uniform(-np.pi, np.pi)
    sun = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    if overcast:
        zenith, horizon = _jitter(rng, (0.62, 0.64, 0.68)), _jitter(rng, (0.8, 0.8, 0.82))
        return Light(
            sun,
            rng.uniform(0.6, 0.75),
            rng.uniform(0.15, 0.3),
            zenith,
            horizon,
            rng.uniform(250, 500),
            rng.uniform(0.95, 1.1),
        )
    zenith, horizon = _jitter(rng, (0.3, 0.5, 0.85)), _jitter(rng, (0.72, 0.8, 0.9))
    return Light(
        sun,
        rng.uniform(0.3, 0.45),
        rng.uniform(0.6, 0.8),
        zenith,
        horizon,
        rng.uniform(500, 1200),
        rng.uniform(0.9, 1.1),
    )


def sample_scene(
    rng: np.random.Generator,
    mode: str = "front",
    accept: Callable[[np.ndarray], bool] | None = None,
) -> Scene:
    """Sample one scene.

    `mode` "front": labelled objects ahead (s in [3, 72] m) and kept only if `accept(box [7])`
    (the camera-visibility test); "around": labelled objects all around within ~64 m.
    Clutter covers the street from 60 m behind to 110 m ahead ("around": 110 m both ways).
    """
    layout = sample_layout(rng)
    b = PrimitiveBuilder()
    occ = Occupancy()
    # The ego car (the lidar sits above its rear half, as on KITTI's car): nothing goes there.
    occ.add(-0.5, 0.0, 4.8, 2.0, 0.0, GROUND_Z, 0.0)
    s_lo, s_hi = (-60.0, 110.0) if mode == "front" else (-110.0, 110.0)
    counts = _add_clutter(rng, layout, b, occ, s_lo, s_hi)
    boxes, names = _add_road_users(rng, layout, b, occ, mode, accept or (lambda box: True))
    return Scene(layout, b.build(), boxes, names, sample_light(rng), counts)


def _add_clutter(
    rng, layout: Layout, b: PrimitiveBuilder, occ: Occupancy, s_lo: float, s_hi: float
) -> dict[str, int]:
    counts = dict.fromkeys(
        ("facade", "tree", "bush", "hedge", "wall", "pole", "post", "bin", "bollard", "cone"), 0
    )
    yaw_r = layout.road_yaw
    length = s_hi - s_lo

    def place(kind, s, u, base, l, w, h, yaw, mat, rgb, refl, rgb_top=None):
        x, y = layout.to_world(s, u)
        b.add(kind, (x, y, base + 0.5 * h, l, w, h, yaw), mat, rgb, refl, -1, rgb_top)
        return x, y

    for side in layout.sides:
        sg = side.sign
        curb_top = GROUND_Z + side.curb_m
        # The raised sidewalk: one long slab (its top is where pedestrians stand).
        place(KIND_BOX, 0.5 * (s_lo + s_hi), sg * 0.5 * (side.asphalt_edge + side.sidewalk_out), GROUND_Z,
              length, side.sidewalk_out - side.asphalt_edge, side.curb_m, yaw_r, Mat.CONCRETE,
              layout.colors[Mat.CONCRETE] * 1.05, GROUND_REFLECTANCE[Mat.CONCRETE])  # fmt: skip
        a_zone = side.sidewalk_out
        if side.zone == "buildings" or (side.zone == "fence" and rng.random() < 0.5):
            setback_extra = 0.0 if side.zone == "buildings" else rng.uniform(4, 12)
            s = s_lo + rng.uniform(-10, 0)
            while s < s_hi:
                blen = rng.uniform(8, 30)
                if rng.random() > 0.12:  # occasional gaps: alleys, driveways
                    depth, height = rng.uniform(8, 15), rng.uniform(5, 22)
                    a_in = a_zone + rng.uniform(0, 3) + setback_extra
                    rgb = _jitter(rng, _FACADES[rng.integers(len(_FACADES))])
                    x, y = place(KIND_BOX, s + 0.5 * blen, sg * (a_in + 0.5 * depth), GROUND_Z, blen, depth, height,
                                 yaw_r, Mat.FACADE, rgb, 0.18 + 0.3 * _luma(rgb), rgb_top=_jitter(rng, (0.3, 0.3, 0.32)))  # fmt: skip
                    occ.add(x, y, blen, depth, yaw_r, GROUND_Z, GROUND_Z + height)
                    counts["facade"] += 1
                s += blen + (rng.uniform(3, 8) if rng.random() < 0.25 else 0.0)
        if side.zone == "fence":
            s = s_lo
            while s < s_hi:
                wlen = rng.uniform(8, 40)
                h = rng.uniform(0.9, 2.4)
                rgb = _jitter(
                    rng, [(0.55, 0.52, 0.48), (0.45, 0.3, 0.25), (0.35, 0.36, 0.35)][rng.integers(3)]
                )
                a = a_zone + rng.uniform(0.2, 1.0)
                x, y = place(
                    KIND_BOX,
                    s + 0.5 * wlen,
                    sg * a,
                    GROUND_Z,
                    wlen,
                    0.25,
                    h,
                    yaw_r,
                    Mat.WALL,
                    rgb,
                    0.15 + 0.4 * _luma(rgb),
                )
                occ.add(x, y, wlen, 0.25, yaw_r, GROUND_Z, GROUND_Z + h)
                counts["wall"] += 1
                s += wlen + rng.uniform(1, 6)
        if side.zone == "vegetation":
            s = s_lo + rng.uniform(0, 6)
            while s < s_hi:
                _tree(rng, layout, b, occ, s, sg * (a_zone + rng.uniform(1.0, 7.0)), GROUND_Z)
                counts["tree"] += 1
                if rng.random() < 0.5:  # a second row further back
                    _tree(
                        rng,
                        layout,
                        b,
                        occ,
                        s + rng.uniform(-3, 3),
                        sg * (a_zone + rng.uniform(9, 18)),
                        GROUND_Z,
                    )
                    counts["tree"] += 1
                s += rng.uniform(5, 14)
            s = s_lo
            while s < s_hi:
                s += rng.uniform(4, 15)
                if rng.random() < 0.3:
                    hl, hh = rng.uniform(3, 15), rng.uniform(0.8, 1.8)
                    x, y = place(KIND_BOX, s, sg * (a_zone + 0.8), GROUND_Z, hl, 1.0, hh, yaw_r, Mat.FOLIAGE,
                                 _jitter(rng, (0.18, 0.32, 0.12)), 0.45)  # fmt: skip
                    occ.add(x, y, hl, 1.0, yaw_r, GROUND_Z, GROUND_Z + hh)
                    counts["hedge"] += 1
                    s += hl
                else:
                    _bush(rng, layout, b, occ, s, sg * (a_zone + rng.uniform(0.5, 4.0)), GROUND_Z)
                    counts["bush"] += 1
        # Sidewalk furniture: lamps near the curb, sign poles, bins, bollards, street trees.
        s = s_lo + rng.uniform(0, 20)
        lamp_gap = rng.uniform(22, 35)
        while s < s_hi:
            _lamp(rng, layout, b, occ, s, sg, side.asphalt_edge + 0.45, curb_top)
            counts["pole"] += 1
            s += lamp_gap
        for _ in range(rng.poisson(length / 40)):
            _sign_pole(rng, layout, b, occ, rng.uniform(s_lo, s_hi), sg, side.asphalt_edge + 0.4, curb_top)
            counts["pole"] += 1
        for _ in range(rng.poisson(length / 50)):
            s, a = rng.uniform(s_lo, s_hi), rng.uniform(side.asphalt_edge + 0.5, side.sidewalk_out - 0.4)
            x, y = layout.to_world(s, sg * a)
            if not occ.collides(x, y, 0.6, 0.6, yaw_r, curb_top, curb_top + 1.1):
                rgb = _jitter(rng, [(0.15, 0.3, 0.18), (0.2, 0.2, 0.22), (0.55, 0.4, 0.15)][rng.integers(3)])
                place(
                    KIND_BOX,
                    s,
                    sg * a,
                    curb_top,
                    0.6,
                    0.6,
                    rng.uniform(0.9, 1.2),
                    yaw_r + rng.normal(0, 0.2),
                    Mat.METAL,
                    rgb,
                    0.2,
                )
                occ.add(x, y, 0.6, 0.6, yaw_r, curb_top, curb_top + 1.2)
                counts["bin"] += 1
        for _ in range(rng.poisson(length / 35)):
            # Posts of a person's height (parking meters, sign posts, short masts): thin vertical
            # cylinders a detector must not take for pedestrians.
            s, a = rng.uniform(s_lo, s_hi), side.asphalt_edge + rng.uniform(0.3, 0.8)
            x, y = layout.to_world(s, sg * a)
            h, r = rng.uniform(1.1, 1.95), rng.uniform(0.04, 0.13)
            if not occ.collides(x, y, 2 * r, 2 * r, 0.0, curb_top, curb_top + h, margin=0.2):
                grey = _jitter(rng, (0.4, 0.4, 0.42), 0.2)
                place(KIND_CYLINDER, s, sg * a, curb_top, 2 * r, 2 * r, h, 0.0, Mat.METAL, grey, 0.3)
                if rng.random() < 0.4:  # a meter head on top
                    place(KIND_BOX, s, sg * a, curb_top + h, 0.25, 0.2, 0.35, yaw_r, Mat.METAL, grey, 0.3)
                occ.add(x, y, 2 * r, 2 * r, 0.0, curb_top, curb_top + h + 0.35)
                counts["post"] += 1
        if rng.random() < 0.4:  # a row of bollards: pedestrian-height hard negatives
            s0 = rng.uniform(s_lo, s_hi)
            for k in range(int(rng.integers(3, 7))):
                s, a = s0 + 1.6 * k, side.asphalt_edge + 0.3
                x, y = layout.to_world(s, sg * a)
                h = rng.uniform(0.8, 1.1)
                if not occ.collides(x, y, 0.2, 0.2, 0, curb_top, curb_top + h, margin=0.05):
                    place(
                        KIND_CYLINDER,
                        s,
                        sg * a,
                        curb_top,
                        0.2,
                        0.2,
                        h,
                        0.0,
                        Mat.METAL,
                        (0.25, 0.25, 0.27),
                        0.3,
                    )
                    occ.add(x, y, 0.2, 0.2, 0.0, curb_top, curb_top + h)
                    counts["bollard"] += 1
        if side.zone == "buildings" and rng.random() < 0.5:  # street trees in sidewalk pits
            s = s_lo + rng.uniform(0, 10)
            gap = rng.uniform(8, 20)
            while s < s_hi:
                _tree(rng, layout, b, occ, s, sg * (side.sidewalk_out - 0.9), curb_top, small=True)
                counts["tree"] += 1
                s += gap
    if rng.random() < 0.2:  # a few traffic cones along a lane edge
        u_edge = layout.sides[0].sign * layout.sides[0].lane_edge + 0.4
        s0 = rng.uniform(8, 50)
        for k in range(int(rng.integers(3, 7))):
            x, y = layout.to_world(s0 + 3.0 * k, u_edge)
            if not occ.collides(x, y, 0.35, 0.35, 0, GROUND_Z, GROUND_Z + 0.75, margin=0.05):
                b.add(
                    KIND_CYLINDER,
                    (x, y, GROUND_Z + 0.37, 0.3, 0.3, 0.75, 0.0),
                    Mat.SIGN,
                    (0.95, 0.4, 0.05),
                    0.8,
                )
                occ.add(x, y, 0.35, 0.35, 0.0, GROUND_Z, GROUND_Z + 0.75)
                counts["cone"] += 1
    return counts


def _tree(rng, layout, b, occ, s, u, base, small: bool = False) -> None:
    x, y = layout.to_world(s, u)
    r_trunk = rng.uniform(0.08, 0.15) if small else rng.uniform(0.12, 0.3)
    trunk_h = rng.uniform(2.4, 3.2) if small else rng.uniform(2.4, 4.5)
    if occ.collides(x, y, 2 * r_trunk, 2 * r_trunk, 0.0, base, base + trunk_h, margin=0.3):
        return
    b.add(KIND_CYLINDER, (x, y, base + 0.5 * trunk_h, 2 * r_trunk, 2 * r_trunk, trunk_h, 0.0), Mat.BARK,
          _jitter(rng, (0.3, 0.22, 0.15)), 0.25)  # fmt: skip
    occ.add(x, y, 2 * r_trunk, 2 * r_trunk, 0.0, base, base + trunk_h)
    rxy = rng.uniform(1.0, 1.8) if small else rng.uniform(1.5, 3.2)
    rz = min(rxy * rng.uniform(0.8, 1.4), 3.5)
    zc = base + trunk_h + 0.9 * rz  # the crown's bottom stays above ~2 m
    green = _jitter(rng, (0.16, 0.3, 0.1), 0.15)
    # Crowns start above 2.3 m: pedestrians and cars can stand under them, but the occupancy
    # records the crown so trucks do not drive through it.
    b.add(KIND_ELLIPSOID, (x, y, zc, 2 * rxy, 2 * rxy * rng.uniform(0.8, 1.2), 2 * rz, rng.uniform(0, np.pi)),
          Mat.FOLIAGE, green, 0.45, -1, np.clip(green * 1.25, 0, 1))  # fmt: skip
    occ.add(x, y, 2 * rxy, 2 * rxy, 0.0, zc - rz, zc + rz)


def _bush(rng, layout, b, occ, s, u, base) -> None:
    x, y = layout.to_world(s, u)
    r, h = rng.uniform(0.4, 1.3), rng.uniform(0.5, 1.5)
    if occ.collides(x, y, 2 * r, 2 * r, 0.0, base, base + h, margin=0.1):
        return
    green = _jitter(rng, (0.2, 0.33, 0.12), 0.15)
    b.add(KIND_ELLIPSOID, (x, y, base + 0.4 * h, 2 * r, 2 * r * rng.uniform(0.7, 1.3), h * 1.2, rng.uniform(0, np.pi)),
          Mat.FOLIAGE, green, 0.45, -1, np.clip(green * 1.2, 0, 1))  # fmt: skip
    occ.add(x, y, 2 * r, 2 * r, 0.0, base, base + h)


def _lamp(rng, layout, b, occ, s, sg, a, base) -> None:
    x, y = layout.to_world(s, sg * a)
    h = rng.uniform(6, 9)
    if occ.collides(x, y, 0.3, 0.3, 0.0, base, base + h, margin=0.3):
        return
    grey = _jitter(rng, (0.4, 0.42, 0.44))
    b.add(KIND_CYLINDER, (x, y, base + 0.5 * h, 0.22, 0.22, h, 0.0), Mat.METAL, grey, 0.35)
    arm = rng.uniform(1.2, 2.5)  # the arm reaches over the road
    xa, ya = layout.to_world(s, sg * (a - 0.5 * arm))
    b.add(KIND_BOX, (xa, ya, base + h - 0.1, 0.12, arm, 0.12, layout.road_yaw), Mat.METAL, grey, 0.35)
    xl, yl = layout.to_world(s, sg * (a - arm + 0.2))
    b.add(
        KIND_BOX,
        (xl, yl, base + h - 0.25, 0.3, 0.6, 0.18, layout.road_yaw),
        Mat.METAL,
        (0.85, 0.85, 0.8),
        0.5,
    )
    occ.add(x, y, 0.3, 0.3, 0.0, base, base + h)


def _sign_pole(rng, layout, b, occ, s, sg, a, base) -> None:
    x, y = layout.to_world(s, sg * a)
    h = rng.uniform(2.2, 3.2)
    if occ.collides(x, y, 0.7, 0.7, 0.0, base, base + h, margin=0.2):
        return
    b.add(KIND_CYLINDER, (x, y, base + 0.5 * h, 0.08, 0.08, h, 0.0), Mat.METAL, (0.55, 0.56, 0.58), 0.35)
    size = rng.uniform(0.5, 0.8)
    # A retroreflective plate facing oncoming traffic: the brightest lidar returns of a scene.
    xs, ys = layout.to_world(s - 0.06, sg * a)
    b.add(KIND_BOX, (xs, ys, base + h - 0.5 * size, 0.03, size, size, layout.road_yaw), Mat.SIGN,
          _SIGNS[rng.integers(len(_SIGNS))], rng.uniform(0.85, 1.0))  # fmt: skip
    occ.add(x, y, 0.7, 0.7, 0.0, base, base + h)


def _sample_size(rng, name: str) -> tuple[float, float, float]:
    (l0, l1), (w0, w1), (h0, h1) = SIZE_RANGES[name]
    # Correlated sizes: a long car is also likely wide and tall (KITTI's sizes correlate).
    q = rng.uniform(0, 1)
    mix = lambda lo, hi: lo + (hi - lo) * np.clip(0.6 * q + 0.4 * rng.uniform(0, 1), 0, 1)  # noqa: E731
    return float(mix(l0, l1)), float(mix(w0, w1)), float(mix(h0, h1))


def _add_road_users(
    rng, layout: Layout, b: PrimitiveBuilder, occ: Occupancy, mode: str, accept
) -> tuple[np.ndarray, list[str]]:
    n_main = int(rng.integers(5, 23))
    n_big = int(rng.choice(4, p=[0.35, 0.35, 0.2, 0.1]))
    names = list(rng.choice(list(MAIN_CLASS_P), size=n_main, p=list(MAIN_CLASS_P.values())))
    names += ["Van" if rng.random() < 0.6 else "Truck" for _ in range(n_big)]
    order = rng.permutation(len(names))
    wanted = [str(names[i]) for i in order]
    boxes: list[np.ndarray] = []
    placed: list[str] = []
    group_anchor: tuple[float, float] | None = None
    extra = 0
    i = 0
    while i < len(wanted) or (len(placed) < 5 and extra < 20):
        if i < len(wanted):
            name = wanted[i]
        else:
            name, extra = "Car", extra + 1  # top up to the minimum of 5 labelled objects
        i += 1
        for _attempt in range(40):
            near = group_anchor if (name == "Pedestrian" and group_anchor and rng.random() < 0.5) else None
            cand = _propose(rng, layout, name, mode, near)
            if cand is None:
                continue
            box, base = cand
            x, y, _z, l, w, h, yaw = box
            if occ.collides(x, y, l, w, yaw, base, base + h, margin=0.15 if name == "Pedestrian" else 0.3):
                continue
            if not accept(box):
                continue
            owner = len(boxes)
            BUILDERS[name](_Shape(b, x, y, base, yaw, owner), l, w, h, rng)
            occ.add(x, y, l, w, yaw, base, base + h)
            boxes.append(box)
            placed.append(name)
            if name == "Pedestrian":
                s, u = layout.to_road(np.array([x]), np.array([y]))
                group_anchor = (float(s[0]), float(u[0]))
            break
    return np.array(boxes, dtype=np.float64).reshape(-1, 7), placed


def _propose(rng, layout: Layout, name: str, mode: str, near) -> tuple[np.ndarray, float] | None:
    """A candidate box `[7]` and the height of the surface it stands on, or None."""
    l, w, h = _sample_size(rng, name)
    smax = MAX_RANGE_M[name]
    # Distance along the road skewed towards the sensor (u^2): a camera's view cone widens with
    # distance, so uniform s would put half the labels past 40 m; KITTI has about a quarter.
    if mode == "front":
        s = 3.0 + (smax - 3.0) * rng.uniform(0, 1) ** 2
    else:
        s = (rng.uniform(0, 1) ** 1.5) * (smax - 8.0) * (1 if rng.random() < 0.5 else -1)
    right, left = layout.sides
    base = GROUND_Z
    heading = layout.road_yaw
    if name in ("Car", "Van", "Truck"):
        parking_sides = [sd for sd in layout.sides if sd.parking]
        p_park = {"Car": 0.45, "Van": 0.4, "Truck": 0.2}[name]
        if parking_sides and rng.random() < p_park:
            sd = parking_sides[rng.integers(len(parking_sides))]
            if sd.parking == "parallel":
                u = sd.sign * (sd.lane_edge + 1.1 + rng.normal(0, 0.1))
                # Parked with the traffic of that side, a few the other way round.
                forward = (sd.sign < 0) != (rng.random() < 0.1)
                yaw = heading + (0.0 if forward else np.pi) + rng.normal(0, 0.04)
            else:
                if name == "Truck":
                    return None
                s = layout.stall_offset + 2.6 * np.round((s - layout.stall_offset) / 2.6) + 1.3
                u = sd.sign * (sd.lane_edge + 0.25 + 0.5 * l + rng.uniform(0, 0.3))
                yaw = heading + sd.sign * np.pi / 2 * (1 if rng.random() < 0.8 else -1) + rng.normal(0, 0.06)
        else:
            u_lane, direction = layout.lanes[rng.integers(len(layout.lanes))]
            u = u_lane + rng.normal(0, 0.2)
            yaw = heading + (0.0 if direction > 0 else np.pi) + rng.normal(0, 0.03)
    elif name == "Pedestrian":
        if near is not None:
            s, u = near[0] + rng.uniform(-1.5, 1.5), near[1] + rng.uniform(-1.2, 1.2)
            sd = right if u < 0 else left
            a = abs(u)
            on_sidewalk = sd.asphalt_edge + 0.4 < a < sd.sidewalk_out - 0.4
        else:
            r = rng.random()
            sd = right if rng.random() < 0.5 else left
            on_sidewalk = False
            if r < 0.7:
                u = sd.sign * rng.uniform(sd.asphalt_edge + 0.45, sd.sidewalk_out - 0.45)
                on_sidewalk = True
            elif r < 0.85 or not sd.parking:
                u = rng.uniform(-right.lane_edge + 0.3, left.lane_edge - 0.3)  # crossing the road
                sd = right if u < 0 else left
            else:
                u = sd.sign * rng.uniform(sd.lane_edge + 0.4, sd.asphalt_edge - 0.4)  # between parked cars
        if on_sidewalk:
            base = GROUND_Z + sd.curb_m
        elif abs(u) > (sd.asphalt_edge - 0.3):
            return None  # straddling the curb
        yaw = rng.uniform(-np.pi, np.pi)
    else:  # Cyclist
        r = rng.random()
        if r < 0.75 or len(layout.lanes) == 0:
            u_lane, direction = layout.lanes[rng.integers(len(layout.lanes))]
            sd = right if direction > 0 else left
            # Cyclists ride at the right-hand edge of their direction's outermost lane.
            u = sd.sign * (sd.lane_edge - rng.uniform(0.6, 1.0))
            yaw = heading + (0.0 if direction > 0 else np.pi) + rng.normal(0, 0.08)
        elif r < 0.9:
            sd = right if rng.random() < 0.5 else left
            width = sd.sidewalk_out - sd.asphalt_edge
            if width < w + 1.0:
                return None
            u = sd.sign * rng.uniform(sd.asphalt_edge + 0.5 + 0.5 * w, sd.sidewalk_out - 0.5 - 0.5 * w)
            base = GROUND_Z + sd.curb_m
            yaw = heading + (0.0 if rng.random() < 0.5 else np.pi) + rng.normal(0, 0.1)
        else:
            u = rng.uniform(-right.lane_edge + 1.0, left.lane_edge - 1.0)  # crossing the road
            yaw = heading + (np.pi / 2 if rng.random() < 0.5 else -np.pi / 2) + rng.normal(0, 0.15)
    x, y = layout.to_world(s, u)
    if np.hypot(x, y) > smax or np.hypot(x, y) < 3.0:
        return None
    yaw = float((yaw + np.pi) % (2 * np.pi) - np.pi)
    return np.array([x, y, base + 0.5 * h, l, w, h, yaw]), base
