"""The raw dataset of a prepare run, local or on object storage: layout, frame ids, each unit's files.

A local directory is read in place (Dask workers need the same path). A URL (`s3://bucket/prefix`) is listed
once by the driver (`RawSource`), by the reader of its layout (`DatasetReader.list_remote`; KITTI: the names
in each part folder; nuScenes: a local copy of the `v1.0-*` tables), and each worker downloads only its
unit's files into its scratch directory (`open_unit`: bounded by the unit size) and runs the same readers and
checks on that copy, so a frame refused from a local copy is refused the same way from the bucket, with the
same `file` in rejected.jsonl. No layout is named here. Locations and credentials: `pfactory.storage.objects`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from pfactory.storage.objects import Location, is_url, scratch_dir

if TYPE_CHECKING:
    from pfactory.sensors.reader import RemoteListing


@dataclass
class RawSpec:
    """What a worker needs to open the raw data of its units (picklable)."""

    url: str  # local directory or URL of the dataset root
    layout: str  # the reader's name (`pfactory.datasets` entry point)
    dirs: list[str] = field(
        default_factory=list
    )  # over a URL: folders of a local copy (`RemoteListing.dirs`)
    shared: list[str] = field(
        default_factory=list
    )  # over a URL: files every unit needs (`RemoteListing.shared`)

    @property
    def remote(self) -> bool:
        return is_url(self.url)


class _Store:
    """`pfactory.sensors.reader.RemoteStore` over a `Location`: what the readers' `list_remote` may ask."""

    def __init__(self, loc: Location):
        self.loc = loc
        self.url = loc.url

    def top(self) -> list[str]:
        return [PurePosixPath(n).name for n in self.loc.fs.ls(self.loc.path(), detail=False)]

    def is_dir(self, rel: str) -> bool:
        return self.loc.is_dir(rel)

    def names(self, rel: str) -> list[str]:
        return self.loc.names(rel)

    def download(self, rels: list[str], dest: Path) -> None:
        if rels:
            self.loc.fs.get([self.loc.path(r) for r in rels], [str(dest / r) for r in rels])


class RawSource:
    """The raw dataset of a run, opened by the driver: layout, frame ids, tables digest, unit files.

    Local: the reader `open_dataset` finds. A URL: the first registered reader whose `list_remote` accepts
    the prefix (built-ins first, `pfactory.sensors.datasets.layouts`)."""

    def __init__(self, raw: str | os.PathLike[str]):
        from pfactory.prepare.stage import raw_origin
        from pfactory.sensors.digest import tables_digest
        from pfactory.sensors.errors import DatasetError

        self.url = os.fspath(raw)
        self.loc = Location(self.url)
        self.listing: RemoteListing | None = None
        if not self.loc.remote:
            from pfactory.sensors.datasets import open_dataset
            from pfactory.sensors.validate import dataset_frame_ids

            self.dataset: Any = open_dataset(Path(self.url))
            self.spec = RawSpec(self.loc.url, self.dataset.layout)
            self.frame_ids = dataset_frame_ids(self.dataset)
            self.tables = tables_digest(self.dataset)
            self.origin = raw_origin(raw, self.spec.layout)
            return
        if not self.loc.is_dir(""):
            raise DatasetError(self.url, "dataset root", "an existing prefix with objects under it")
        from pfactory.sensors.datasets import expected_layouts, layouts

        store = _Store(self.loc)
        found = layouts()
        for x in found:
            if x.reader is None:
                continue
            scratch = scratch_dir() / f"raw-driver-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                listing = x.reader.list_remote(store, scratch)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            if listing is None:
                shutil.rmtree(scratch, ignore_errors=True)
                continue
            self.listing = listing
            self.dataset = listing.reader
            self.spec = RawSpec(self.loc.url, x.name, list(listing.dirs), list(listing.shared))
            self.frame_ids = list(listing.frame_ids)
            self.tables = tables_digest(listing.reader) if listing.reader is not None else None
            self.origin = raw_origin(raw, x.name)
            return
        raise DatasetError(self.url, "layout", expected_layouts(found))

    def close(self) -> None:
        """Remove the driver's local copy of a remote dataset's shared files (nuScenes over a URL)."""
        if self.listing is not None and self.listing.scratch is not None:
            shutil.rmtree(self.listing.scratch, ignore_errors=True)

    def unit_files(self, ids: list[str]) -> list[str]:
        """Files (relative to the root) a worker downloads for frames `ids` ([] for a local dataset), as the
        reader lists them (`RemoteListing.unit_files`: KITTI every file of each part that names one of the
        frames, so duplicate names are caught as locally; nuScenes the files the frames' records name)."""
        if self.listing is None:
            return []
        return self.listing.unit_files(ids)


_DATASETS: dict[tuple[str, str], Any] = {}


@contextlib.contextmanager
def open_unit(spec: RawSpec, run_tag: str, unit: int, files: list[str]) -> Iterator[Any]:
    """The dataset a worker reads unit `unit` from: the local dataset (opened once per process and run); over
    a URL with shared files (nuScenes tables), a reader opened once per process and run over a scratch copy
    of them, the unit's `files` downloaded beside it and removed afterwards; over a URL without, a scratch
    copy of the unit's `files` and a fresh reader (removed afterwards)."""
    from pfactory.sensors.datasets import open_dataset

    loc = Location(spec.url)
    if not spec.remote or spec.shared:
        key = (spec.url, run_tag)
        if key not in _DATASETS:
            for old in _DATASETS.values():  # one run at a time per worker process keeps one dataset
                if spec.remote:
                    shutil.rmtree(old.root, ignore_errors=True)
            _DATASETS.clear()
            if spec.remote:
                root = scratch_dir() / f"raw-{run_tag}-{os.getpid()}"
                shutil.rmtree(root, ignore_errors=True)
                for d in spec.dirs:
                    (root / d).mkdir(parents=True, exist_ok=True)
                _Store(loc).download(spec.shared, root)
            else:
                root = Path(spec.url)
            _DATASETS[key] = open_dataset(root, layout=spec.layout)
        dataset = _DATASETS[key]
        if not spec.remote:
            yield dataset
            return
        # The shared files once per process and run, the unit's files beside them.
        found = loc.fs.cat([loc.path(f) for f in files], on_error="omit") if files else {}
        by_path = {loc.path(f): f for f in files}
        written = []
        try:
            for path, data in found.items():
                dest = dataset.root / by_path[path]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                written.append(dest)
            yield dataset
        finally:
            for p in written:
                p.unlink(missing_ok=True)
        return
    root = scratch_dir() / f"raw-{run_tag}-{unit:05d}-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    try:
        for d in spec.dirs:
            (root / d).mkdir(parents=True, exist_ok=True)
        _Store(loc).download(files, root)
        yield open_dataset(root, layout=spec.layout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
