"""The `paths:` section of params.yaml: one directory per stage, relative to the DVC project root (the
repository for `dvc repro`, the run workspace for `factory run`). The file names inside each directory:
`pfactory.storage.artifacts`."""

from __future__ import annotations

from pfactory.config.section import Section


class PathsParams(Section):
    """Where each stage reads and writes, relative to the project root (DESIGN.md §3)."""

    artifacts: str = "artifacts"
    synth: str = "artifacts/data/raw/synth"
    """Where the synth stage writes the synthetic dataset (inside the project: a DVC out)."""
    raw: str = "artifacts/data/raw/synth"
    """Raw dataset the prepare stage reads (KITTI or nuScenes layout): the synthetic one by default, or
    any dataset directory, e.g. an absolute path to a KITTI copy (a DVC dependency outside the project)."""
    prepared: str = "artifacts/prepared"
    model: str = "artifacts/model"
    optimized: str = "artifacts/optimized"
    eval: str = "artifacts/eval"
    release: str = "artifacts/release"
