"""Parameters of the optimize stage (`params.optimize`): export, backends, INT8, parity gates, latency.

In: the `optimize:` section of `params.yaml` (hooked into `pfactory.config.Params` as `optimize`).
Out: a validated pydantic model; unknown keys are refused (`extra="forbid"`), every field documented.

The parity tolerances are per precision because the three answer different questions: FP32 must be
the *same computation* as PyTorch (only float reassociation differs), FP16/INT8 must be *close enough*
that the KPI delta computed by the evaluate stage is what decides. Evidence behind each default is in
docs/OPTIMIZE.md ("Parity tolerances", "INT8").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pfactory.section import Fraction, NonNegInt, PositiveFloat, PositiveInt, Section

OptionalTol = Annotated[float, Field(ge=0)] | None


class ParityTolerance(Section):
    """Gate of one precision; `null` leaves a metric reported but not gated.

    Boxes and scores are compared on *matched* detections (same label, BEV centre within
    `parity.match_distance_m`), so two detections whose near-equal scores swap rank are not a
    mismatch. Element checks follow numpy's `allclose`: |candidate - reference| <= atol + rtol * |reference|
    (a null atol/rtol counts as 0 when the other is set).
    """

    boxes_atol: OptionalTol = None
    """Absolute tolerance of x, y, z, l, w, h (metres)."""
    boxes_rtol: OptionalTol = None
    """Relative tolerance of x, y, z, l, w, h."""
    yaw_atol: OptionalTol = None
    """Absolute tolerance of yaw (radians, difference wrapped to [-pi, pi]): an angle has no relative error."""
    scores_atol: OptionalTol = None
    """Absolute tolerance of a matched detection's score."""
    scores_rtol: OptionalTol = None
    """Relative tolerance of a matched detection's score."""
    min_cosine: Annotated[float, Field(ge=-1, le=1)] | None = None
    """Smallest cosine similarity between candidate and reference (rank-aligned scores, matched boxes)."""
    min_match_rate: Fraction | None = None
    """Smallest box-level match rate: matched / max(reference, candidate) detections above the threshold."""
    repeat_atol: OptionalTol = None
    """Largest |diff| of boxes/scores between two runs of the candidate on the same frames (labels must
    agree); 0 = bit-repeatable. Catches kernels that race (docs/OPTIMIZE.md, "Parity")."""


def _fp32_tolerance() -> ParityTolerance:
    # The acceptance: FP32 within 1e-4 relative on boxes and scores. PyTorch against itself
    # (1 vs 2 threads, trained default model, 16 val frames) differs by 2.0e-5 on a 0.18 score (1.1e-4
    # relative), 6.5e-4 rad on yaw: that is float32's floor here, so rtol 1e-4 needs an atol
    # (5e-5 on scores in [0, 1], 0.1 mm on boxes) and yaw 2e-3 rad. docs/OPTIMIZE.md, "Parity".
    # scores atol was 1e-5 until a trained model (bench_train, 52k-point frames) failed at 4.7e-5 on a
    # ~0.3 score with outputs bit-identical across ORT session variants: float noise, not a defect.
    return ParityTolerance(
        boxes_atol=1e-4,
        boxes_rtol=1e-4,
        yaw_atol=2e-3,
        scores_atol=5e-5,
        scores_rtol=1e-4,
        min_cosine=0.99999,
        min_match_rate=0.99,
        repeat_atol=0.0,
    )


def _fp16_tolerance() -> ParityTolerance:
    # FP16 (TensorRT only): ~3 significant digits; no measurement here (no GPU), values from the
    # usual fp16 error on logits after a dozen convs; the evaluate stage's KPI delta is the real gate.
    # Repeatability not gated: TensorRT may pick tactics that accumulate in a run-dependent order.
    return ParityTolerance(
        boxes_atol=0.1, yaw_atol=0.05, scores_atol=0.02, min_cosine=0.999, min_match_rate=0.9
    )


def _int8_tolerance() -> ParityTolerance:
    # INT8 changes which near-tied peaks win, so element diffs are not gated; the gate is that the
    # detections are mostly the same ones (match rate) with near-identical confidence (cosine), and no
    # single score moves by more than a quarter. INT8's accuracy gate is the KPI delta vs PyTorch on the
    # same frames (evaluate's `delta`, gated by promote.parity_map_tolerance). Measured on trained default
    # models: match rate 0.815-0.897, scores cosine 0.999, max score diff up to 0.166 (a default
    # `factory run`, 2026-11-30) with an mAP drop of 0.8 points: docs/OPTIMIZE.md, "INT8".
    return ParityTolerance(scores_atol=0.25, min_cosine=0.99, min_match_rate=0.75, repeat_atol=0.0)


