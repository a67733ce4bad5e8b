"""The `painted_pillars` architecture: the entry point `pfactory.models` names (pyproject.toml).

`ARCH.params` is the `model.painted_pillars` section (`PaintedPillarsParams`); `ARCH.build(section, spec)`
gives the camera-painted pillar detector (`pfactory.archs.painted_pillars.detector`) for the prepared data's classes,
range and image size. Importing this module imports no torch (the registry lists architectures without it).
"""

from __future__ import annotations

from typing import Any

from pfactory.archs.painted_pillars.params import ModelParams, PaintedPillarsParams
from pfactory.detectors.contract import Architecture, DataSpec


def model_params(section: PaintedPillarsParams, spec: DataSpec) -> ModelParams:
    """The section with the data's classes and range: what the network is built from (validated)."""
    values = section.model_dump()
    return ModelParams.model_validate({**values, "classes": list(spec.classes), "pc_range": list(spec.pc_range)})


def build(section: PaintedPillarsParams, spec: DataSpec) -> Any:
    """A `PaintedPillarDetector` (channels-last, the sparse stem where the C kernels are built)."""
    from pfactory.archs.painted_pillars.detector import build_model

    return build_model(model_params(section, spec), spec.image_size, spec=spec)


ARCH = Architecture(
    params=PaintedPillarsParams,
    build=build,
    description="Camera-painted pillars, multi-scale BEV backbone, center head (the default; docs/MODEL.md)",
)
