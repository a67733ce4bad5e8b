"""Labelled road users: class mix, KITTI-like sizes and placement along the street (BEV + height
collision check against everything placed before)."""

from __future__ import annotations

import numpy as np

from pfactory.synth.layout import GROUND_Z, Layout
from pfactory.synth.occupancy import Occupancy
from pfactory.synth.raycast import PrimitiveBuilder
from pfactory.synth.shapes import BUILDERS, Shape

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


def _sample_size(rng, name: str) -> tuple[float, float, float]:
    (l0, l1), (w0, w1), (h0, h1) = SIZE_RANGES[name]
    # Correlated sizes: a long car is also likely wide and tall (KITTI's sizes correlate).
    q = rng.uniform(0, 1)
    mix = lambda lo, hi: lo + (hi - lo) * np.clip(0.6 * q + 0.4 * rng.uniform(0, 1), 0, 1)  # noqa: E731
    return float(mix(l0, l1)), float(mix(w0, w1)), float(mix(h0, h1))


def add_road_users(
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
            BUILDERS[name](Shape(b, x, y, base, yaw, owner), l, w, h, rng)
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
