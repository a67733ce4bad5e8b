"""Labelled road users built from parts: cars (a body with a sloping nose, a glass cabin with a
raked windscreen and a steeper rear window, lamps, wheels), vans, trucks, pedestrians (legs and
feet, torso, arms, a head with a face and hair, sometimes a backpack) and cyclists (a rider leaning
forward over a bicycle). Parts are given in the object frame (x along the heading, y left, z up from
the surface the object stands on) and stay inside the label box `l x w x h`.

Front and back differ the way they do on real road users, for the lidar (geometry, retro-reflective
tail lamps) and the camera (lamps, faces): a car's hood is longer than its trunk, its windscreen
leans further than its rear window and its nose slopes where its tail is upright; white or yellow
head lamps and a dark grille at the front, red tail lamps at the back. A pedestrian's feet point
forward, the face is skin and the back of the head hair, a backpack is on the back; a cyclist's
saddle and hips are over the rear wheel, the chest and head lean towards the handlebars at the
front, with a white lamp at the front and a red reflector at the back.
"""

from __future__ import annotations

import numpy as np

from pfactory.synth.materials import (
    CAR_PAINTS,
    CLOTHES,
    GLASS_RGB,
    HAIRS,
    HEAD_LAMP_REFL,
    HEAD_LAMP_RGB,
    RUBBER_RGB,
    SKINS,
    TAIL_LAMP_REFL,
    TAIL_LAMP_RGB,
    Mat,
    jitter,
    luma,
)
from pfactory.synth.raycast import (
    KIND_BOX,
    KIND_CYLINDER,
    KIND_ELLIPSOID,
    KIND_PRISM,
    PrimitiveBuilder,
)

GRILLE_RGB = (0.05, 0.05, 0.055)


class Shape:
    """Adds parts given in an object frame (x along the heading, y left, z up from `base_z`)."""

    def __init__(self, b: PrimitiveBuilder, x: float, y: float, base_z: float, yaw: float, owner: int):
        self.b, self.x, self.y, self.base_z, self.yaw, self.owner = b, x, y, base_z, yaw, owner
        self.c, self.s = np.cos(yaw), np.sin(yaw)

    def part(
        self, kind, dx, dy, z0, z1, l, w, mat, rgb, refl, rgb_top=None, dyaw: float = 0.0,
        taper: tuple[float, float] = (0.0, 0.0),
    ) -> None:  # fmt: skip
        x = self.x + self.c * dx - self.s * dy
        y = self.y + self.s * dx + self.c * dy
        z = self.base_z + 0.5 * (z0 + z1)
        self.b.add(
            kind, (x, y, z, l, w, z1 - z0, self.yaw + dyaw), mat, rgb, refl, self.owner, rgb_top, taper
        )