class ParityParams(Section):
    """Optimized backend vs PyTorch on held-out frames -> `parity.json`; the stage fails outside the gate."""

    split: Literal["train", "val"] = "val"
    """Split of the held-out frames (the evaluate stage scores the same split)."""
    frames: PositiveInt = 16
    """Frames compared (the first ones of `split`, in the loader's deterministic order)."""
    batch_size: PositiveInt = 1
    """Frames per runner call during the comparison."""
    score_threshold: Annotated[float, Field(ge=0, lt=1)] = 0.05
    """Detections scoring at or above this are compared (= `evaluate.score_threshold`)."""
    match_distance_m: PositiveFloat = 0.5
    """Max BEV centre distance for a candidate detection to match a reference one (same label)."""
    boxes_rel_floor: PositiveFloat = 1.0
    """Reported `boxes.max_rel_diff` only: |diff| / max(|ref|, this) (m), so a z of 0.02 m is not divided by ~0."""
    scores_rel_floor: PositiveFloat = 0.01
    """Reported `scores.max_rel_diff` only: the same floor for scores."""
    fp32: ParityTolerance = Field(default_factory=_fp32_tolerance)
    """Gate of FP32 artifacts (ONNX Runtime graph-optimized model)."""
    fp16: ParityTolerance = Field(default_factory=_fp16_tolerance)
    """Gate of FP16 artifacts (TensorRT)."""
    int8: ParityTolerance = Field(default_factory=_int8_tolerance)
    """Gate of INT8 artifacts (ONNX Runtime QDQ model, TensorRT INT8 engine)."""


class LatencyParams(Section):
    """Latency of every built artifact and of PyTorch eager, measured in the same run -> `latency.json`."""

    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 4])
    """Batch sizes timed (end to end: padded points in, decoded boxes out)."""
    warmup: NonNegInt = 3
    """Untimed calls per backend and batch size before timing (allocator, thread pool, page faults)."""
    iterations: PositiveInt = 20
    """Timed calls per backend and batch size; backends alternate call by call so machine noise hits all alike."""
    eager: bool = True
    """Also time PyTorch eager (the reference every ratio in `latency.json` is relative to)."""


class Int8Params(Section):
    """Post-training static INT8 quantization (ONNX Runtime QDQ; TensorRT calibration / QDQ)."""

    calibration_split: Literal["train", "val"] = "train"
    """Split the calibration frames come from (train: never the held-out parity/evaluation frames)."""
    calibration_frames: PositiveInt = 32
    """Frames fed to the calibrator."""
    calibrator: Literal["entropy", "minmax"] = "entropy"
    """TensorRT calibrator: IInt8EntropyCalibrator2 or IInt8MinMaxCalibrator (TensorRT <= 10). TensorRT >= 11
    removed implicit calibration: there the engine is built from the QDQ model and this picks its method."""
    ort_method: Literal["minmax", "entropy", "percentile"] = "percentile"
    """ONNX Runtime calibration method of the QDQ model. Percentile (99.999th, clips rare outliers)
    measured closest to PyTorch on the trained default model: match rate 0.89 vs 0.86 (minmax/entropy),
    max score diff 0.058 vs 0.07 (docs/OPTIMIZE.md, "INT8")."""
    per_channel: bool = True
    """Per-output-channel weight scales (accuracy; CPU cost measured negligible on this model)."""
    activation_type: Literal["uint8", "int8"] = "uint8"
    """Activation type on ONNX Runtime CPU: uint8 (asymmetric) + int8 weights is ORT's x86 fast path, and
    it matched PyTorch better than symmetric int8 (match rate 0.86 vs 0.79, docs/OPTIMIZE.md). TensorRT
    always gets symmetric int8 (its QDQ requirement)."""
    op_types: list[str] = Field(default_factory=lambda: ["Conv", "ConvTranspose", "Gemm", "MatMul"])
    """ONNX op types that get quantized; everything else stays float (scatter, painting, decode, norms)."""
    exclude_op_types: list[str] = Field(default_factory=lambda: ["ConvTranspose"])
    """Op types never quantized (applied on top of `op_types`). ConvTranspose by default: ORT's CPU EP has
    no int8 ConvTranspose kernel (after fusion the session still runs a float ConvTranspose on
    dequantized weights, only adding Q/DQ), measured on the trained default model: INT8 p50 13.6 vs
    13.9 ms at 1 thread, match rate 0.897 vs 0.891 (docs/OPTIMIZE.md, "INT8")."""
    exclude_nodes: list[str] = Field(default_factory=lambda: ["head.heatmap", "head.reg"])
    """fnmatch patterns over ONNX node names *and* the detector module path that produced a node
    (exporter metadata, e.g. `head.heatmap`, `backbone.stages.0.*`): matching nodes stay float.
    Default: the two output convs, whose 8-bit outputs would quantize logits and box regressions
    directly (measured: docs/OPTIMIZE.md)."""


