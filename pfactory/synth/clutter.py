"""Unlabelled clutter along the street: sidewalks, façades, vegetation, walls, lamps, sign poles,
posts, bins, bollards and cones (the hard negatives a detector must ignore)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pfactory.synth.layout import GROUND_REFLECTANCE, GROUND_Z, Layout, Side
from pfactory.synth.materials import FACADES, SIGNS, Mat, jitter, luma
from pfactory.synth.occupancy import Occupancy
from pfactory.synth.raycast import KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, PrimitiveBuilder


@dataclass
class _Street:
    """What every clutter step draws into: the layout, the primitive builder, the occupancy, the
    stretch `[s_lo, s_hi]` of street it covers and the running per-kind `counts`."""

    layout: Layout
    b: PrimitiveBuilder
    occ: Occupancy
    s_lo: float
    s_hi: float
    counts: dict[str, int]

    def place(self, kind, s, u, base, l, w, h, yaw, mat, rgb, refl, rgb_top=None) -> tuple[float, float]:
        """Add one unlabelled primitive standing on `base` at street coordinates `(s, u)`;
        returns its world `(x, y)`."""
        x, y = self.layout.to_world(s, u)
        self.b.add(kind, (x, y, base + 0.5 * h, l, w, h, yaw), mat, rgb, refl, -1, rgb_top)
        return x, y


def add_clutter(
    rng, layout: Layout, b: PrimitiveBuilder, occ: Occupancy, s_lo: float, s_hi: float
) -> dict[str, int]:
    """Add the street's unlabelled clutter between `s_lo` and `s_hi` (m along the road) to `b` and
    `occ`, drawing from `rng`; returns how many of each kind were placed (facade, tree, bush, hedge,
    wall, pole, post, bin, bollard, cone)."""
    counts = dict.fromkeys(
        ("facade", "tree", "bush", "hedge", "wall", "pole", "post", "bin", "bollard", "cone"), 0
    )
    st = _Street(layout, b, occ, s_lo, s_hi, counts)
    for side in layout.sides:
        _side_clutter(rng, st, side)
    if rng.random() < 0.2:  # a few traffic cones along a lane edge
        _cones(rng, st)
    return counts


def _side_clutter(rng, st: _Street, side: Side) -> None:
    """One side of the street: its sidewalk, what its zone holds beyond it, and its furniture."""
    layout = st.layout
    curb_top = GROUND_Z + side.curb_m
    # The raised sidewalk: one long slab (its top is where pedestrians stand).
    st.place(KIND_BOX, 0.5 * (st.s_lo + st.s_hi), side.sign * 0.5 * (side.asphalt_edge + side.sidewalk_out),
             GROUND_Z, st.s_hi - st.s_lo, side.sidewalk_out - side.asphalt_edge, side.curb_m, layout.road_yaw,
             Mat.CONCRETE, layout.colors[Mat.CONCRETE] * 1.05, GROUND_REFLECTANCE[Mat.CONCRETE])  # fmt: skip
    if side.zone == "buildings" or (side.zone == "fence" and rng.random() < 0.5):
        _facades(rng, st, side)
    if side.zone == "fence":
        _walls(rng, st, side)
    if side.zone == "vegetation":
        _trees_and_bushes(rng, st, side)
    # Sidewalk furniture: lamps near the curb, sign poles, bins, bollards, street trees.
    _lamps_and_signs(rng, st, side, curb_top)
    _bins(rng, st, side, curb_top)
    _posts(rng, st, side, curb_top)
    if rng.random() < 0.4:  # a row of bollards: pedestrian-height hard negatives
        _bollards(rng, st, side, curb_top)
    if side.zone == "buildings" and rng.random() < 0.5:  # street trees in sidewalk pits
        _street_trees(rng, st, side, curb_top)


def _facades(rng, st: _Street, side: Side) -> None:
    """A row of building façades behind the sidewalk (set further back behind a fence)."""
    sg, yaw_r, a_zone = side.sign, st.layout.road_yaw, side.sidewalk_out
    setback_extra = 0.0 if side.zone == "buildings" else rng.uniform(4, 12)
    s = st.s_lo + rng.uniform(-10, 0)
    while s < st.s_hi:
        blen = rng.uniform(8, 30)
        if rng.random() > 0.12:  # occasional gaps: alleys, driveways
            depth, height = rng.uniform(8, 15), rng.uniform(5, 22)
            a_in = a_zone + rng.uniform(0, 3) + setback_extra
            rgb = jitter(rng, FACADES[rng.integers(len(FACADES))])
            x, y = st.place(KIND_BOX, s + 0.5 * blen, sg * (a_in + 0.5 * depth), GROUND_Z, blen, depth, height,
                            yaw_r, Mat.FACADE, rgb, 0.18 + 0.3 * luma(rgb), rgb_top=jitter(rng, (0.3, 0.3, 0.32)))  # fmt: skip
            st.occ.add(x, y, blen, depth, yaw_r, GROUND_Z, GROUND_Z + height)
            st.counts["facade"] += 1
        s += blen + (rng.uniform(3, 8) if rng.random() < 0.25 else 0.0)


def _walls(rng, st: _Street, side: Side) -> None:
    """Walls and fences along the sidewalk's outer edge, with gaps between them."""
    sg, yaw_r, a_zone = side.sign, st.layout.road_yaw, side.sidewalk_out
    s = st.s_lo
    while s < st.s_hi:
        wlen = rng.uniform(8, 40)
        h = rng.uniform(0.9, 2.4)
        rgb = jitter(rng, [(0.55, 0.52, 0.48), (0.45, 0.3, 0.25), (0.35, 0.36, 0.35)][rng.integers(3)])
        a = a_zone + rng.uniform(0.2, 1.0)
        x, y = st.place(KIND_BOX, s + 0.5 * wlen, sg * a, GROUND_Z, wlen, 0.25, h, yaw_r, Mat.WALL, rgb,
                        0.15 + 0.4 * luma(rgb))  # fmt: skip
        st.occ.add(x, y, wlen, 0.25, yaw_r, GROUND_Z, GROUND_Z + h)
        st.counts["wall"] += 1
        s += wlen + rng.uniform(1, 6)


