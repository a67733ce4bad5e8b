"""The base of every `params.yaml` section, and validators more than one section shares.

Each stage keeps its section's model beside its code (`pfactory/archs/painted_pillars/params.py`, ...), and
`flows/params.py` assembles the whole file from them; they all derive from `Section` here, so this
module imports nothing of pfactory (no import cycle with config.py).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Value types the sections share.
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]

# Thread / worker / process counts: every field whose name ends in `threads` or `workers`. DALI aborts the
# whole process (SIGABRT, no message) on prepare.num_threads=100000; no machine this runs on has more than
# a few hundred cores.
MAX_PARALLEL = 256


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are validated on assignment, floats are
    finite (`.inf` / `.nan` are refused: `train.lr=.inf` trained to NaN weights), and thread/worker
    counts are at most `MAX_PARALLEL`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _parallel_bound(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if name.endswith(("threads", "workers")) and isinstance(v, int) and v > MAX_PARALLEL:
            raise ValueError(f"at most {MAX_PARALLEL} (a thread/worker count)")
        return v


class PillarGrid:
    """The BEV grids of a pillar architecture's params: a mixin for any object with `pc_range` (x_min, y_min,
    z_min, x_max, y_max, z_max, metres, lidar frame), `pillar_size_m` and `head_stride` (the default's
    `ModelParams`, centerpoint_lidar's `Geometry`)."""

    pc_range: Any
    pillar_size_m: float
    head_stride: int

    @property
    def grid(self) -> tuple[int, int]:
        """Pillar grid (H rows along y, W columns along x)."""
        x0, y0, _, x1, y1, _ = self.pc_range
        return round((y1 - y0) / self.pillar_size_m), round((x1 - x0) / self.pillar_size_m)

    @property
    def head_grid(self) -> tuple[int, int]:
        """Head grid (H rows along y, W columns along x)."""
        h, w = self.grid
        return h // self.head_stride, w // self.head_stride

    @property
    def head_cell_m(self) -> float:
        """Side of a head cell, metres."""
        return self.pillar_size_m * self.head_stride


def pillar_misfit(pc_range: Any, pillar_size_m: float) -> tuple[str, float] | None:
    """None when the (x, y) extents of `pc_range` are whole multiples of `pillar_size_m`; else the axis
    ("x" or "y") that is not and its extent in pillars."""
    for i, name in ((0, "x"), (1, "y")):
        cells = (pc_range[i + 3] - pc_range[i]) / pillar_size_m
        if abs(cells - round(cells)) > 1e-4:
            return name, cells
    return None


def check_pc_range(v: list[float]) -> list[float]:
    """A point-cloud range `(x_min, y_min, z_min, x_max, y_max, z_max)` with each min < max, metres."""
    if len(v) != 6 or not all(v[i] < v[i + 3] for i in range(3)):
        raise ValueError("6 numbers (x_min, y_min, z_min, x_max, y_max, z_max) with each min < max")
    return v


S = TypeVar("S", bound=Section)


def section_of(params: Any, name: str, cls: type[S]) -> S:
    """The `name` section of the full project `Params`, or a `cls` given directly (stage `run` functions)."""
    if isinstance(params, cls):
        return params
    section = getattr(params, name, None)
    if not isinstance(section, cls):
        article = "an" if name[0] in "aeiou" else "a"
        raise TypeError(
            f"run() needs the project Params (with {article} `{name}` section) or {article} {cls.__name__}"
        )
    return section


def check_address(v: str | None) -> str | None:
    """Validator of a `dask_address` params value: null, `local:N` (N >= 1) or a scheduler address."""
    if v is not None and v.startswith("local:"):
        n = v.removeprefix("local:")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"'local:N' with N >= 1 workers, got {v!r}")
    return v


class SectionView(Section):
    """The part of another stage's section that a stage reads (train and optimize read `evaluate`'s
    `score_threshold`). The home section's class derives from the view, so each field is declared once, in
    one section; a stage whose params hold the view validates only the view's keys of that section and leaves
    the rest of it to its own stage (`pfactory.config.params_file.load_sections`)."""


def is_view(cls: type) -> bool:
    """True for a view class itself (a direct subclass of `SectionView`), not for the home section deriving
    from it."""
    return SectionView in cls.__bases__
