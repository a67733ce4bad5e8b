"""The detector contract: all that the factory knows of an architecture (DESIGN.md §5b, docs/MODELS.md).

An architecture is an `Architecture` object, found by name through the entry-point group `pfactory.models`
(`pfactory.detectors.registry`). It brings:
- `params`: its params schema, a `pfactory.config.section.Section` (pydantic; unknown keys are refused, naming the
  key). Its defaults are the architecture's defaults: it runs with nothing in params.yaml. The user sets
  values under `model.<name>` in params.yaml or with `-S model.<name>.key=value`.
- `build(params, data)`: a detector (an `nn.Module`, below) for those params and the prepared data's
  `DataSpec` (classes, point-cloud range, image size, cameras: facts of the data, never set twice).

A built detector offers (checked by `check_detector` when it is built, one line naming what is missing):
    inputs         tuple of prepared batch fields `forward` takes, in order (subset of `BATCH_FIELDS`)
    deploy_inputs  tuple of the deployed graph's inputs, in order (subset of `DEPLOY_INPUTS`)
    spec           the `DataSpec` it was built for
    params         its validated params (what `model_config.json` stores)
    max_detections D, the fixed number of decoded entries per frame
    forward(*inputs) -> outputs       raw outputs, any structure: what training, DDP and torch.compile run
    loss(outputs, batch, ctx) -> {"loss": [] total, <term>: [] ...}   the training loss of a batch slice
    decode(outputs) -> Detections     boxes [B, D, 7], scores [B, D], labels [B, D] (lidar frame)
    forward_export(*deploy_inputs) -> (boxes, scores, labels)         the deployable forward: plain tensor
                   ops from padded sensor inputs to decoded boxes, what the optimize stage exports
`deploy_inputs` is a prefix of `DEPLOY_INPUTS`: (points, num_points) for a lidar-only model, all four for a
camera model. Optional hooks: `for_export()` -> a copy in the export's formulation (default: the detector
itself), `for_compile()` -> converts in place for torch.compile (default: nothing), `int8_float_modules`
-> a tuple of module paths (fnmatch patterns; a module covers its children) that INT8 never quantizes,
for layers whose inputs are too fine for 8 bits (centimetre-scale point moments), added to
`optimize.int8.exclude_nodes` (`int8_float_modules(model)`; default: none). Custom ops a detector
brings are registered by its own modules when `build` imports them (`torch.library`); under ONNX export
they must decompose to standard ops, as the factory's kernels do (DESIGN.md §6).

Detections: the one output every later stage uses. `D` is fixed (static graph); an entry with score 0 is
padding; scores are in [0, 1], descending per frame; boxes are (x, y, z, l, w, h, yaw) in the lidar frame
(x forward, y left, z up, metres; z at the box centre, yaw about +z); labels index `spec.classes`.
This module imports no torch at import time (the registry lists architectures without it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor, nn

    from pfactory.config.section import Section

# Prepared batch fields (pfactory.prepare.loader): lidar frame, padded.
#   points [B, P, 4] float32 (x, y, z, intensity); num_points [B] int64; images [B, N, 3, H, W] float32
#   (normalized); proj [B, N, 3, 4] float32 (lidar -> model-input pixels); cam_valid [B, N] bool.
BATCH_FIELDS = ("points", "num_points", "images", "proj", "cam_valid")
# Inputs a deployed graph may take (every camera valid there), and its outputs.
DEPLOY_INPUTS = ("points", "num_points", "images", "proj")
OUTPUT_NAMES = ("boxes", "scores", "labels")
# Facts of the prepared data an architecture's section must not set (they come from `DataSpec`).
DATA_KEYS = ("classes", "pc_range")


class ContractError(TypeError):
    """A detector or architecture that does not satisfy the contract (the message names what is missing)."""


@dataclass(frozen=True)
class DataSpec:
    """What the prepared data fixes for a detector (from its manifest; `pfactory.train.data.DataInfo`)."""

    classes: tuple[str, ...]
    pc_range: tuple[float, float, float, float, float, float]  # x_min, y_min, z_min, x_max, y_max, z_max (m)
    image_size: tuple[int, int] = (416, 128)  # (W, H) of the model-input images
    cameras: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"classes": list(self.classes), "pc_range": list(self.pc_range),
                "image_size": list(self.image_size), "cameras": list(self.cameras)}  # fmt: skip


class Detections(NamedTuple):
    """Decoded detections of a batch (module docstring)."""

    boxes: Tensor  # [B, D, 7] float
    scores: Tensor  # [B, D] float
    labels: Tensor  # [B, D] int64


@dataclass(frozen=True)
class LossContext:
    """What a loss needs from the trainer. Under DDP each process holds a slice of the global batch:
    `all_reduce_sum(t)` sums a tensor over processes (identity in one process), for normalizers that make
    the loss independent of the process count; `world_size` the number of processes. `loss_autocast` is the
    trainer's autocast state (the loss runs under it; compute what must stay fp32 in fp32)."""

    all_reduce_sum: Callable[[Tensor], Tensor]
    world_size: int = 1
    loss_autocast: bool = False


