"""Atomic file and directory writes, and content hashes.

Every file the factory writes goes through here: written to a temporary sibling, flushed,
fsynced and renamed over the target, so a reader never sees half a file and an interrupted
run leaves nothing a later stage would read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; published files are ordinary readable files.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    """numpy scalars/arrays and paths in JSON; anything else is an error (not silently str()-ed)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int = 2) -> Path:
    """Write `obj` as JSON (sorted keys, trailing newline) to `path` atomically."""
    return atomic_write_text(
        path, json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n"
    )


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], overwrite: bool = True) -> Iterator[Path]:
    """Build a directory in a temporary sibling and rename it into place on success.

    Yields the temporary directory to write into. On an exception the temporary directory
    is removed and `path` is left untouched. With `overwrite`, an existing `path` is
    replaced (moved aside, then deleted) only after the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp creates 0700
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{path} already exists")
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def check_listed_file(
    path: Path,
    sha256: str,
    listed_in: str,
    error: type[Exception] = ValueError,
    *,
    hashed_in: str | None = None,
    hint: str = "",
    what: str = "",
) -> str:
    """`path`'s sha256 when the file exists and matches the `sha256` a manifest (`listed_in`) gives for it;
    else `error` naming the file, where it is listed and both hashes (corrupt or swapped files)."""
    if not path.is_file():
        raise error(f"{path}: {what}listed in {listed_in} but missing")
    got = sha256_file(path)
    if got != sha256:
        raise error(
            f"{path}: sha256 {got[:12]}... does not match {hashed_in or listed_in} ({sha256[:12]}...){hint}"
        )
    return got
