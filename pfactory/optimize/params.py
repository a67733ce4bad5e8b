"""Parameters of the optimize stage (`params.optimize`): export, backends, INT8, parity gates, latency.

In: the `optimize:` section of `params.yaml` (hooked into `flows.params.Params` as `optimize`).
Out: a validated pydantic model; unknown keys are refused (`extra="forbid"`), every field documented.

The parity tolerances are per precision because the three answer different questions: FP32 must be
the *same computation* as PyTorch (only float reassociation differs), FP16/INT8 must be *close enough*
that the KPI delta computed by the evaluate stage is what decides. Evidence behind each default is in
docs/OPTIMIZE.md ("Parity", "INT8").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pfactory.config.section import Fraction, NonNegInt, PositiveFloat, PositiveInt, Section

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
    """Absolute tolerance of yaw (radians, difference wrapped to [-pi, pi]) of EVERY matched detection: an
    angle has no relative error."""
    yaw_p99_atol: OptionalTol = None
    """Absolute tolerance of the 99th percentile of |yaw diff| over matched detections (radians). yaw =
    atan2(sin, cos) amplifies the head's float noise by 1 / |(sin, cos)|: a detection whose heading vector
    is short (an unsure heading) moves by more than float noise elsewhere, and which one it is depends on
    the thread count's rounding. So FP32 bounds the bulk tightly here and every detection loosely
    (`yaw_atol`)."""
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
    min_agreement: Fraction | None = None
    """Smallest match rate among confident detections (both sides cut at `parity.agreement_score_threshold`):
    matched / max(reference, candidate); a missed and an extra confident detection both count."""
    scores_p99_atol: OptionalTol = None
    """Largest 99th percentile of |score diff| over matched confident detections (a percentile: one
    near-tied peak is not a defect, a shifted score distribution is)."""
    min_heading_agreement: Fraction | None = None
    """Smallest share of matched confident detections whose heading stayed within 0.5 rad
    (`parity.HEADING_TURNED_RAD`): an artifact that turns headings keeps its boxes and scores, and only
    this (and the evaluate stage's AOE) sees it. Judged with its support, like the match rates."""


def _fp32_tolerance() -> ParityTolerance:
    # The acceptance: FP32 within 1e-4 relative on boxes and scores. PyTorch against itself
    # (1 vs 2 threads, trained default model, 16 val frames) differs by 2.0e-5 on a 0.18 score (1.1e-4
    # relative), 6.5e-4 rad on yaw: that is float32's floor here, so rtol 1e-4 needs an atol
    # (5e-5 on scores in [0, 1], 0.1 mm on boxes) and yaw 2e-3 rad. docs/OPTIMIZE.md, "Parity".
    # scores atol was 1e-5 until a trained model (bench_train, 52k-point frames) failed at 4.7e-5 on a
    # ~0.3 score with outputs bit-identical across ORT session variants: float noise, not a defect.
    # yaw: 2e-3 rad was the max over every detection until the default model (seed 0, 16 val frames)
    # failed at ORT intra_op_threads=1 with 3.4e-3 on ONE detection (1.7e-3 at 1 thread on c0686b9's
    # model, 6e-4 on the seed-1 model): the 1 / |(sin, cos)| amplification of an unsure heading. Now
    # 2e-3 bounds the 99th percentile and 0.05 rad (3 degrees, FP16's bound) every detection; a decode
    # defect (a sign, an axis) moves most headings by far more than either.
    return ParityTolerance(
        boxes_atol=1e-4,
        boxes_rtol=1e-4,
        yaw_atol=0.05,
        yaw_p99_atol=2e-3,
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
    # INT8 is gated on what a user of the detections sees: the confident detections (score >= 0.3) are
    # the same ones (agreement match rate) with the same confidence (99th percentile of the score
    # difference), and the artifact is bit-repeatable. Not on the worst single element, nor on the
    # low-score clutter below 0.3 whose near-tied peaks INT8 legitimately reorders: those gates were
    # widened twice to let runs pass (scores atol 0.1 -> 0.25, match 0.8 -> 0.75), which made them
    # machine-dependent noise detectors. INT8's accuracy gate is the KPI delta vs PyTorch from the
    # evaluate stage (promote.parity_*). Measured values: docs/OPTIMIZE.md, "INT8".
    # Headings: a quantized heading head (centerpoint_lidar's point heading, 2026-12-05) turned a third of
    # the pedestrians' headings while every box and score gate passed (AOE 0.59 -> 1.35).
    return ParityTolerance(min_agreement=0.95, scores_p99_atol=0.06, repeat_atol=0.0, min_heading_agreement=0.95)


class ParityParams(Section):
    """Optimized backend vs PyTorch on held-out frames -> `parity.json`; the stage fails outside the gate."""

    split: Literal["train", "val"] = "val"
    """Split of the held-out frames compared (val: by default the split the evaluate stage scores too)."""
    frames: PositiveInt = 16
    """Frames compared (the first ones of `split`, in the loader's deterministic order)."""
    batch_size: PositiveInt = 1
    """Frames per runner call during the comparison."""
    match_distance_m: PositiveFloat = 0.5
    """Max BEV centre distance for a candidate detection to match a reference one (same label)."""
    agreement_score_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.3
    """Confident detections: the robust agreement metrics (`min_agreement`, `scores_p99_atol`) compare only
    detections at or above this score (the evaluate stage's per-frame TP/FP threshold)."""
    boxes_rel_floor: PositiveFloat = 1.0
    """Reported `boxes.max_rel_diff` only: |diff| / max(|ref|, this) (m), so a z of 0.02 m is not divided by ~0."""
    scores_rel_floor: PositiveFloat = 0.01
    """Reported `scores.max_rel_diff` only: the same floor for scores."""
    rate_min_support: PositiveInt = 10
    """The rate gates (`min_match_rate`, `min_agreement`) judge a proportion k/n only with at least this many
    detections n (n = max(reference, candidate)); below it the gate reports "n=3 < 10: too few to judge" and
    does not refuse (the promotion's KPI-delta gates still judge the artifact)."""
    rate_confidence: Annotated[float, Field(gt=0.5, lt=1)] = 0.95
    """Confidence of the two-sided Wilson score interval of such a rate: the gate refuses only when the
    interval's UPPER bound is below the limit (the rate is below it beyond sampling noise)."""
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


class SensitivityParams(Section):
    """Sensitivity-guided PTQ: which quantizable layers stay float (ONNX Runtime and TensorRT alike).

    Each quantizable layer is quantized *alone* (every other layer float) and run on the calibration
    frames against the FP32 model; its sensitivity is the error that causes: (1 - agreement match rate)
    + 99th percentile of |score diff| over matched confident detections (`parity.agreement_score_threshold`).
    Then, with every layer quantized, layers are kept float one at a time, in the order `order` gives,
    re-measuring the whole model after each, until it meets `target_agreement` and `target_scores_p99` on
    the calibration frames (never the held-out parity/evaluation frames). `onnxruntime/sensitivity.json`
    records every layer's sensitivity, every greedy step and the chosen set.
    """

    enabled: bool = True
    """False: quantize every layer of `int8.op_types` except the forced exclusions (no profile)."""
    target_agreement: Fraction = 0.99
    """The whole INT8 model vs FP32 on the calibration frames: smallest confident-detection match rate."""
    target_scores_p99: Annotated[float, Field(ge=0)] = 0.04
    """... and largest 99th percentile of |score diff| over matched confident detections."""
    order: Literal["sensitivity_per_mac", "sensitivity"] = "sensitivity_per_mac"
    """Order in which layers are kept float. sensitivity_per_mac: sensitivity / MACs per frame, most
    error removed per unit of integer compute given up first (a knapsack-style greedy); sensitivity: most
    sensitive first (the plain recipe). Measured on the default model, both met the target; by sensitivity
    kept the 243-MMAC `head.shared` conv float and cost 19-25 % INT8 latency, per MAC 0-8 % for the same
    accuracy on the held-out frames (docs/OPTIMIZE.md, "Sensitivity")."""
    profile_frames: PositiveInt | None = 8
    """Frames of the per-layer profile (the first ones of the calibration frames; None: all). The profile
    only orders the layers; every greedy step, which decides whether the target holds, uses all
    calibration frames, so fewer profile frames can change which layers go float, never whether the
    target was met. 8 of 32 on the trained default model (2026-12-03): the same 7 layers kept float, the
    same final error, the sensitivity search 19.2 -> 10.6 s (docs/OPTIMIZE.md, "Sensitivity")."""
    max_excluded: NonNegInt | None = None
    """At most this many layers kept float by the greedy step (None: as many as the target needs; the
    stage records whether the target was met)."""


class Int8Params(Section):
    """Post-training static INT8 quantization (ONNX Runtime QDQ; TensorRT calibration / QDQ)."""

    calibration_split: Literal["train", "val"] = "train"
    """Split the calibration frames come from (train: never the held-out parity/evaluation frames)."""
    calibration_frames: PositiveInt = 32
    """Frames fed to the calibrator (and the sensitivity profile)."""
    calibrator: Literal["entropy", "minmax"] = "entropy"
    """TensorRT calibrator: IInt8EntropyCalibrator2 or IInt8MinMaxCalibrator (TensorRT <= 10). TensorRT >= 11
    removed implicit calibration: there the engine is built from the QDQ model and this picks its method."""
    ort_method: Literal["auto", "minmax", "entropy", "percentile"] = "auto"
    """ONNX Runtime calibration method of the QDQ model. auto: every method of `calibration_methods` is
    calibrated (each cache kept) and measured on the calibration frames (all layers quantized, vs FP32,
    the sensitivity error); the one with the smallest error is used (docs/OPTIMIZE.md, "Calibration")."""
    calibration_methods: list[Literal["minmax", "entropy", "percentile"]] = Field(
        default_factory=lambda: ["percentile", "minmax"]
    )
    """Methods `ort_method: auto` compares (the first wins ties). Entropy is not compared by default: on the
    default model its KL thresholds clip far too much (error 1.01 vs 0.098 percentile, 0.101 minmax) and
    its 2048-bin histograms take 32 s of the stage (docs/OPTIMIZE.md, "Calibration")."""
    percentile: Annotated[float, Field(gt=50, le=100)] = 99.999
    """Percentile calibration: the activation range covers this percentile of |values| (clips rare outliers)."""
    per_channel: bool = True
    """Per-output-channel weight scales (accuracy; CPU cost measured negligible on this model)."""
    activation_type: Literal["uint8", "int8"] = "uint8"
    """Activation type on ONNX Runtime CPU: uint8 (asymmetric) + int8 weights (U8S8) is ORT's x86 integer
    path. int8 (S8S8) gains nothing on x86: ORT shifts int8 activations to uint8 for its U8S8 kernels
    (the same saturation arithmetic) or runs the convs in float (measured: docs/OPTIMIZE.md).
    TensorRT always gets symmetric int8 (its QDQ requirement)."""
    reduce_range: bool = True
    """7-bit weights ([-64, 64] instead of [-127, 127]) so the artifact computes the same on every x86 CPU.
    ORT's U8S8 kernels on x86 without VNNI (AVX2, AVX-512 without VNNI) multiply with `vpmaddubsw`,
    which sums two u8 x s8 products into int16 with saturation: 2 x 255 x 127 = 64770 does not fit,
    2 x 255 x 64 = 32640 does. Measured (benchmarks/bench_int8_isa.py, QEMU-emulated AVX2 EPYC-Milan
    vs this AVX-512 VNNI EPYC): a conv at the extremes returns 32.64 instead of 64.0 with 8-bit weights
    on AVX2, 64.0 everywhere with 7-bit weights (docs/OPTIMIZE.md, "INT8 on every x86 CPU").
    False: 8-bit weights, exact only with VNNI (or on ARM); the artifact is
    then marked so and ONNX Runtime sessions turn on its exact U8U8 mode (`session.x64quantprecision`)."""
    op_types: list[str] = Field(default_factory=lambda: ["Conv", "ConvTranspose", "Gemm", "MatMul"])
    """ONNX op types that get quantized; everything else stays float (scatter, painting, decode, norms)."""
    exclude_op_types: list[str] = Field(default_factory=lambda: ["ConvTranspose"])
    """Op types never quantized (applied on top of `op_types`). ConvTranspose by default: ORT's CPU EP has
    no int8 ConvTranspose kernel (after fusion the session still runs a float ConvTranspose on
    dequantized weights, only adding Q/DQ), measured on the trained default model: INT8 p50 13.6 vs
    13.9 ms at 1 thread, match rate 0.897 vs 0.891 (docs/OPTIMIZE.md, "INT8")."""
    exclude_nodes: list[str] = Field(default_factory=list)
    """Forced exclusions, on top of what the sensitivity profile keeps float: fnmatch patterns over ONNX
    node names *and* the detector module path that produced a node (exporter metadata, e.g.
    `head.heatmap`, `backbone.stages.0.*`)."""
    sensitivity: SensitivityParams = Field(default_factory=SensitivityParams)
    """Sensitivity-guided choice of the layers kept float."""


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


class OrtParams(Section):
    """Graph rewrites of the ONNX Runtime FP32 artifact beyond the exact ones (`graph_rewrite.py`)."""

    affine_conv: bool = False
    """GroupNorm's per-channel affine (Mul + Add after InstanceNormalization) as a depthwise 1x1 Conv, which
    ORT fuses with the following Relu (one pass instead of three); within 1 ulp (an FMA). FP32 only."""


class AotiParams(Section):
    """AOTInductor, the second CPU backend (`pfactory/optimize/aoti_backend.py`): the detector compiled
    ahead of time to `aoti/model.fp32.pt2`, gated and timed like the ONNX Runtime artifacts."""

    enabled: bool = False
    """Build it when the backend is `auto` (a candidate of the fastest-artifact choice) or `aoti`. Off by
    default: its compile costs ~45 CPU-seconds per build (docs/OPTIMIZE.md, "AOTInductor")."""


class OptimizeParams(Section):
    """Trained PyTorch detector -> ONNX + backend artifacts, with parity and latency evidence (`factory optimize`)."""

    backend: Literal["auto", "onnxruntime", "tensorrt", "aoti"] = "auto"
    """auto = TensorRT when `tensorrt` imports and CUDA is present; else every CPU artifact built (ONNX
    Runtime FP32, INT8 when `precision` is int8, AOTInductor when `aoti.enabled`) is gated, timed, and the
    fastest at the smallest `latency.batch_sizes` becomes the primary (`backend.json` "selection" says
    why). onnxruntime / aoti: that backend's artifact is the primary (aoti: FP32)."""
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
    ort: OrtParams = Field(default_factory=OrtParams)
    """ONNX Runtime FP32 graph rewrites."""
    aoti: AotiParams = Field(default_factory=AotiParams)
    """AOTInductor package building (CPU)."""