@dataclass(frozen=True)
class Architecture:
    """An architecture, as its entry point names it (module docstring)."""

    params: type[Section]
    build: Callable[[Any, DataSpec], nn.Module]
    description: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # free-form notes (`factory models --verbose`)


_REQUIRED = (
    "inputs", "deploy_inputs", "spec", "params", "max_detections", "forward", "loss", "decode", "forward_export",
)  # fmt: skip


def check_architecture(obj: Any) -> Architecture:
    """`obj` if it is an `Architecture` with a params schema and a build callable; ContractError naming
    what is wrong otherwise."""
    from pydantic import BaseModel

    if not isinstance(obj, Architecture):
        missing = [a for a in ("params", "build") if not hasattr(obj, a)]
        if missing or not callable(getattr(obj, "build", None)):
            raise ContractError(
                f"is a {type(obj).__name__}, not a pfactory.detectors.contract.Architecture "
                f"(missing: {', '.join(missing) or 'a callable build'})"
            )
        obj = Architecture(obj.params, obj.build, getattr(obj, "description", ""))
    if not (isinstance(obj.params, type) and issubclass(obj.params, BaseModel)):
        raise ContractError(f"params must be a pydantic model class (a pfactory Section), got {obj.params!r}")
    clash = [k for k in DATA_KEYS if k in obj.params.model_fields]
    if clash:
        raise ContractError(
            f"params declares {clash}: those are facts of the prepared data, given to build() in DataSpec"
        )
    if not callable(obj.build):
        raise ContractError("build is not callable")
    return obj


def check_detector(model: Any) -> None:
    """ContractError naming the first missing or wrong part of a built detector (module docstring)."""
    missing = [a for a in _REQUIRED if not hasattr(model, a)]
    if missing:
        raise ContractError(f"the built detector ({type(model).__name__}) lacks {', '.join(missing)}")
    for attr, allowed in (("inputs", BATCH_FIELDS), ("deploy_inputs", DEPLOY_INPUTS)):
        value = tuple(getattr(model, attr))
        bad = [v for v in value if v not in allowed]
        if not value or bad or len(set(value)) != len(value):
            raise ContractError(
                f"{type(model).__name__}.{attr} = {value}: expected distinct names of {allowed} (got {bad})"
            )
    deploy = tuple(model.deploy_inputs)
    if len(deploy) < 2 or deploy != DEPLOY_INPUTS[: len(deploy)]:
        raise ContractError(
            f"{type(model).__name__}.deploy_inputs = {deploy}: expected a prefix of {DEPLOY_INPUTS} "
            "(points, num_points [, images, proj])"
        )
    if not isinstance(model.max_detections, int) or model.max_detections < 1:
        raise ContractError(f"{type(model).__name__}.max_detections must be a positive int")
    if not isinstance(model.spec, DataSpec):
        raise ContractError(f"{type(model).__name__}.spec is a {type(model.spec).__name__}, expected a DataSpec")
    for method in ("forward", "loss", "decode", "forward_export"):
        if not callable(getattr(model, method)):
            raise ContractError(f"{type(model).__name__}.{method} is not callable")
    int8_float_modules(model)


def for_export(model: nn.Module) -> nn.Module:
    """The detector in its export formulation: its `for_export()` hook, or itself."""
    hook = getattr(model, "for_export", None)
    return hook() if callable(hook) else model


def for_compile(model: nn.Module) -> nn.Module:
    """Convert the detector in place for torch.compile (its `for_compile()` hook, if any); returns it."""
    hook = getattr(model, "for_compile", None)
    if callable(hook):
        hook()
    return model


def int8_float_modules(model: Any) -> tuple[str, ...]:
    """The detector's `int8_float_modules` (module docstring); ContractError when it is not strings."""
    value = getattr(model, "int8_float_modules", ())
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ContractError(
            f"{type(model).__name__}.int8_float_modules must be a tuple of module paths, got {value!r}"
        )
    return tuple(value)


def batch_inputs(model: Any, batch: Mapping[str, Any]) -> list[Any]:
    """The values of `model.inputs` from a batch (a field the batch lacks is None)."""
    return [batch.get(k) for k in model.inputs]
