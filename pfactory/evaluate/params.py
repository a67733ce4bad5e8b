"""Parameters of the evaluate stage (`params.evaluate`): where it runs, how work is cut, how it scores.

In: the `evaluate:` section of `params.yaml` (hooked into `flows.params.Params` as `evaluate`).
Out: a validated pydantic model; unknown keys are refused, every field documented. docs/EVALUATE.md
says why the defaults are what they are.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

from pydantic import Field, field_validator

from pfactory.config.section import NonNegInt, PositiveInt, check_address
from pfactory.metrics.cut import DetectionCut


class EvaluateParams(DetectionCut):
    """The `evaluate:` section (its `score_threshold`: `pfactory.metrics.cut`, the part other stages read)."""

    split: str = "val"
    """Split of the prepared data to evaluate (a key of its manifest's `splits`)."""
    backend: Literal["auto", "onnxruntime", "tensorrt"] = "auto"
    """Artifact of the optimized directory to run: auto = TensorRT on a GPU worker when built, else ORT."""
    precision: Literal["fp32", "fp16", "int8"] | None = None
    """Precision of that artifact; null = the optimized directory's primary (backend.json)."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Where workers run the models. cpu by default: a LocalCluster's workers share one machine, and
    several processes on one GPU gain nothing; set auto/cuda for a cluster of GPU workers."""
    dask_address: str | None = None
    """Scheduler address (`tcp://host:8786`) of an existing Dask cluster, or `local:N` for a LocalCluster
    of N workers (even when Dask's config names a scheduler); null = Dask's own `scheduler-address` when set
    (`DASK_SCHEDULER_ADDRESS`, Dask's YAML config), else a LocalCluster of `workers`. Remote workers must see
    the same paths."""
    workers: PositiveInt = 2
    """LocalCluster worker processes (one per core is the CPU default: docs/EVALUATE.md)."""
    threads_per_worker: PositiveInt = 1
    """Dask threads per worker = ONNX Runtime / PyTorch intra-op threads of its model."""
    slice_frames: PositiveInt = 16
    """A work unit: whole row groups of one shard, up to this many frames (at least one row group).
    16 = prepare.batch_size, one row group: ~0.5-1 s of work per task against ~1 ms of Dask overhead."""
    batch_size: PositiveInt = 4
    """Frames per inference call inside a task (ORT's CPU throughput at batch 4 beats batch 1)."""
    reference: bool = True
    """Also evaluate the PyTorch checkpoint (when a model directory is given) and report the KPI delta."""
    range_edges_m: list[float] = Field(default_factory=lambda: [0.0, 20.0, 40.0])
    """Range buckets from the sensor (BEV metres): [0, 20), [20, 40), [40, inf) by default."""
    frame_score_threshold: Annotated[float, Field(ge=0)] = 0.3
    """Per-frame TP/FP/FN counts, the error breakdown and the worst frames use predictions scoring at least this."""
    worst_frames: NonNegInt = 6
    """The run report draws this many frames with the most errors (non-tp detections + missed GT), camera + BEV."""

    @field_validator("range_edges_m")
    @classmethod
    def _edges(cls, v: list[float]) -> list[float]:
        if (
            not v
            or v[0] != 0
            or any(b <= a for a, b in itertools.pairwise(v))
            or not all(map(math.isfinite, v))
        ):
            raise ValueError("finite, strictly increasing bucket edges starting at 0 (e.g. [0, 20, 40])")
        return v

    @field_validator("dask_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return check_address(v)

    @property
    def range_buckets_m(self) -> tuple[tuple[float, float], ...]:
        """`range_edges_m` as `[lo, hi)` buckets, the last one open (`KpiParams.range_buckets_m`)."""
        edges = [*self.range_edges_m, math.inf]
        return tuple(itertools.pairwise(edges))
