"""`tiny_bev`: a small lidar-only BEV center detector, an out-of-tree architecture for perception-factory.

The entry point `tiny_bev = "pfactory_tiny_detector:ARCH"` (group `pfactory.models`, pyproject.toml) names
`ARCH` below: the factory reads the entry point from the installed metadata, imports this module only when
`model.arch: tiny_bev` is selected, and from then on knows the detector only through the contract
(`pfactory.detectors.contract`): its params section (`TinyBevParams`), `build(section, spec)`, and the built
detector's `loss`, `decode` and `forward_export`. Nothing else in the factory names this package.

This module imports no torch (the factory lists architectures without importing torch); `build` does.
"""

from __future__ import annotations

from typing import Any

from pfactory.detectors.contract import Architecture, DataSpec
from pfactory_tiny_detector.params import TinyBevParams

__all__ = ["ARCH", "TinyBevParams", "build"]


def build(section: TinyBevParams, spec: DataSpec) -> Any:
    """The `TinyBevDetector` for the validated `model.tiny_bev` section and the prepared data's `spec`
    (classes, point-cloud range). ValueError when the range is not a whole number of cells."""
    from pfactory_tiny_detector.model import TinyBevDetector

    return TinyBevDetector(section, spec)


ARCH = Architecture(
    params=TinyBevParams,
    build=build,
    description="Lidar-only BEV grid (occupancy/height/intensity), 2-scale convs, center head with sin/cos yaw "
    "(examples/detector-plugin)",
)
