"""The `prepare:` section of params.yaml: raw dataset -> training-ready Parquet shards (`pfactory.prepare.stage`).

`classes` and `pc_range` are declared here once: they travel in the prepared manifest, from which the
model takes them (`pfactory.train.data.data_info`), so the detector always matches its data.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pfactory.config.section import Fraction, PositiveInt, Section, check_address, check_pc_range

DEFAULT_CLASS_MAP: dict[str, str] = {
    # KITTI names
    "Car": "Car",
    "Pedestrian": "Pedestrian",
    "Cyclist": "Cyclist",
    # nuScenes category names
    "vehicle.car": "Car",
    "human.pedestrian.adult": "Pedestrian",
    "human.pedestrian.child": "Pedestrian",
    "human.pedestrian.construction_worker": "Pedestrian",
    "human.pedestrian.police_officer": "Pedestrian",
    "vehicle.bicycle": "Cyclist",
}


SCALE_OUT = ("dask_address", "workers", "threads_per_worker", "unit_frames")
"""PrepareParams fields that say where the work runs, not what it computes (not in the manifest)."""
NOT_IN_MANIFEST = (*SCALE_OUT, "plugins")
"""... and the installed dataset plugins' records (`plugins`): a DVC param, so another version recomputes; the
manifest records the one that read the data (`source.plugin`), not every one installed."""

# Model input side, pixels: a prepared frame holds a float16 C x H x W image per camera; 4096 x 4096 x 3 is
# 100 MB per camera already (the default is 416 x 128). [100000, 100000] would be 60 GB a frame.
MAX_IMAGE_SIDE = 4096


class PrepareParams(Section):
    """Raw dataset -> training-ready Parquet shards (`factory prepare`)."""

    classes: list[str] = Field(default_factory=lambda: ["Car", "Pedestrian", "Cyclist"])
    """Training classes, in label-index order."""
    class_map: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_CLASS_MAP))
    """Dataset class name -> training class. Names not listed keep label -1 (kept, not trained on)."""
    pc_range: list[float] = Field(default_factory=lambda: [0.0, -40.0, -3.0, 70.4, 40.0, 1.0])
    """Lidar region of interest (x_min, y_min, z_min, x_max, y_max, z_max), metres, lidar frame."""
    reference_frame: Literal["ego_axes", "lidar"] = "ego_axes"
    """Frame of the prepared points/boxes: `ego_axes` = the lidar frame rotated onto the ego
    vehicle's axes (x forward, y left, z up; origin kept at the lidar; nuScenes' LIDAR_TOP is
    mounted x-right, KITTI's velodyne is already aligned), or `lidar` = the raw sensor frame."""
    min_points: Annotated[int, Field(ge=1)] = 100
    """Frames whose sweep has fewer points are refused (a stub or a broken dump, not a scan)."""
    ego_radius_m: Annotated[float, Field(ge=0)] = 2.0
    """Points closer than this to the sensor in BEV are ego-vehicle returns and removed."""
    voxel_size: list[float] | None = Field(default_factory=lambda: [0.1, 0.1, 0.1])
    """Voxel down-sampling (dx, dy, dz) metres: one point per occupied voxel; null keeps every point.
    The default 0.1 m removes ~60% of a synthetic sweep (mostly near-range ground) and keeps every far
    point: training fits the 4-minute CPU budget (docs/MODEL.md, "Sizing for 2 CPU cores")."""
    image_size: list[int] = Field(default_factory=lambda: [416, 128])
    """Model input (width, height): images are resized with aspect kept, then padded."""
    image_mean: list[float] = Field(default_factory=lambda: [0.485, 0.456, 0.406])
    image_std: list[float] = Field(default_factory=lambda: [0.229, 0.224, 0.225])
    val_fraction: Fraction = 0.2
    """Share of frames in the val split, chosen by a hash of the frame id (deterministic)."""
    shard_max_frames: PositiveInt = 64
    max_reject_fraction: Fraction = 0.1
    """The stage fails when more than this share of frames is refused."""
    batch_size: PositiveInt = 16
    num_threads: PositiveInt = 2
    """DALI and read threads of a run in one process (on Dask: `threads_per_worker`)."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    # Scale-out (docs/DATA.md, "Preparing on a Dask cluster"). None of these changes a byte of the output,
    # so they are left out of the manifest's params (SCALE_OUT): 1 worker and N workers write the same files.
    dask_address: str | None = None
    """Scheduler address (`tcp://host:8786`) of an existing Dask cluster, or `local:N` for a LocalCluster of
    N workers (even when Dask's config names a scheduler); null = Dask's own `scheduler-address` when set
    (`DASK_SCHEDULER_ADDRESS`, Dask's YAML config), else this process (today's single-machine path) when
    `workers` is 1, else a LocalCluster of `workers`. Remote workers must reach the raw data and the output
    (object storage, or the same paths)."""
    workers: PositiveInt = 1
    """LocalCluster worker processes when `dask_address` is null (1 = no cluster: prepare in this process)."""
    threads_per_worker: PositiveInt = 1
    """Dask threads per worker = DALI + read threads of each work unit on it."""
    unit_frames: PositiveInt = 16
    """A work unit: this many consecutive frame ids (never one frame). 16 frames = one DALI batch, ~0.5-1 s
    on one core for the default sizes, against Dask's ~1 ms per task; memory per worker is bounded by it."""
    plugins: list[dict[str, Any]] | None = None
    """The installed dataset-layout plugins (entry-point group `pfactory.datasets`; distribution, version, files
    sha256 each), pinned by the factory like `model.plugin`: a root is offered to every installed reader, so
    any of them may read the data, and DVC's run-cache must never restore shards another version prepared.
    `factory run` writes them into each run's params.yaml; a stage whose params pin other records refuses to
    run (exit 2, one line). Built-in layouts are none of them: their code is a DVC dependency (dvc.yaml)."""

    def after_validation(self, source: str, pin: bool = False) -> None:
        """`pfactory.config.params_file.validate`'s hook: record (`pin`) or verify the installed dataset plugins."""
        from pfactory.config import plugins as pl

        installed = [pi.record() for pi in pl.entries(pl.DATASETS).values() if not pi.builtin]
        if pin or self.plugins is None:
            self.plugins = installed
        elif self.plugins != installed:
            was = ", ".join(f"{p.get('name')} ({p.get('source')})" for p in self.plugins) or "none"
            now = ", ".join(f"{p['name']} ({p['source']})" for p in installed) or "none"
            raise pl.PluginError(
                f"{source}: prepare.plugins pins the dataset plugins {was}, but installed are {now} (or their files "
                "changed): run it again with `factory run` (it pins the installed ones) or set prepare.plugins: null"
            )

    @field_validator("dask_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return check_address(v)

    @field_validator("pc_range")
    @classmethod
    def _range(cls, v: list[float]) -> list[float]:
        return check_pc_range(v)

    @field_validator("image_size")
    @classmethod
    def _size(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or min(v) < 8 or max(v) > MAX_IMAGE_SIDE:
            raise ValueError(f"(width, height), each 8..{MAX_IMAGE_SIDE} pixels")
        return v

    @field_validator("voxel_size")
    @classmethod
    def _voxel(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (len(v) != 3 or min(v) <= 0):
            raise ValueError("null or three positive sizes (dx, dy, dz) in metres")
        return v

    @model_validator(mode="after")
    def _classes(self) -> PrepareParams:
        unknown = sorted({c for c in self.class_map.values() if c not in self.classes})
        if unknown:
            raise ValueError(f"class_map targets {unknown} are not in classes {self.classes}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("image_mean and image_std need 3 values each, std > 0")
        return self
