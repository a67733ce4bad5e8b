"""The raw dataset of a prepare run, local or on object storage: layout, frame ids, each unit's files.

A local directory is read in place (Dask workers need the same path). A URL (`s3://bucket/prefix`) is listed
once by the driver (`RawSource`; KITTI: the names in each part folder; nuScenes: a local copy of the
`v1.0-*` tables), and each worker downloads only its unit's files into its scratch directory
(`open_unit`: bounded by the unit size) and runs the same readers and checks on that copy, so a frame
refused from a local copy is refused the same way from the bucket, with the same `file` in rejected.jsonl.
Locations and credentials: `pfactory.data.storage`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pfactory.data.storage import Location, is_url, scratch_dir


@dataclass
class RawSpec:
    """What a worker needs to open the raw data of its units (picklable)."""

    url: str  # local directory or URL of the dataset root
    layout: str  # "kitti" | "nuscenes"
    split_rel: str = ""  # KITTI: the folder holding the parts ("training" or ""); nuScenes: the v1.0-* folder
    dirs: list[str] = field(default_factory=list)  # KITTI over a URL: part folders that exist

    @property
    def remote(self) -> bool:
        return is_url(self.url)


class RawSource:
    """The raw dataset of a run, opened by the driver: layout, frame ids, tables digest, unit files."""

    def __init__(self, raw: str | os.PathLike[str]):
        from pfactory.sensors.errors import DatasetError

        self.url = os.fspath(raw)
        self.loc = Location(self.url)
        self._names: dict[str, list[str]] = {}
        self._index: dict[str, dict[str, list[str]]] = {}
        if not self.loc.remote:
            from pfactory.data.prepare import tables_digest
            from pfactory.sensors.datasets import open_dataset
            from pfactory.sensors.validate import dataset_frame_ids

            self.dataset = open_dataset(Path(self.url))
            self.spec = RawSpec(self.loc.url, self.dataset.layout)
            self.frame_ids = dataset_frame_ids(self.dataset)
            self.tables = tables_digest(self.dataset)
            return
        if not self.loc.is_dir(""):
            raise DatasetError(self.url, "dataset root", "an existing prefix with objects under it")
        top = [PurePosixPath(n).name for n in self.loc.fs.ls(self.loc.path(), detail=False)]
        versions = sorted(n for n in top if n.startswith("v1.0-") and self.loc.is_dir(n))
        if "samples" in top and versions:
            self._open_remote_nuscenes(versions[0])
        else:
            self._open_remote_kitti()

    @property
    def layout(self) -> str:
        return self.spec.layout

    def close(self) -> None:
        """Remove the driver's local copy of a remote dataset's tables (nuScenes over a URL)."""
        if self.loc.remote and self.spec.layout == "nuscenes":
            shutil.rmtree(self.dataset.root, ignore_errors=True)

    def _open_remote_kitti(self) -> None:
        from pfactory.sensors.errors import DatasetError
        from pfactory.sensors.kitti import KITTI_PARTS, kitti_ids_from_names, kitti_names_index

        for cand in ("training", ""):
            pre = f"{cand}/" if cand else ""
            if all(self.loc.is_dir(f"{pre}{p}") for p in ("velodyne", "calib", "image_2")):
                split = cand
                break
        else:
            raise DatasetError(
                self.url,
                "layout",
                "a KITTI object layout (training/velodyne, image_2, calib, label_2) "
                "or a nuScenes layout (samples/ and a v1.0-* table folder)",
            )
        pre = f"{split}/" if split else ""
        self._names = {p: self.loc.names(f"{pre}{p}") for p in KITTI_PARTS}
        self._index = kitti_names_index(self._names)
        dirs = [f"{pre}{p}" for p in KITTI_PARTS if self.loc.is_dir(f"{pre}{p}")]
        self.spec = RawSpec(self.loc.url, "kitti", split, dirs)
        self.frame_ids = kitti_ids_from_names(self._names)
        self.tables = None

    def _open_remote_nuscenes(self, version: str) -> None:
        from pfactory.data.prepare import tables_digest

        self.dataset = _remote_tables(self.loc, version, f"driver-{os.getpid()}-{os.urandom(4).hex()}")
        self.spec = RawSpec(self.loc.url, "nuscenes", version)
        self.frame_ids = self.dataset.check_ids()
        self.tables = tables_digest(self.dataset)

    def unit_files(self, ids: list[str]) -> list[str]:
        """Files (relative to the root) a worker downloads for frames `ids` ([] for a local dataset).
        KITTI: every file of each part that names one of the frames, so duplicate names are caught as
        locally; nuScenes: the files the frames' sample_data records name (those inside the root)."""
        if not self.loc.remote:
            return []
        if self.spec.layout == "nuscenes":
            from pfactory.sensors.errors import DatasetError

            names: set[str] = set()
            for fid in ids:
                for sd in self.dataset.sample_data(fid).values():
                    try:
                        p = self.dataset.resolve(sd.get("filename"), "filename")
                    except DatasetError:  # refused by the frame's checks, as locally
                        continue
                    names.add(p.relative_to(self.dataset.root).as_posix())
            return sorted(names)
        from pfactory.sensors.kitti import _kitti_key

        pre = f"{self.spec.split_rel}/" if self.spec.split_rel else ""
        out: set[str] = set()
        for fid in ids:
            key = _kitti_key(fid)
            for part, by_key in self._index.items():
                out.update(f"{pre}{part}/{n}" for n in by_key.get(key, []))
        return sorted(out)


_DATASETS: dict[tuple[str, str], Any] = {}


def _remote_tables(loc: Location, version: str, tag: str) -> Any:
    """A nuScenes dataset over a local copy of `loc`'s tables (`version/*.json`) and an empty samples/."""
    from pfactory.sensors.nuscenes import NuScenesDataset

    root = scratch_dir() / f"nuscenes-{tag}"
    shutil.rmtree(root, ignore_errors=True)
    (root / "samples").mkdir(parents=True)
    (root / version).mkdir()
    tables = [f"{version}/{n}" for n in loc.names(version) if n.endswith(".json")]
    loc.fs.get([loc.path(t) for t in tables], [str(root / t) for t in tables])
    return NuScenesDataset(root, version)


@contextlib.contextmanager
def open_unit(spec: RawSpec, run_tag: str, unit: int, files: list[str]) -> Iterator[Any]:
    """The dataset a worker reads unit `unit` from: the local dataset (opened once per process and run), or
    a scratch copy of the unit's `files` from the URL (removed afterwards)."""
    from pfactory.sensors.datasets import open_dataset

    loc = Location(spec.url)
    if not spec.remote or spec.layout == "nuscenes":
        key = (spec.url, run_tag)
        if key not in _DATASETS:
            for old in _DATASETS.values():  # one run at a time per worker process keeps one dataset
                if spec.remote:
                    shutil.rmtree(old.root, ignore_errors=True)
            _DATASETS.clear()
            _DATASETS[key] = (
                open_dataset(Path(spec.url))
                if not spec.remote
                else _remote_tables(loc, spec.split_rel, f"{run_tag}-{os.getpid()}")
            )
        dataset = _DATASETS[key]
        if not spec.remote:
            yield dataset
            return
        # nuScenes over a URL: the tables once per process and run, the unit's files beside them.
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
        if files:
            loc.fs.get([loc.path(f) for f in files], [str(root / f) for f in files])
        yield open_dataset(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
