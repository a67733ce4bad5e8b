"""The street layout of a synthetic scene: lanes, parking, sidewalks and what lies beyond them.

Lidar frame (x forward, y left, z up, metres; the lidar `LIDAR_HEIGHT_M` above a flat ground at
`z = GROUND_Z`); road coordinates `(s along the road, u to its left)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pfactory.synth.materials import Mat, jitter

LIDAR_HEIGHT_M = 1.73  # KITTI's HDL-64E sits 1.73 m above the road
GROUND_Z = -LIDAR_HEIGHT_M


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
        Mat.ASPHALT: jitter(rng, (0.33, 0.33, 0.34), 0.1),
        Mat.LANE_PAINT: jitter(rng, (0.86, 0.86, 0.83), 0.03),
        Mat.GRASS: jitter(rng, (0.26, 0.4, 0.16), 0.1),
        Mat.DIRT: jitter(rng, (0.45, 0.4, 0.32), 0.08),
        Mat.CONCRETE: jitter(rng, (0.6, 0.59, 0.56), 0.06),
    }
    return Layout(
        road_yaw=float(rng.normal(0, np.radians(2.5))),
        lanes=lanes,
        lines=lines,
        sides=(sides[0], sides[1]),
        colors=colors,
        stall_offset=float(rng.uniform(0, 2.6)),
    )
