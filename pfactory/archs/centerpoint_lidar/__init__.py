"""The `centerpoint_lidar` architecture: lidar-only pillars, one center head per class, direction-bin heading.

`ARCH` is the entry point `pfactory.models` names (pyproject.toml). `ARCH.params` is the
`model.centerpoint_lidar` section (`CenterPointLidarParams`); `ARCH.build(section, spec)` gives the detector
(`network.CenterPointLidar`) for the prepared data's classes and range. Importing this package imports no
torch (the registry lists architectures without it); `build` imports the network. docs/models/centerpoint_lidar.md.
"""

from __future__ import annotations

from typing import Any

from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams
from pfactory.detectors.contract import Architecture, DataSpec


def build(section: CenterPointLidarParams, spec: DataSpec) -> Any:
    """A `CenterPointLidar` detector for `section` and the data's `spec` (torch imported here, lazily)."""
    from pfactory.archs.centerpoint_lidar.network import build_detector

    return build_detector(section, spec)


ARCH = Architecture(
    params=CenterPointLidarParams,
    build=build,
    description="Lidar-only pillars, per-class center heads, direction-bin heading (docs/models/centerpoint_lidar.md)",
)
