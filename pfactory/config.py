"""Typed pipeline parameters: `params.yaml` (one section per stage, plus `paths`) and overrides.

`load_params(path, overrides)` reads the YAML, applies DVC-style overrides
(`-S section.key=value`, value parsed as YAML, optional `params.yaml:` prefix) and validates
it against `Params`. Unknown keys and bad values are refused with a message that names the
key and what was expected. The defaults of `Params` are the embedded defaults: a missing
`params.yaml` gives the same pipeline as the shipped one (a test keeps the two equal).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pfactory.section import Section, check_pc_range

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class ParamsError(ValueError):
    """A parameter file or override is invalid; the message names the key and the expectation."""


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


class DataParams(Section):
    """The synthetic source dataset (`factory data synth`)."""

    name: str = "synth"
    frames: PositiveInt = 250
    """Frames to generate; with val_fraction 0.2 this leaves ~200 for training."""
    seed: int = 0
    cameras: Annotated[int, Field(ge=1, le=6)] = 1
    """1 writes the KITTI layout; >1 writes the nuScenes layout with this many cameras."""
    workers: PositiveInt = 2


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
    device: Literal["auto", "cpu", "gpu"] = "auto"

    @field_validator("pc_range")
    @classmethod
    def _range(cls, v: list[float]) -> list[float]:
        return check_pc_range(v)

    @field_validator("image_size")
    @classmethod
    def _size(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or min(v) < 8:
            raise ValueError("(width, height), each >= 8 pixels")
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


# Each stage owns its section's model beside its code; the whole file is assembled here.
from pfactory.evaluate.params import EvaluateParams  # noqa: E402
from pfactory.inference.params import OptimizeParams  # noqa: E402
from pfactory.model.params import ModelParams, TrainParams  # noqa: E402
from pfactory.registry.params import PromoteParams  # noqa: E402


class Params(Section):
    """The whole `params.yaml`."""

    paths: PathsParams = Field(default_factory=PathsParams)
    data: DataParams = Field(default_factory=DataParams)
    prepare: PrepareParams = Field(default_factory=PrepareParams)
    model: ModelParams = Field(default_factory=ModelParams)
    train: TrainParams = Field(default_factory=TrainParams)
    optimize: OptimizeParams = Field(default_factory=OptimizeParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    promote: PromoteParams = Field(default_factory=PromoteParams)


def _format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a parameter of this section)"
        else:
            msg = "expected " + err["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
        got = err.get("input")
        got_s = "" if err["type"] == "missing" or isinstance(got, dict) else f", got {got!r}"
        lines.append(f"{source}: {key}: {msg}{got_s}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[str, Any]:
    """`[params.yaml:]section.key=value` -> ("section.key", parsed YAML value)."""
    spec = text
    if ":" in spec.split("=", 1)[0]:
        fname, spec = spec.split(":", 1)
        if Path(fname).name != "params.yaml":
            raise ParamsError(f"override {text!r}: only params.yaml is supported, got {fname!r}")
    key, sep, value = spec.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParamsError(f"override {text!r}: expected section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ParamsError(f"override {text!r}: value is not valid YAML ({e})") from e
    return key, parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `section.key=value` override applied."""
    out = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ParamsError(f"override {text!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read, override and validate `params.yaml`; a missing file means the embedded defaults."""
    raw: dict[str, Any] = {}
    source = "params.yaml (embedded defaults)"
    if path is not None and Path(path).is_file():
        source = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ParamsError(f"{path}: not valid YAML ({e})") from e
        if not isinstance(raw, dict):
            raise ParamsError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_validation_error(e, source)) from None


def params_to_yaml(params: Params) -> str:
    """The resolved params as YAML (what a stage records and `factory params` shows)."""
    return yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False)
