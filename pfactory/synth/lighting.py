"""Scene light for the camera render: sun direction and strength, ambient, sky colours, haze."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pfactory.synth.materials import jitter


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


def sample_light(rng: np.random.Generator) -> Light:
    overcast = rng.random() < 0.3
    el, az = np.radians(rng.uniform(20, 65)), rng.uniform(-np.pi, np.pi)
    sun = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    if overcast:
        zenith, horizon = jitter(rng, (0.62, 0.64, 0.68)), jitter(rng, (0.8, 0.8, 0.82))
        return Light(
            sun,
            rng.uniform(0.6, 0.75),
            rng.uniform(0.15, 0.3),
            zenith,
            horizon,
            rng.uniform(250, 500),
            rng.uniform(0.95, 1.1),
        )
    zenith, horizon = jitter(rng, (0.3, 0.5, 0.85)), jitter(rng, (0.72, 0.8, 0.9))
    return Light(
        sun,
        rng.uniform(0.3, 0.45),
        rng.uniform(0.6, 0.8),
        zenith,
        horizon,
        rng.uniform(500, 1200),
        rng.uniform(0.9, 1.1),
    )
