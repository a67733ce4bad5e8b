"""The `synth:` section of params.yaml: how many synthetic frames, which seed, KITTI or nuScenes layout."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfactory.config.section import PositiveInt, Section


class SynthParams(Section):
    """The synthetic source dataset: the `synth` stage and `factory data synth`."""

    name: str = "synth"
    frames: PositiveInt = 250
    """Frames to generate; with val_fraction 0.2 this leaves ~200 for training."""
    seed: int = 0
    cameras: Annotated[int, Field(ge=1, le=6)] = 1
    """1 writes the KITTI layout; >1 writes the nuScenes layout with this many cameras."""
    workers: PositiveInt = 2
