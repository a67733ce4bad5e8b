"""Labelled road users built from parts: cars (body, glass cabin, wheels), vans, trucks, pedestrians
(legs, torso, arms, head) and cyclists (a rider on a bicycle). Parts are given in the object frame
(x along the heading, y left, z up from the surface the object stands on)."""

from __future__ import annotations

import numpy as np

from pfactory.sensors.synth.materials import (
    CAR_PAINTS,
    CLOTHES,
    GLASS_RGB,
    HAIRS,
    RUBBER_RGB,
    SKINS,
    Mat,
    jitter,
    luma,
)
from pfactory.sensors.synth.raycast import KIND_BOX, KIND_CYLINDER, KIND_ELLIPSOID, PrimitiveBuilder


class Shape:
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
    k = rng.choice(len(CAR_PAINTS), p=[p for _, p in CAR_PAINTS])
    rgb = jitter(rng, CAR_PAINTS[k][0], 0.05)
    return rgb, float(np.clip(0.08 + 0.5 * luma(rgb) + rng.normal(0, 0.03), 0.03, 0.7))


def _wheels(sh: Shape, l: float, w: float, d: float, overhang: float, rear_len: float = 0.0) -> None:
    for sx in (1, -1):
        for sy in (1, -1):
            length = d + (rear_len if sx < 0 else 0.0)
            dx = sx * (0.5 * l - overhang - 0.5 * length)
            sh.part(KIND_BOX, dx, sy * (0.5 * w - 0.13), 0.0, d, length, 0.24, Mat.RUBBER, RUBBER_RGB, 0.05)


def build_car(sh: Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.15, 0.22)
    belt = h * rng.uniform(0.55, 0.62)
    _wheels(sh, l, w, min(0.64, belt - 0.05), 0.55)
    sh.part(KIND_BOX, 0, 0, clearance, belt, l, w, Mat.CAR_PAINT, paint, refl)
    cab_l = l * rng.uniform(0.45, 0.58)
    sh.part(
        KIND_BOX, -l * rng.uniform(0.02, 0.1), 0, belt, h, cab_l, w * rng.uniform(0.84, 0.92),
        (Mat.GLASS, Mat.CAR_PAINT), GLASS_RGB, (0.05, refl), rgb_top=paint,
    )  # fmt: skip


def build_van(sh: Shape, l, w, h, rng) -> None:
    paint, refl = _paint(rng)
    clearance = rng.uniform(0.2, 0.28)
    _wheels(sh, l, w, 0.66, 0.5)
    # A cargo van: one tall body; the cab's windscreen and front side windows are a glass band
    # flush with the front, the cargo part has no windows.
    sh.part(KIND_BOX, -0.02, 0, clearance, h, l - 0.04, w - 0.04, Mat.CAR_PAINT, paint, refl)
    sh.part(KIND_BOX, 0.5 * l - 0.6, 0, 0.55 * h, 0.88 * h, 1.2, w, Mat.GLASS, GLASS_RGB, 0.05)


def build_truck(sh: Shape, l, w, h, rng) -> None:
    cab_rgb, cab_refl = _paint(rng)
    cargo_rgb = jitter(
        rng, [(0.85, 0.85, 0.83), (0.6, 0.6, 0.62), (0.2, 0.3, 0.55), (0.6, 0.15, 0.1)][rng.integers(4)]
    )
    cab_l = rng.uniform(2.0, 2.5)
    cab_h = h * rng.uniform(0.8, 0.9)
    _wheels(sh, l, w, 1.0, 0.7, rear_len=1.3)
    fx = 0.5 * l - 0.5 * cab_l  # cab centre
    sh.part(KIND_BOX, fx, 0, 0.45, 0.58 * cab_h, cab_l, w, Mat.CAR_PAINT, cab_rgb, cab_refl)
    sh.part(
        KIND_BOX, fx, 0, 0.58 * cab_h, cab_h, cab_l - 0.1, w - 0.06, (Mat.GLASS, Mat.CAR_PAINT),
        GLASS_RGB, (0.05, cab_refl), rgb_top=cab_rgb,
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
        0.1 + 0.5 * luma(cargo_rgb),
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


def _person(sh: Shape, l, w, h, rng, dx0: float = 0.0) -> None:
    """Legs, torso, arms and head inside an `l x w x h` box (x along the heading)."""
    shirt, trousers = (
        jitter(rng, CLOTHES[rng.integers(len(CLOTHES))]),
        jitter(rng, CLOTHES[rng.integers(len(CLOTHES))]),
    )
    skin, hair = SKINS[rng.integers(len(SKINS))], HAIRS[rng.integers(len(HAIRS))]
    refl_shirt, refl_trousers = 0.08 + 0.45 * luma(shirt), 0.08 + 0.45 * luma(trousers)
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


def build_pedestrian(sh: Shape, l, w, h, rng) -> None:
    _person(sh, l, w, h, rng)


def build_cyclist(sh: Shape, l, w, h, rng) -> None:
    frame_rgb = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
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
            RUBBER_RGB,
            0.06,
        )
    sh.part(KIND_BOX, 0.0, 0, 0.55, 0.85, 0.55 * l, 0.06, Mat.METAL, frame_rgb, 0.35)  # frame
    sh.part(
        KIND_BOX, 0.5 * l - r_wheel - 0.1, 0, 0.95, 1.02, 0.06, min(w, 0.56), Mat.METAL, (0.1, 0.1, 0.1), 0.3
    )  # bars
    # The rider: seated (no standing legs), legs from saddle to pedals, torso leaning forward.
    saddle = 0.85
    trousers = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
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
            0.08 + 0.45 * luma(trousers),
        )
    rider_h = h - saddle + 0.05
    _person_upper(sh, l, w, h, saddle, rider_h, rng)


def _person_upper(sh: Shape, l, w, h, saddle, rider_h, rng) -> None:
    shirt = jitter(rng, CLOTHES[rng.integers(len(CLOTHES))])
    refl = 0.08 + 0.45 * luma(shirt)
    skin, hair = SKINS[rng.integers(len(SKINS))], HAIRS[rng.integers(len(HAIRS))]
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
