"""The base of every `params.yaml` section, and validators more than one section shares.

Each stage keeps its section's model beside its code (`pfactory/model/params.py`, ...), and
`pfactory/config.py` assembles the whole file from them; they all derive from `Section` here, so this
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