def _paint(rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """A car paint colour and its lidar reflectance (brighter paint returns more at 905 nm)."""
    k = rng.choice(len(CAR_PAINTS), p=[p for _, p in CAR_PAINTS])
    rgb = jitter(rng, CAR_PAINTS[k][0], 0.05)
    return rgb, float(np.clip(0.08 + 0.5 * luma(rgb) + rng.normal(0, 0.03), 0.03, 0.7))


def _wheels(sh: Shape, l: float, w: float, d: float, overhang: float, rear_len: float = 0.0) -> None:
    for sx in (1, -1):
        for sy in (1, -1):
            length = d + (rear_len if sx < 0 else 0.0)
            dx = sx * (0.5 * l - overhang - 0.5 * length)
            sh.part(KIND_BOX, dx, sy * (0.5 * w - 0.13), 0.0, d, length, 0.24, Mat.RUBBER, RUBBER_RGB, 0.05)


def _face_lamps(
    sh: Shape, front: bool, x_foot: float, z_foot: float, lean: float, z0: float, z1: float,
    y_out: float, width: float, rgb, refl,
) -> None:  # fmt: skip
    """A pair of lamps on a vehicle's front (or rear) face, standing 1 cm proud of it.

    The face meets `z_foot` at `x = x_foot` and leans inwards by `lean` metres per metre of
    height (a prism's taper / height); the lamps span `z0..z1`, their outer edges `y_out` from the
    centre line. Each lamp is a thin prism with the face's slope, so it follows the face.
    """
    sgn = 1.0 if front else -1.0
    depth = 0.04 + lean * (z1 - z0)
    x_out = x_foot - sgn * (lean * (z0 - z_foot) - 0.01)  # the lamp's outer face at its bottom
    taper = (lean * (z1 - z0), 0.0) if front else (0.0, lean * (z1 - z0))
    for sy in (1, -1):
        sh.part(
            KIND_PRISM, x_out - sgn * 0.5 * depth, sy * (y_out - 0.5 * width), z0, z1, depth, width,
            Mat.LAMP, rgb, refl, taper=taper,
        )  # fmt: skip


def build_car(sh: Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.15, 0.22)
    belt = h * rng.uniform(0.55, 0.62)
    _wheels(sh, l, w, min(0.64, belt - 0.05), 0.55)
    # Body: the nose slopes back to the hood (the top face is set back further at the front), the
    # tail is nearly upright. 1 cm short of the box at each end, so the lamps stay inside it.
    body_l, body_h = l - 0.02, belt - clearance
    nose, tail = rng.uniform(0.18, 0.32), rng.uniform(0.03, 0.1)
    sh.part(KIND_PRISM, 0, 0, clearance, belt, body_l, w, Mat.CAR_PAINT, paint, refl, taper=(nose, tail))
    # Cabin (glass sides and screens, paint roof): the hood is longer than the trunk and the
    # windscreen leans further (55-63 deg from vertical) than the rear window (22-50 deg).
    cab_h = h - belt
    hood = l * rng.uniform(0.22, 0.28)
    trunk = max(l * rng.uniform(0.04, 0.16), tail + 0.05)
    cab_l = l - hood - trunk
    screen = cab_h * np.tan(np.radians(rng.uniform(55, 63)))
    rear = cab_h * np.tan(np.radians(rng.uniform(22, 50)))
    k = min(1.0, 0.62 * cab_l / (screen + rear))  # keep a roof of at least 38% of the cabin
    sh.part(
        KIND_PRISM, 0.5 * (trunk - hood), 0, belt, h, cab_l, w * rng.uniform(0.84, 0.92),
        (Mat.GLASS, Mat.CAR_PAINT), GLASS_RGB, (0.05, refl), rgb_top=paint, taper=(k * screen, k * rear),
    )  # fmt: skip
    # Lamps high on each end face, a dark grille between the head lamps.
    lamp_h = rng.uniform(0.12, 0.16)
    head_rgb = HEAD_LAMP_RGB[int(rng.random() < 0.2)]
    z_top = belt - rng.uniform(0.04, 0.08)
    y_out = 0.5 * w - rng.uniform(0.06, 0.12)
    head_w = rng.uniform(0.25, 0.35)
    x_front, x_rear = 0.5 * body_l, -0.5 * body_l
    _face_lamps(
        sh, True, x_front, clearance, nose / body_h, z_top - lamp_h, z_top, y_out, head_w, head_rgb,
        HEAD_LAMP_REFL,
    )  # fmt: skip
    _face_lamps(
        sh, False, x_rear, clearance, tail / body_h, z_top - lamp_h, z_top, y_out, rng.uniform(0.22, 0.32),
        jitter(rng, TAIL_LAMP_RGB, 0.05), TAIL_LAMP_REFL,
    )  # fmt: skip
    g0, g1 = z_top - lamp_h - 0.1, z_top - 0.02
    lean = nose / body_h
    depth = 0.04 + lean * (g1 - g0)
    x_out = x_front - (lean * (g0 - clearance) - 0.005)
    sh.part(
        KIND_PRISM, x_out - 0.5 * depth, 0, g0, g1, depth, 2 * (y_out - head_w) - 0.06, Mat.METAL,
        GRILLE_RGB, 0.1, taper=(lean * (g1 - g0), 0.0),
    )  # fmt: skip


def build_van(sh: Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.2, 0.28)
    _wheels(sh, l, w, 0.66, 0.5)
    # A cargo van: a lower body with a sloping nose; above it a short cab with a raked windscreen
    # (glass sides: the front side windows) and the upright, windowless cargo box behind it.
    belt = 0.5 * h
    body_l, body_h = l - 0.04, belt - clearance
    nose = rng.uniform(0.1, 0.2)
    sh.part(
        KIND_PRISM, 0.01, 0, clearance, belt, body_l, w - 0.04, Mat.CAR_PAINT, paint, refl, taper=(nose, 0.0)
    )
    x_front = 0.01 + 0.5 * body_l
    screen = (h - belt) * np.tan(np.radians(rng.uniform(35, 45)))
    cab_l = screen + rng.uniform(0.5, 0.8)
    cab_x = x_front - nose - 0.5 * cab_l
    sh.part(
        KIND_PRISM, cab_x, 0, belt, h, cab_l, w - 0.04, (Mat.GLASS, Mat.CAR_PAINT), GLASS_RGB,
        (0.05, refl), rgb_top=paint, taper=(screen, 0.0),
    )  # fmt: skip
    cargo_r, cargo_f = -0.5 * l + 0.04, cab_x - 0.5 * cab_l
    sh.part(
        KIND_BOX,
        0.5 * (cargo_r + cargo_f),
        0,
        belt,
        h,
        cargo_f - cargo_r,
        w - 0.04,
        Mat.CAR_PAINT,
        paint,
        refl,
    )
    y_out = 0.5 * w - 0.1
    _face_lamps(
        sh, True, x_front, clearance, nose / body_h, belt - 0.2, belt - 0.06, y_out, 0.3,
        HEAD_LAMP_RGB[int(rng.random() < 0.2)], HEAD_LAMP_REFL,
    )  # fmt: skip
    _face_lamps(
        sh, False, 0.01 - 0.5 * body_l, clearance, 0.0, belt - 0.3, belt + 0.25, y_out, 0.16,
        jitter(rng, TAIL_LAMP_RGB, 0.05), TAIL_LAMP_REFL,
    )  # fmt: skip


def build_truck(sh: Shape, l, w, h, rng) -> None:
    cab_rgb, cab_refl = _paint(rng)
    cargo_rgb = jitter(
        rng, [(0.85, 0.85, 0.83), (0.6, 0.6, 0.62), (0.2, 0.3, 0.55), (0.6, 0.15, 0.1)][rng.integers(4)]
    )
    cab_l = rng.uniform(2.0, 2.5)
    cab_h = h * rng.uniform(0.8, 0.9)
    _wheels(sh, l, w, 1.0, 0.7, rear_len=1.3)
    # The cab at the front (2 cm short of the box: head lamps on its face), the cargo box and the
    # chassis behind it (3 cm short at the back: tail lamps on the underrun bar).
    fx = 0.5 * l - 0.5 * cab_l  # cab centre
    sh.part(KIND_BOX, fx - 0.01, 0, 0.45, 0.58 * cab_h, cab_l - 0.02, w, Mat.CAR_PAINT, cab_rgb, cab_refl)
    sh.part(
        KIND_BOX, fx, 0, 0.58 * cab_h, cab_h, cab_l - 0.1, w - 0.06, (Mat.GLASS, Mat.CAR_PAINT),
        GLASS_RGB, (0.05, cab_refl), rgb_top=cab_rgb,
    )  # fmt: skip
    rear = -0.5 * l + 0.03
    cargo_l = 0.5 * l - cab_l - 0.3 - rear
    sh.part(
        KIND_BOX,
        rear + 0.5 * cargo_l,
        0,
        1.05,
        h,
        cargo_l,
        w,
        Mat.METAL,
        cargo_rgb,
        0.1 + 0.5 * luma(cargo_rgb),
    )
    chassis_l = 0.5 * l - cab_l - rear
    sh.part(
        KIND_BOX, rear + 0.5 * chassis_l, 0, 0.55, 1.05, chassis_l, 0.7 * w, Mat.METAL, (0.1, 0.1, 0.1), 0.15
    )
    _face_lamps(
        sh, True, 0.5 * l - 0.02, 0.45, 0.0, 0.6, 0.78, 0.5 * w - 0.1, 0.3,
        HEAD_LAMP_RGB[int(rng.random() < 0.3)], HEAD_LAMP_REFL,
    )  # fmt: skip
    _face_lamps(
        sh, False, rear, 0.55, 0.0, 0.8, 0.98, 0.5 * w - 0.08, 0.3, jitter(rng, TAIL_LAMP_RGB, 0.05),
        TAIL_LAMP_REFL,
    )  # fmt: skip


def _head(sh: Shape, x: float, z_top: float, w: float, rng) -> None:
    """A head `0.2 m` tall whose top is at `z_top`, centred at `x`: a skin ellipsoid set forward
    (the face) under a hair ellipsoid set back and up (the back and top of the head)."""
    r = 0.1
    skin, hair = SKINS[rng.integers(len(SKINS))], HAIRS[rng.integers(len(HAIRS))]
    hw = min(w - 0.04, 1.7 * r)
    sh.part(KIND_ELLIPSOID, x + 0.02, 0, z_top - 2 * r - 0.02, z_top - 0.02, 2 * r, hw, Mat.SKIN, skin, 0.3)
    sh.part(
        KIND_ELLIPSOID, x - 0.02, 0, z_top - 2 * r + 0.01, z_top, 2.05 * r, hw + 0.01, Mat.HAIR, hair, 0.12
    )


def _person(sh: Shape, l, w, h, rng, dx0: float = 0.0) -> None:
    """Legs and feet, torso, arms and head inside an `l x w x h` box (x along the heading):
    the feet point forward, the upper body leans a little forward, the face looks forward;
    some carry a backpack."""
    shirt, trousers = (
        jitter(rng, CLOTHES[rng.integers(len(CLOTHES))]),
        jitter(rng, CLOTHES[rng.integers(len(CLOTHES))]),
    )
    refl_shirt, refl_trousers = 0.08 + 0.45 * luma(shirt), 0.08 + 0.45 * luma(trousers)
    r_head = 0.1
    hip = 0.47 * h
    torso_top = h - 2 * r_head - 0.03
    lean = 0.02  # the torso's centre ahead of the hips, the head further
    depth = min(0.5 * l - 0.02 - lean, rng.uniform(0.12, 0.16))
    half_w = min(0.5 * w - 0.02, rng.uniform(0.19, 0.24))
    r_leg = 0.075
    foot_l, foot_fwd = 0.25, 0.06  # a foot reaches foot_fwd + foot_l / 2 ahead of its leg
    stride = rng.uniform(0.0, max(0.0, min(0.5 * l - r_leg, 0.5 * l - foot_fwd - 0.5 * foot_l) - 0.02))
    shoe = jitter(rng, ((0.08, 0.08, 0.08), (0.85, 0.85, 0.85))[int(rng.random() < 0.25)])
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER, dx0 + sgn * stride, sgn * 0.09, 0.0, hip + 0.05, 2 * r_leg, 2 * r_leg,
            Mat.CLOTH, trousers, refl_trousers,
        )  # fmt: skip
        sh.part(
            KIND_BOX, dx0 + sgn * stride + foot_fwd, sgn * 0.09, 0.0, 0.09, foot_l, 0.1, Mat.RUBBER, shoe,
            0.08 + 0.3 * luma(shoe),
        )  # fmt: skip
    sh.part(
        KIND_ELLIPSOID,
        dx0 + lean,
        0,
        hip - 0.05,
        torso_top,
        2 * depth,
        2 * half_w,
        Mat.CLOTH,
        shirt,
        refl_shirt,
    )
    r_arm = 0.045
    arm_y = min(0.5 * w - r_arm - 0.01, half_w + 0.02)
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER, dx0 + lean, sgn * arm_y, hip - 0.02, torso_top - 0.06, 2 * r_arm, 2 * r_arm,
            Mat.CLOTH, shirt, refl_shirt,
        )  # fmt: skip
    pack_d = 0.14
    if rng.random() < 0.3 and dx0 + lean - depth - pack_d + 0.02 >= -0.5 * l + 0.01:
        pack = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
        sh.part(
            KIND_BOX, dx0 + lean - depth - 0.5 * pack_d + 0.02, 0, hip + 0.08, torso_top - 0.04, pack_d,
            1.4 * half_w, Mat.CLOTH, pack, 0.08 + 0.45 * luma(pack),
        )  # fmt: skip
    _head(sh, dx0 + 2 * lean, h, w, rng)