def _trees_and_bushes(rng, st: _Street, side: Side) -> None:
    """The vegetation zone: one or two rows of trees, then hedges and bushes by the sidewalk."""
    layout, b, occ = st.layout, st.b, st.occ
    sg, yaw_r, a_zone = side.sign, layout.road_yaw, side.sidewalk_out
    s = st.s_lo + rng.uniform(0, 6)
    while s < st.s_hi:
        _tree(rng, layout, b, occ, s, sg * (a_zone + rng.uniform(1.0, 7.0)), GROUND_Z)
        st.counts["tree"] += 1
        if rng.random() < 0.5:  # a second row further back
            _tree(rng, layout, b, occ, s + rng.uniform(-3, 3), sg * (a_zone + rng.uniform(9, 18)), GROUND_Z)
            st.counts["tree"] += 1
        s += rng.uniform(5, 14)
    s = st.s_lo
    while s < st.s_hi:
        s += rng.uniform(4, 15)
        if rng.random() < 0.3:
            hl, hh = rng.uniform(3, 15), rng.uniform(0.8, 1.8)
            x, y = st.place(KIND_BOX, s, sg * (a_zone + 0.8), GROUND_Z, hl, 1.0, hh, yaw_r, Mat.FOLIAGE,
                            jitter(rng, (0.18, 0.32, 0.12)), 0.45)  # fmt: skip
            occ.add(x, y, hl, 1.0, yaw_r, GROUND_Z, GROUND_Z + hh)
            st.counts["hedge"] += 1
            s += hl
        else:
            _bush(rng, layout, b, occ, s, sg * (a_zone + rng.uniform(0.5, 4.0)), GROUND_Z)
            st.counts["bush"] += 1


