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

import numpy as np

from pfactory.synth.clutter import add_clutter
from pfactory.synth.layout import GROUND_Z, Layout, sample_layout
from pfactory.synth.lighting import Light, sample_light
from pfactory.synth.occupancy import Occupancy
from pfactory.synth.raycast import PrimitiveBuilder, Primitives
from pfactory.synth.road_users import add_road_users


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
    counts = add_clutter(rng, layout, b, occ, s_lo, s_hi)
    boxes, names = add_road_users(rng, layout, b, occ, mode, accept or (lambda box: True))
    return Scene(layout, b.build(), boxes, names, sample_light(rng), counts)
