"""The optional `synth` source stage: params.synth -> a synthetic raw dataset at paths.synth.

Files in: none. Files out: `paths.synth` (KITTI layout, or nuScenes with `synth.cameras > 1`),
built in a temporary sibling and renamed into place, so an interrupted run leaves nothing.
Run by DVC as `python -m tasks.synth [-S synth.frames=...]`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pfactory.fsutil import atomic_directory
from pfactory.sensors.synth.params import SynthParams

SECTIONS = {"synth": SynthParams}  # what this stage reads of params.yaml (besides `paths`)


def run(params: Any, out: Path) -> dict:
    """Generate `params.synth.frames` frames into `out`; returns the generator's summary."""
    from pfactory.sensors.synth.dataset import generate_dataset

    d = params.synth
    t0 = time.perf_counter()
    with atomic_directory(out, stage="synth") as tmp:
        summary = generate_dataset(tmp, frames=d.frames, seed=d.seed, cameras=d.cameras, workers=d.workers)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def main(argv: list[str] | None = None) -> None:
    from tasks._stage import stage_main

    stage_main("synth", argv, lambda params: run(params, Path(params.paths.synth)), sections=SECTIONS)


if __name__ == "__main__":
    main(sys.argv[1:])
