"""Where the prepare stage reads and writes: local paths or fsspec URLs (`s3://bucket/prefix`, ...).

- `Location`: a directory, local or on object storage; relative names always use `/`. Every write lands
  atomically: a local file through a temporary sibling + rename, an object through one PUT (an object
  appears whole or not at all).
- The publishing protocol of prepared outputs (`pfactory.prepare.publish`): `build_output(out)`, the build directory of a prepare run, published only when complete. Local: a
  staging sibling renamed over `out` (`pfactory.storage.fsutil.atomic_directory`, the one mechanism every stage's
  output uses: a directory that is not prepare's own output, or overlaps an input, is refused). URL: a staging
  prefix `<parent>/.<name>.partial-<host>-<pid>-<hex>` beside `out`; on success the previous output is
  unpublished (its manifest.json removed first, then the files it lists), the new files are copied in
  (server-side copies) and **manifest.json is copied last**: readers require it (`open_prepared`,
  `fetch_prepared`), so a prefix without one is never read. While a publish runs, the marker
  `.pfactory-publishing` says the prefix is ours. A prefix that holds objects but neither a manifest nor
  that marker is refused: prepare does not overwrite data it did not write.
- The raw dataset over a URL: `pfactory.prepare.rawdata` (listing, each unit's files).
- `fetch_prepared(url, dest)`: a verified local copy of a published prepared prefix (manifest first, every
  listed file's sha256 checked) for the stages that read shards (train).

Credentials and endpoints come from the environment, as for any fsspec / boto client: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` (an S3-compatible server: MinIO, Ceph, ...), or fsspec's
`FSSPEC_S3_<OPTION>` variables. Dask workers need the same environment (docs/OPERATIONS.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

PUBLISHING = ".pfactory-publishing"


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for fsspec URLs (`s3://...`, `gs://...`, `memory://...`); False for local paths and `file://`."""
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def scratch_dir() -> Path:
    """Where downloads and uploads are staged on this machine (Dask's scratch when set, else the temp dir)."""
    d = Path(os.environ.get("DASK_TEMPORARY_DIRECTORY") or tempfile.gettempdir()) / "pfactory-storage"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Location:
    """A directory: a local path or an fsspec URL. Picklable (the filesystem is re-opened in each process)."""

    def __init__(self, url: str | os.PathLike[str]):
        s = os.fspath(url)
        self.url = s.rstrip("/") if is_url(s) else str(Path(s.removeprefix("file://")).absolute())
        self._fs: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "_fs": None}

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    @property
    def remote(self) -> bool:
        return is_url(self.url)

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url)[0] if self.remote else fsspec.filesystem("file")
        return self._fs

    def path(self, rel: str = "") -> str:
        """The filesystem path of `rel` (bucket/key for URLs, an absolute path locally)."""
        base = self.fs._strip_protocol(self.url) if self.remote else self.url
        return f"{base}/{rel}" if rel else base

    def child(self, rel: str) -> Location:
        return Location(f"{self.url}/{rel}")

    def local_path(self, rel: str = "") -> Path:
        assert not self.remote, self.url
        return Path(self.path(rel))

    # -- reading --------------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel)))

    def open(self, rel: str, mode: str = "rb") -> Any:
        return self.fs.open(self.path(rel), mode)

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel`, relative to this location, sorted ([] when there is none)."""
        if self.remote:
            self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        root = self.path().rstrip("/")
        return sorted(str(PurePosixPath(p).relative_to(root)) for p in found if p != base)

    def names(self, rel: str) -> list[str]:
        """Names of the files directly in folder `rel` (sorted; [] when it does not exist)."""
        if self.remote:
            self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted(PurePosixPath(e["name"]).name for e in entries if e["type"] == "file")

    def is_dir(self, rel: str) -> bool:
        return bool(self.fs.isdir(self.path(rel)))

    # -- writing --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def landing(self, rel: str) -> Iterator[Path]:
        """A local file path to write `rel` to; on exit it lands at `rel` atomically (nothing on error)."""
        if not self.remote:
            dest = self.local_path(rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        else:
            tmp = scratch_dir() / f"up-{os.getpid()}-{os.urandom(6).hex()}-{PurePosixPath(rel).name}"
        try:
            yield tmp
            if self.remote:
                self.fs.put_file(str(tmp), self.path(rel))
            else:
                os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.remote:
            self.fs.pipe_file(self.path(rel), data)
        else:
            from pfactory.storage.fsutil import atomic_write_bytes

            atomic_write_bytes(self.local_path(rel), data)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def remove_tree(self, rel: str = "") -> None:
        if not self.remote:
            shutil.rmtree(self.local_path(rel), ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)


# ----------------------------------------------------------------------------------------------
# Output: build, then publish