def _lamps_and_signs(rng, st: _Street, side: Side, curb_top: float) -> None:
    """Evenly spaced street lamps near the curb, then a Poisson number of sign poles."""
    layout, b, occ, sg = st.layout, st.b, st.occ, side.sign
    s = st.s_lo + rng.uniform(0, 20)
    lamp_gap = rng.uniform(22, 35)
    while s < st.s_hi:
        _lamp(rng, layout, b, occ, s, sg, side.asphalt_edge + 0.45, curb_top)
        st.counts["pole"] += 1
        s += lamp_gap
    for _ in range(rng.poisson((st.s_hi - st.s_lo) / 40)):
        _sign_pole(rng, layout, b, occ, rng.uniform(st.s_lo, st.s_hi), sg, side.asphalt_edge + 0.4, curb_top)
        st.counts["pole"] += 1


def _bins(rng, st: _Street, side: Side, curb_top: float) -> None:
    """A Poisson number of litter bins on the sidewalk, each where nothing else stands."""
    sg, yaw_r = side.sign, st.layout.road_yaw
    for _ in range(rng.poisson((st.s_hi - st.s_lo) / 50)):
        s, a = rng.uniform(st.s_lo, st.s_hi), rng.uniform(side.asphalt_edge + 0.5, side.sidewalk_out - 0.4)
        x, y = st.layout.to_world(s, sg * a)
        if not st.occ.collides(x, y, 0.6, 0.6, yaw_r, curb_top, curb_top + 1.1):
            rgb = jitter(rng, [(0.15, 0.3, 0.18), (0.2, 0.2, 0.22), (0.55, 0.4, 0.15)][rng.integers(3)])
            st.place(KIND_BOX, s, sg * a, curb_top, 0.6, 0.6, rng.uniform(0.9, 1.2), yaw_r + rng.normal(0, 0.2),
                     Mat.METAL, rgb, 0.2)  # fmt: skip
            st.occ.add(x, y, 0.6, 0.6, yaw_r, curb_top, curb_top + 1.2)
            st.counts["bin"] += 1


def _posts(rng, st: _Street, side: Side, curb_top: float) -> None:
    """Posts of a person's height (parking meters, sign posts, short masts): thin vertical
    cylinders a detector must not take for pedestrians."""
    sg, yaw_r = side.sign, st.layout.road_yaw
    for _ in range(rng.poisson((st.s_hi - st.s_lo) / 35)):
        s, a = rng.uniform(st.s_lo, st.s_hi), side.asphalt_edge + rng.uniform(0.3, 0.8)
        x, y = st.layout.to_world(s, sg * a)
        h, r = rng.uniform(1.1, 1.95), rng.uniform(0.04, 0.13)
        if not st.occ.collides(x, y, 2 * r, 2 * r, 0.0, curb_top, curb_top + h, margin=0.2):
            grey = jitter(rng, (0.4, 0.4, 0.42), 0.2)
            st.place(KIND_CYLINDER, s, sg * a, curb_top, 2 * r, 2 * r, h, 0.0, Mat.METAL, grey, 0.3)
            if rng.random() < 0.4:  # a meter head on top
                st.place(KIND_BOX, s, sg * a, curb_top + h, 0.25, 0.2, 0.35, yaw_r, Mat.METAL, grey, 0.3)
            st.occ.add(x, y, 2 * r, 2 * r, 0.0, curb_top, curb_top + h + 0.35)
            st.counts["post"] += 1


def _bollards(rng, st: _Street, side: Side, curb_top: float) -> None:
    """A row of 3 to 6 bollards 1.6 m apart along the curb."""
    sg = side.sign
    s0 = rng.uniform(st.s_lo, st.s_hi)
    for k in range(int(rng.integers(3, 7))):
        s, a = s0 + 1.6 * k, side.asphalt_edge + 0.3
        x, y = st.layout.to_world(s, sg * a)
        h = rng.uniform(0.8, 1.1)
        if not st.occ.collides(x, y, 0.2, 0.2, 0, curb_top, curb_top + h, margin=0.05):
            st.place(KIND_CYLINDER, s, sg * a, curb_top, 0.2, 0.2, h, 0.0, Mat.METAL, (0.25, 0.25, 0.27), 0.3)
            st.occ.add(x, y, 0.2, 0.2, 0.0, curb_top, curb_top + h)
            st.counts["bollard"] += 1