class TensorRTParams(Section):
    """TensorRT engines (GPU machines with `pip install .[tensorrt]`; skipped elsewhere)."""

    workspace_gib: PositiveFloat = 4.0
    """Builder workspace memory-pool limit, GiB."""
    optimization_level: Annotated[int, Field(ge=0, le=5)] = 3
    """Builder optimization level (TensorRT default 3; higher searches more tactics, builds slower)."""
    min_points: PositiveInt = 1
    """Optimization profile of the padded point count P: smallest."""
    opt_points: PositiveInt = 50000
    """P the kernels are tuned for (a prepared synthetic HDL-64 frame holds ~50k points in the ROI, a
    KITTI sweep ~20k): also the fixed P of implicit INT8 calibration."""
    max_points: PositiveInt = 150000
    """Largest P an engine accepts (a full 64-beam sweep is ~120k points)."""
    timing_cache: bool = True
    """Keep `timing.cache` next to the engines and reuse it on the next build (same GPU/TensorRT)."""
    fp16_keep_fp32_op_types: list[str] = Field(
        default_factory=lambda: ["ScatterElements", "TopK", "Sigmoid", "MaxPool", "Exp", "Atan", "GridSample"]
    )
    """TensorRT >= 11 (strongly typed) FP16: op types kept in FP32 when the ONNX model is cast to FP16
    (scatter-max, peak extraction and decoding compare values: fp16 ties would change the detections)."""

    @model_validator(mode="after")
    def _profile(self) -> TensorRTParams:
        if not self.min_points <= self.opt_points <= self.max_points:
            raise ValueError("optimize.tensorrt needs min_points <= opt_points <= max_points")
        return self


class OptimizeParams(Section):
    """Trained PyTorch detector -> ONNX + backend artifacts, with parity and latency evidence (`factory optimize`)."""

    backend: Literal["auto", "onnxruntime", "tensorrt"] = "auto"
    """auto = TensorRT when `tensorrt` imports and CUDA is present, else ONNX Runtime."""
    precision: Literal["fp32", "fp16", "int8"] = "int8"
    """Precision of the primary artifact (what `load_runner(..., precision=None)` serves). FP32 is always
    built as well (it is the parity baseline of the export itself). ONNX Runtime: fp32 | int8."""
    opset: Annotated[int, Field(ge=18)] = 18
    """ONNX opset. >= 18: the pillar scatter exports as ScatterElements(reduction="max"), new in opset 18."""
    dynamic_batch: bool = True
    """Export the batch dimension as dynamic (falls back to a fixed batch of 1 when the model cannot trace it)."""
    export_points: PositiveInt = 4096
    """Padded point count of the example input the exporter traces with (P itself stays dynamic)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where ONNX Runtime runs (CUDA execution provider when present and asked for) and PyTorch is timed."""
    intra_op_threads: NonNegInt = 0
    """Intra-op threads of ONNX Runtime and PyTorch during parity/latency (0 = all cores)."""
    num_threads: PositiveInt = 2
    """Data-loader threads for the calibration and held-out frames."""
    parity: ParityParams = Field(default_factory=ParityParams)
    """Parity gates (`parity.json`)."""
    latency: LatencyParams = Field(default_factory=LatencyParams)
    """Latency measurement (`latency.json`)."""
    int8: Int8Params = Field(default_factory=Int8Params)
    """INT8 quantization and calibration."""
    tensorrt: TensorRTParams = Field(default_factory=TensorRTParams)
    """TensorRT engine building."""
