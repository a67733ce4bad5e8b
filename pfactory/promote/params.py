"""Parameters of the promote stage (`params.promote`): registry names and the promotion gates.

In: the `promote:` section of `params.yaml` (hooked into `flows.params.Params` as `promote`).
Out: a validated pydantic model; unknown keys are refused (`extra="forbid"`), every field documented.

Gate semantics (docs/PROMOTE.md, "Gates"): a margin is `threshold - value` for an upper bound and
`value - threshold` for a lower bound, so a negative margin is "failed by this much".
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from pfactory.config.section import NonNegFloat, PositiveFloat, Section


class PromoteParams(Section):
    """Candidate -> `champion`, only through the gates (DESIGN.md §9)."""

    model_name: str = "pfactory-detector"
    """Registered model name in the MLflow model registry."""
    alias: str = "champion"
    """The alias that marks the production model (`models:/<model_name>@<alias>`)."""
    min_map: Annotated[float, Field(ge=0, le=1)] = 0.3
    """Absolute gate: candidate mAP on the evaluation data must be at least this. The default
    pipeline reaches ~0.7 (docs/MODEL.md); a model trained a few steps scores ~0."""
    max_map_regression: NonNegFloat = 0.0
    """vs champion: candidate mAP may be at most this much below the champion's (0: never worse)."""
    max_class_ap_regression: NonNegFloat = 0.05
    """vs champion: per class, the AP (mean over distance thresholds) may drop at most this much (absolute)."""
    max_p99_latency_ms: PositiveFloat = 500.0
    """Absolute gate: p99 latency at batch 1 of the primary artifact (`optimized/latency.json`). INT8 ORT
    measured p99 ~82 ms on 2 shared cores (docs/OPTIMIZE.md); the bound catches a several-fold regression."""
    latency_batch: Annotated[int, Field(gt=0)] = 1
    """Batch size whose p99 the latency gate reads (`batch_<n>` of latency.json), and the batch of the
    side-by-side measurement against the champion."""
    max_latency_ratio: Annotated[float, Field(ge=1)] = 1.3
    """vs champion: the candidate's p50 at most this many times the champion's, both artifacts timed side
    by side in the promoting process, interleaved call by call (`inference.latency.compare_directories`)."""
    max_p99_latency_ratio: Annotated[float, Field(ge=1)] = 1.5
    """vs champion: the same for p99 (a tail estimate over `latency_iterations` calls: wider)."""
    latency_iterations: Annotated[int, Field(ge=5)] = 30
    """Timed calls per artifact of the side-by-side measurement (after `latency_warmup` untimed ones). A
    measurement over a ratio limit is repeated once and the gate reads the smaller ratio of the two: a
    slower candidate is slower twice, a burst of load from another process rarely is."""
    latency_warmup: Annotated[int, Field(ge=0)] = 3
    """Untimed calls per artifact before the side-by-side timing."""
    latency_frames: Annotated[int, Field(gt=0)] = 4
    """Frames of the candidate's evaluation split (`--data`) the side-by-side timing cycles through."""
    require_parity: bool = True
    """Absolute gate: the optimize stage's parity verdict (`optimized/parity.json` "passed") must be true."""
    parity_map_tolerance: NonNegFloat = 0.005
    """Absolute gate: |mAP(optimized) - mAP(PyTorch)| (`kpis.json` "delta"."mAP", the evaluate stage on
    the same frames) at most this: 0.5 points. Was 0.03 (3 points: wide enough for any INT8 artifact)."""
    parity_class_ap_tolerance: NonNegFloat = 0.01
    """Absolute gate, per class: |AP@`parity_class_ap_distance_m`(optimized) - AP(PyTorch)| at most this
    (`kpis.json` "delta"."classes"."<C>"."ap"): 1 point."""
    parity_class_aoe_tolerance: NonNegFloat = 0.25
    """Absolute gate, per class: AOE(optimized) - AOE(PyTorch) (rad, `kpis.json` "delta"."classes"."<C>"."aoe")
    at most this, plus the worth of one turned heading (pi / the class's ground-truth count). One-sided: the
    artifact's headings got worse. The box and score gates cannot see an artifact that turns headings (a
    quantized heading head took centerpoint_lidar's pedestrian AOE 0.59 -> 1.35, +0.76, with every other gate
    passing); 0.25 because a class whose heading is not learned (AOE ~1.5, painted_pillars' pedestrians)
    moves by ~0.1 between INT8 and PyTorch by chance (-0.096 on the default run)."""
    parity_class_ap_distance_m: PositiveFloat = 2.0
    """Matching distance (m) of the per-class AP the class gate reads (a key of the KPIs' "ap")."""
    parity_range_map_tolerance: NonNegFloat = 0.015
    """Absolute gate, per range bucket: |mAP(optimized) - mAP(PyTorch)| (`kpis.json` "delta"."by_range")
    at most this: 1.5 points (a bucket holds a third of the objects: its delta is noisier)."""
    min_parity_agreement: Annotated[float, Field(ge=0, le=1)] = 0.95
    """Absolute gate: the primary artifact's confident-detection match rate vs PyTorch (`parity.json`
    metrics.agreement.match_rate, score >= optimize.parity.agreement_score_threshold), judged with its
    support (`rate_min_support`, `rate_confidence`)."""
    rate_min_support: Annotated[int, Field(gt=0)] = 10
    """A rate gate (`parity_agreement`) judges k/n only with n >= this (n = max(reference, candidate)
    detections); below it: "too few to judge", passed (the KPI-delta gates still judge the artifact)."""
    rate_confidence: Annotated[float, Field(gt=0.5, lt=1)] = 0.95
    """... and then refuses only when the upper bound of the two-sided Wilson score interval at this
    confidence is below the limit."""
    max_parity_scores_p99: NonNegFloat = 0.06
    """Absolute gate: the 99th percentile of |score diff| over those matched detections."""
    min_kitti: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)
    """Absolute gates on KITTI's official metric (KITTI data only): `{"kitti/Car/3d/moderate": 0.5, ...}`, the
    kpis.json `kitti` table (AP R40, strict overlaps; docs/KPIS.md) by its MLflow name; each must be at least
    its value. Empty: none. A candidate evaluated on other data fails such a gate (it cannot be verified)."""
    lock_timeout_s: PositiveFloat = 600.0
    """How long a promotion waits for the registry lock held by another promotion before giving up."""
    verify_candidate: Literal["team", "always", "never"] = "team"
    """Before the alias moves, check the candidate's files against the sha256 recorded at registration and
    recompute its KPIs from its artifact on the evaluation data (`evaluate`, as for a champion); the gates
    read the recomputed numbers. `team`: with a team's registry (where candidates come from other users'
    runs); `always`; `never`. Costs one evaluation of the candidate."""
    verify_map_tolerance: NonNegFloat = 0.005
    """A recorded mAP further than this from the recomputed one is refused ("recorded mAP 0.99, recomputed
    0.41"): the same artifact on the same frames scores the same, up to runtime rounding."""
    intended_use: str = (
        "3D object detection (Car, Pedestrian, Cyclist) from one or more cameras + a spinning lidar, "
        "for offline evaluation and research; not validated for safety-critical use."
    )
    """Written into the model card's "Intended use" section."""

    @field_validator("min_kitti")
    @classmethod
    def _kitti_names(cls, v: dict[str, float]) -> dict[str, float]:
        import re

        # kitti/<Class>/<metric>/<difficulty> (pfactory.metrics.kitti_eval; not imported: params load light)
        pattern = r"kitti/(Car|Pedestrian|Cyclist)/(bbox|bev|3d|aos)/(easy|moderate|hard)"
        bad = [k for k in v if not re.fullmatch(pattern, k)]
        if bad:
            raise ValueError(
                f"KITTI gate names like kitti/Car/3d/moderate (class, metric, difficulty), got {bad}"
            )
        return v

    @field_validator("model_name", "alias")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip() or "/" in v or "@" in v:
            raise ValueError("a non-empty name without '/' or '@'")
        return v