def _street_trees(rng, st: _Street, side: Side, curb_top: float) -> None:
    """Small trees in sidewalk pits at a regular spacing, near the sidewalk's outer edge."""
    s = st.s_lo + rng.uniform(0, 10)
    gap = rng.uniform(8, 20)
    while s < st.s_hi:
        _tree(rng, st.layout, st.b, st.occ, s, side.sign * (side.sidewalk_out - 0.9), curb_top, small=True)
        st.counts["tree"] += 1
        s += gap


def _cones(rng, st: _Street) -> None:
    """A row of 3 to 6 traffic cones along the right lane edge."""
    layout = st.layout
    u_edge = layout.sides[0].sign * layout.sides[0].lane_edge + 0.4
    s0 = rng.uniform(8, 50)
    for k in range(int(rng.integers(3, 7))):
        x, y = layout.to_world(s0 + 3.0 * k, u_edge)
        if not st.occ.collides(x, y, 0.35, 0.35, 0, GROUND_Z, GROUND_Z + 0.75, margin=0.05):
            st.b.add(
                KIND_CYLINDER, (x, y, GROUND_Z + 0.37, 0.3, 0.3, 0.75, 0.0), Mat.SIGN, (0.95, 0.4, 0.05), 0.8
            )
            st.occ.add(x, y, 0.35, 0.35, 0.0, GROUND_Z, GROUND_Z + 0.75)
            st.counts["cone"] += 1


def _tree(rng, layout, b, occ, s, u, base, small: bool = False) -> None:
    x, y = layout.to_world(s, u)
    r_trunk = rng.uniform(0.08, 0.15) if small else rng.uniform(0.12, 0.3)
    trunk_h = rng.uniform(2.4, 3.2) if small else rng.uniform(2.4, 4.5)
    if occ.collides(x, y, 2 * r_trunk, 2 * r_trunk, 0.0, base, base + trunk_h, margin=0.3):
        return
    b.add(KIND_CYLINDER, (x, y, base + 0.5 * trunk_h, 2 * r_trunk, 2 * r_trunk, trunk_h, 0.0), Mat.BARK,
          jitter(rng, (0.3, 0.22, 0.15)), 0.25)  # fmt: skip
    occ.add(x, y, 2 * r_trunk, 2 * r_trunk, 0.0, base, base + trunk_h)
    rxy = rng.uniform(1.0, 1.8) if small else rng.uniform(1.5, 3.2)
    rz = min(rxy * rng.uniform(0.8, 1.4), 3.5)
    zc = base + trunk_h + 0.9 * rz  # the crown's bottom stays above ~2 m
    green = jitter(rng, (0.16, 0.3, 0.1), 0.15)
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
    green = jitter(rng, (0.2, 0.33, 0.12), 0.15)
    b.add(KIND_ELLIPSOID, (x, y, base + 0.4 * h, 2 * r, 2 * r * rng.uniform(0.7, 1.3), h * 1.2, rng.uniform(0, np.pi)),
          Mat.FOLIAGE, green, 0.45, -1, np.clip(green * 1.2, 0, 1))  # fmt: skip
    occ.add(x, y, 2 * r, 2 * r, 0.0, base, base + h)


def _lamp(rng, layout, b, occ, s, sg, a, base) -> None:
    x, y = layout.to_world(s, sg * a)
    h = rng.uniform(6, 9)
    if occ.collides(x, y, 0.3, 0.3, 0.0, base, base + h, margin=0.3):
        return
    grey = jitter(rng, (0.4, 0.42, 0.44))
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
          SIGNS[rng.integers(len(SIGNS))], rng.uniform(0.85, 1.0))  # fmt: skip
    occ.add(x, y, 0.7, 0.7, 0.0, base, base + h)
