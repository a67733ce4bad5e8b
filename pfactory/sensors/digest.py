"""Content hash of a raw dataset, as the reader lists its files: the prepared manifest's `source.sha256`.

`hash_frame(files)`: sha256 over `name \t sha256(content)` lines of one frame's files (`DatasetReader.frame_files`,
sorted by name); `tables_digest(dataset)`: the same over the files every frame depends on
(`DatasetReader.shared_files`), None when there are none; `source_digest(dataset)`: sha256 over every frame's
`frame_id \t hash_frame` line, in check order, then `tables \t <tables_digest>` -- what prepare computes while it
reads, recomputed (evaluate's check that the raw data a manifest names is unchanged). Names are the dataset's own
(KITTI `velodyne/000001.bin`), so the hash does not depend on where the dataset lives or on symlinks.

`checked_source_digest(dataset)`: `source_digest` without reading the files again when nothing changed, DVC's
own trust model: a digest cache (`$PFACTORY_DIGEST_CACHE_DIR`, the project's `artifacts/.state/digests/`) maps a
listing fingerprint (`listing_fingerprint`: the dataset's folder and, for every file the digest reads, its name,
size and modification time, from `stat` alone) to the content digest computed from exactly those files -- by
prepare as it read them (`remember_digest`) or by an earlier full recompute. Rewriting, adding, removing or
renaming a file changes the fingerprint and the files are read again; a rewrite that keeps a file's size and
modification time (`touch -r`, a clock set back) goes unnoticed, as in DVC.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfactory.storage.fsutil import atomic_write_text, sha256_bytes, sha256_file

DIGEST_CACHE_ENV = "PFACTORY_DIGEST_CACHE_DIR"
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


def listing_fingerprint(dataset: Any) -> str | None:
    """sha256 over `dataset.root` (resolved) and `frame id \t name \t size \t mtime_ns` of every file
    `source_digest` reads, in its order, then the shared files: `stat` only, no content. None when a file
    cannot be stat'ed (gone meanwhile): nothing is trusted then."""
    lines = [str(Path(dataset.root).resolve())]
    try:
        for fid in dataset.check_ids():
            for name, p in sorted(dataset.frame_files(fid)):
                st = os.stat(p)
                lines.append(f"{fid}\t{name}\t{st.st_size}\t{st.st_mtime_ns}")
        for name, p in sorted(dataset.shared_files()):
            st = os.stat(p)
            lines.append(f"tables\t{name}\t{st.st_size}\t{st.st_mtime_ns}")
    except OSError:
        return None
    return sha256_bytes("\n".join(lines).encode())


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    folder = cache_dir if cache_dir is not None else os.environ.get(DIGEST_CACHE_ENV)
    return Path(folder) if folder else None


def remembered_digest(fingerprint: str, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The content digest remembered for `fingerprint` (`listing_fingerprint`), None when there is none (or no
    cache: `cache_dir` None and `$PFACTORY_DIGEST_CACHE_DIR` unset)."""
    folder = _cache_dir(cache_dir)
    if folder is None:
        return None
    try:
        digest = (folder / fingerprint).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return digest if _SHA256.fullmatch(digest) else None


def remember_digest(fingerprint: str, digest: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remember that the files listed by `fingerprint` have content digest `digest` (atomic write); False when
    there is no cache or it cannot be written (nothing breaks: the next check reads the files)."""
    folder = _cache_dir(cache_dir)
    if folder is None or not _SHA256.fullmatch(digest):
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / fingerprint, digest + "\n")
    except OSError:
        return False
    return True


def cached_listing(dataset: Any, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """`listing_fingerprint(dataset)` when there is a digest cache to use it with; None (no `stat` at all)
    when there is none."""
    return listing_fingerprint(dataset) if _cache_dir(cache_dir) is not None else None


def remember_if_unchanged(
    dataset: Any, before: str | None, digest: str, cache_dir: str | os.PathLike[str] | None = None
) -> bool:
    """Remember `digest` for the listing `before` (`cached_listing`, taken before the files were read) when
    the dataset's listing is still the same: the digest then covers exactly those files. False otherwise."""
    if before is None or listing_fingerprint(dataset) != before:
        return False
    return remember_digest(before, digest, cache_dir)


def checked_source_digest(
    dataset: Any,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[str, bool]:
    """`(source_digest(dataset), read)`: the digest remembered for the dataset's current listing (`read` False),
    else recomputed from every file (`read` True) and remembered when the listing did not change meanwhile."""
    before = cached_listing(dataset, cache_dir)
    if before is not None:
        known = remembered_digest(before, cache_dir)
        if known is not None:
            return known, False
    digest = source_digest(dataset, progress)
    remember_if_unchanged(dataset, before, digest, cache_dir)
    return digest, True
