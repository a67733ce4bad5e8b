"""Surface materials of the synthetic scene: what each does to the lidar (dropout, penetration)
and to the camera (texture, specular), and the colour palettes objects are painted from."""

from __future__ import annotations

from enum import IntEnum

import numpy as np


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
    LAMP = 17


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
MATERIAL_SPECULAR[[Mat.CAR_PAINT, Mat.GLASS, Mat.METAL, Mat.LAMP]] = (0.35, 0.6, 0.2, 0.6)
# Camera: light a surface gives off itself, as a share of its albedo (independent of the sun):
# head lamps (clear glass over a chrome reflector, daytime running lights) and tail lamps (red
# lenses) read bright from every side, so a vehicle's front and back differ in the image.
MATERIAL_EMISSION = np.zeros(N_MAT)
MATERIAL_EMISSION[Mat.LAMP] = 0.55

HEAD_LAMP_RGB = ((0.95, 0.95, 0.92), (0.97, 0.88, 0.6))  # white, yellowish (older halogen units)
TAIL_LAMP_RGB = (0.8, 0.05, 0.04)
# Lidar reflectance of lamps: tail lamps carry retro-reflectors (rear reflectors are mandatory on
# cars and bicycles) and return far more than paint; head lamp lenses a little more than paint.
HEAD_LAMP_REFL, TAIL_LAMP_REFL = 0.45, 0.9

GLASS_RGB = (0.1, 0.12, 0.15)
RUBBER_RGB = (0.04, 0.04, 0.045)
CAR_PAINTS = (  # (rgb, share): white, black, silver and grey dominate real traffic
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
CLOTHES = (
    (0.08, 0.08, 0.1), (0.12, 0.15, 0.3), (0.35, 0.35, 0.37), (0.55, 0.5, 0.38), (0.6, 0.12, 0.1),
    (0.85, 0.85, 0.85), (0.15, 0.3, 0.18), (0.5, 0.35, 0.2), (0.7, 0.55, 0.1), (0.25, 0.12, 0.3),
)  # fmt: skip
SKINS = ((0.87, 0.7, 0.58), (0.72, 0.53, 0.4), (0.5, 0.35, 0.25), (0.32, 0.22, 0.16))
HAIRS = ((0.08, 0.06, 0.05), (0.3, 0.2, 0.1), (0.6, 0.5, 0.3), (0.5, 0.5, 0.5))
FACADES = (
    (0.75, 0.7, 0.62), (0.62, 0.42, 0.32), (0.8, 0.78, 0.75), (0.5, 0.5, 0.52), (0.7, 0.6, 0.45),
    (0.45, 0.32, 0.25), (0.85, 0.82, 0.7),
)  # fmt: skip
SIGNS = ((0.8, 0.1, 0.1), (0.1, 0.25, 0.7), (0.9, 0.9, 0.9), (0.9, 0.75, 0.1))


def luma(rgb) -> float:
    return float(0.3 * rgb[0] + 0.59 * rgb[1] + 0.11 * rgb[2])


def jitter(rng: np.random.Generator, rgb, amount: float = 0.04) -> np.ndarray:
    """Vary a colour's brightness by ~`amount` and its hue a little (greens stay green)."""
    tint = rng.normal(0, min(amount / 3, 0.015), 3)
    return np.clip(np.asarray(rgb) * (1 + rng.normal(0, amount)) + tint, 0, 1)
