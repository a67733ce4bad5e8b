"""Content hash of a raw dataset, as the reader lists its files: the prepared manifest's `source.sha256`.

`hash_frame(files)`: sha256 over `name \t sha256(content)` lines of one frame's files (`DatasetReader.frame_files`,
sorted by name); `tables_digest(dataset)`: the same over the files every frame depends on
(`DatasetReader.shared_files`), None when there are none; `source_digest(dataset)`: sha256 over every frame's
`frame_id \t hash_frame` line, in check order, then `tables \t <tables_digest>` -- what prepare computes while it
reads, recomputed (evaluate's check that the raw data a manifest names is unchanged). Names are the dataset's own
(KITTI `velodyne/000001.bin`), so the hash does not depend on where the dataset lives or on symlinks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory.storage.fsutil import sha256_bytes, sha256_file


def hash_frame(files: list[tuple[str, Path]], known: dict[Path, bytes] | None = None) -> str:
    """sha256 over `name \t sha256(content)` lines of a frame's files (sorted by name).

    `known`: contents already in memory (the encoded images), hashed without a second read.
    """
    lines = []
    for name, p in sorted(files):
        digest = sha256_bytes(known[p]) if known and p in known else sha256_file(p)
        lines.append(f"{name}\t{digest}")
    return sha256_bytes("\n".join(lines).encode())


def tables_digest(dataset: Any) -> str | None:
    """sha256 over the files every frame depends on (`DatasetReader.shared_files`: the nuScenes tables);
    None when the frames are self-contained (KITTI)."""
    files = dataset.shared_files()
    return hash_frame(files) if files else None


def source_digest(dataset: Any, progress: Callable[[int, int], None] | None = None) -> str:
    """The prepared manifest's `source.sha256` of `dataset` (a `DatasetReader`) recomputed from its files
    (module docstring). Reads every file of the dataset once."""
    ids = dataset.check_ids()
    digests = []
    for i, fid in enumerate(ids):
        digests.append(f"{fid}\t{hash_frame(dataset.frame_files(fid))}")
        if progress is not None:
            progress(i + 1, len(ids))
    return sha256_bytes(("\n".join(digests) + f"\ntables\t{tables_digest(dataset)}").encode())
