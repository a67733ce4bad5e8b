"""The optional `synth` source stage: params.synth -> a synthetic raw dataset at paths.synth.

Files in: none. Files out: `paths.synth` (KITTI layout, or nuScenes with `synth.cameras > 1`),
built in a temporary sibling and renamed into place, so an interrupted run leaves nothing.
Run by DVC as `python -m tasks.synth [-S synth.frames=...]`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks._command import Command

STAGE = "synth"


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`)."""
    from pfactory.synth.params import SynthParams

    return {"synth": SynthParams}


def run(params: Any, out: Path) -> dict:
    """Generate `params.synth.frames` frames into `out`; returns the generator's summary."""
    from pfactory.storage.fsutil import atomic_directory
    from pfactory.synth.dataset import generate_dataset

    d = params.synth
    t0 = time.perf_counter()
    with atomic_directory(out, stage="synth") as tmp:
        summary = generate_dataset(tmp, frames=d.frames, seed=d.seed, cameras=d.cameras, workers=d.workers)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def body(params: Any, options: Any) -> dict:
    """The stage's work (`tasks._stage.run_stage`): synth has no options of its own."""
    return run(params, Path(params.paths.synth))


COMMAND = Command(STAGE, "Generate the synthetic raw dataset of params.synth at paths.synth.", (), body, sections)


def main(argv: list[str] | None = None) -> None:
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