def build_pedestrian(sh: Shape, l, w, h, rng) -> None:
    _person(sh, l, w, h, rng)


def build_cyclist(sh: Shape, l, w, h, rng) -> None:
    frame_rgb = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
    r_wheel = 0.34
    axle = 0.5 * l - r_wheel
    for sgn in (1, -1):  # wheels as thin discs
        sh.part(
            KIND_ELLIPSOID, sgn * axle, 0, 0.0, 2 * r_wheel, 2 * r_wheel, 0.05, Mat.RUBBER, RUBBER_RGB, 0.06
        )
    sh.part(KIND_BOX, 0.0, 0, 0.55, 0.85, 0.55 * l, 0.06, Mat.METAL, frame_rgb, 0.35)  # frame
    bars_x = axle - 0.1
    sh.part(KIND_BOX, bars_x, 0, 0.95, 1.02, 0.06, min(w, 0.56), Mat.METAL, (0.1, 0.1, 0.1), 0.3)  # bars
    # A white lamp ahead of the bars, a red reflector above the rear wheel, the saddle behind.
    sh.part(KIND_BOX, bars_x + 0.07, 0, 0.84, 0.94, 0.06, 0.08, Mat.LAMP, HEAD_LAMP_RGB[0], HEAD_LAMP_REFL)
    sh.part(
        KIND_BOX, -axle - 0.05, 0, 0.72, 0.8, 0.03, 0.1, Mat.LAMP, jitter(rng, TAIL_LAMP_RGB, 0.05),
        TAIL_LAMP_REFL,
    )  # fmt: skip
    saddle = 0.85
    sh.part(KIND_BOX, -0.22, 0, saddle - 0.05, saddle + 0.02, 0.26, 0.14, Mat.RUBBER, RUBBER_RGB, 0.05)
    # The rider: seated (no standing legs), legs from saddle to pedals, hips over the saddle,
    # chest and head leaning forward over the front wheel, arms reaching to the bars.
    trousers = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
    for sgn in (1, -1):
        sh.part(
            KIND_CYLINDER, -0.08 + sgn * 0.06, sgn * 0.12, 0.3, saddle + 0.1, 0.14, 0.14, Mat.CLOTH, trousers,
            0.08 + 0.45 * luma(trousers),
        )  # fmt: skip
    _person_upper(sh, l, w, h, saddle, bars_x, rng)


