"""The synthetic source dataset: deterministic street scenes seen by a ray-cast lidar and a rendered
camera, written in the KITTI (1 camera) or nuScenes (N cameras) layout. `factory data synth`.

One module per job, bottom up:
- `materials`: surface materials (lidar dropout/penetration, camera texture/specular) and palettes;
- `layout`: the street (lanes, parking, sidewalks, zones) and the ground;
- `occupancy`: BEV + height collision bookkeeping for placement;
- `shapes`: labelled road users built from parts (car, van, truck, pedestrian, cyclist);
- `clutter`: unlabelled façades, vegetation, walls, poles, bins, bollards, cones;
- `road_users`: the labelled class mix, sizes and placement;
- `lighting`: sun, ambient, sky and haze;
- `scene`: `sample_scene` (layout + clutter + road users + light) -> `Scene`;
- `raycast`: analytic primitives and the ray caster both sensors share;
- `sensors`: the spinning multi-beam lidar and the pinhole camera render;
- `native`: the camera's shading and the lidar's `surface()` in C (`_shade.c`), byte-identical to
  `sensors`' NumPy reference, which stays the fallback;
- `dataset`: frames (labels, occlusion, truncation), encoders and `generate_dataset`;
- `params`: the `synth:` section of params.yaml.

Nothing is imported here: `flows.params` reads `params` without loading the generator.
"""