def _person_upper(sh: Shape, l, w, h, saddle, bars_x, rng) -> None:
    shirt = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
    refl = 0.08 + 0.45 * luma(shirt)
    r_head = 0.1
    top = h - 2 * r_head - 0.02
    width = min(w - 0.04, 0.42)
    sh.part(KIND_ELLIPSOID, -0.12, 0, saddle, saddle + 0.4, 0.34, width, Mat.CLOTH, shirt, refl)  # hips
    sh.part(KIND_ELLIPSOID, 0.1, 0, saddle + 0.2, top, 0.4, width, Mat.CLOTH, shirt, refl)  # chest, leaning
    arm_x0 = 0.15  # shoulders
    for sgn in (1, -1):  # arms reaching to the bars
        sh.part(
            KIND_BOX, 0.5 * (arm_x0 + bars_x), sgn * min(0.5 * w - 0.05, 0.2), top - 0.25, top - 0.15,
            bars_x - arm_x0, 0.08, Mat.CLOTH, shirt, refl,
        )  # fmt: skip
    _head(sh, 0.28, h, w, rng)


BUILDERS = {
    "Car": build_car,
    "Van": build_van,
    "Truck": build_truck,
    "Pedestrian": build_pedestrian,
    "Cyclist": build_cyclist,
}
