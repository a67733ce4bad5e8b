"""ONNX Runtime backend: graph-optimized FP32 model, INT8 static QDQ quantization, sessions.

In:  `model.onnx` (pfactory.optimize.export), calibration feeds (dicts of numpy inputs), `Int8Params`.
Out: `save_optimized_fp32` -> an FP32 model with ORT's graph optimizations applied offline;
     `quantize_int8` -> a QDQ model (QuantizeLinear/DequantizeLinear around the quantized ops) plus its
     calibration cache (JSON tensor ranges, reused when it exists); `make_session` -> an InferenceSession
     on CPU, or the CUDA execution provider when it is installed and asked for.

Why QDQ (not QOperator): ORT's CPU kernels fuse DQ -> Conv -> Q into QLinearConv at load time, and the
same file is what TensorRT's explicit quantization consumes (symmetric int8, `for_tensorrt=True`).
Which nodes are quantized: only `Int8Params.op_types` (convs and matmuls: where the time goes), minus
`exclude_op_types`, minus nodes matching `exclude_nodes` by node name or detector module path.
Scatter, painting, GroupNorm and decoding stay float (measurements: docs/OPTIMIZE.md, "INT8").
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.optimize.calibration import pad_points
from pfactory.optimize.errors import BackendUnavailable
from pfactory.optimize.feed import Feed
from pfactory.optimize.params import Int8Params


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def providers_for(device: str) -> list[str]:
    """Execution providers for `device` ("cpu" | "cuda" | "auto"), CPU always last as the fallback."""
    avail = available_providers()
    if device == "cuda" and "CUDAExecutionProvider" not in avail:
        raise BackendUnavailable(
            f"device 'cuda' asked for ONNX Runtime, but this onnxruntime has no CUDA execution provider "
            f"(available: {avail}); install onnxruntime-gpu or use device 'cpu'"
        )
    if device in ("cuda", "auto") and "CUDAExecutionProvider" in avail:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(
    intra_op_threads: int | None = None,
    level: str = "all",
    spin: bool = True,
    inter_op_threads: int | None = None,
) -> Any:
    """SessionOptions: graph optimization `level` ("basic" | "extended" | "all"), thread counts.

    `spin=False` stops idle intra-op (and inter-op) threads from busy-waiting after a run: needed when
    ORT shares the cores with another runtime in the same process (the interleaved latency measurement),
    where the spinning threads would otherwise steal the next PyTorch call's cores.

    `inter_op_threads` > 1 selects ORT's parallel executor (`ExecutionMode.ORT_PARALLEL`: independent
    nodes run concurrently on that many inter-op threads, each node with `intra_op_threads`); None, 0 or
    1 keeps the sequential executor, the default everywhere. Opt-in for measurements only: on this
    detector the parallel executor is 1.3-2.3x *slower* than sequential at batch 1 and 4 on 2 cores (the
    camera CNN feeds the painting, so little runs off the critical path, and every node hand-off to an
    inter-op thread costs a wake-up; docs/OPTIMIZE.md, "Inter-op parallelism").
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    if intra_op_threads:
        so.intra_op_num_threads = int(intra_op_threads)
    if inter_op_threads is not None and int(inter_op_threads) > 1:
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        so.inter_op_num_threads = int(inter_op_threads)
    else:
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only: the NCHWc serialization warning etc. are expected
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def make_session(
    path: str | Path,
    device: str = "cpu",
    intra_op_threads: int | None = None,
    spin: bool = True,
    inter_op_threads: int | None = None,
    exact_u8s8: bool = False,
) -> Any:
    """An InferenceSession for `path` with every graph optimization on (sequential executor unless
    `inter_op_threads` > 1: `session_options`).

    `exact_u8s8`: ORT's `session.x64quantprecision` = 1: on x86 CPUs without VNNI its U8S8 kernels are
    replaced by exact (slower) U8U8 ones; no effect elsewhere. For INT8 models with 8-bit weights (not
    `X86_EXACT_KEY`), which `vpmaddubsw` can saturate (`int8_format`).
    """
    import onnxruntime as ort

    so = session_options(intra_op_threads, "all", spin, inter_op_threads)
    if exact_u8s8:
        so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(str(path), so, providers=providers_for(device))


def needs_exact_u8s8(session: Any) -> bool:
    """True for a session of an INT8 model that does not declare itself saturation-free on x86
    (`X86_EXACT_KEY`): 8-bit weights, or built before the format was recorded."""
    meta = session.get_modelmeta().custom_metadata_map
    return meta.get(X86_EXACT_KEY) != "true"


def write_rewritten(src: str | Path, dst: str | Path, affine_conv: bool = False) -> dict[str, Any]:
    """`src` through `graph_rewrite.rewrite_for_ort` (exact, faster ORT ops; `affine_conv`: GroupNorm affines
    as depthwise convs) saved to `dst`; returns the report."""
    import onnx

    from pfactory.optimize.graph_rewrite import rewrite_for_ort

    model, report = rewrite_for_ort(onnx.load(str(src)), affine_conv=affine_conv)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return report


def save_optimized_fp32(src: str | Path, dst: str | Path) -> Path:
    """Apply ORT's graph optimizations offline and save the result (the FP32 production model).

    Level EXTENDED, not ALL: ALL adds NCHWc layout transforms specific to this CPU's vector width (ORT
    warns the file "should only be used in the same environment"); a session loading the saved model
    still applies the ALL-level transforms for the machine it runs on.
    """
    import onnxruntime as ort

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    so = session_options(level="extended")
    so.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return dst


class FeedReader:
    """`CalibrationDataReader` over an iterable of feeds (each a dict input name -> numpy array)."""

    def __init__(self, feeds: Iterable[Feed], input_names: Iterable[str] | None = None) -> None:
        self._feeds = feeds
        self._names = list(input_names) if input_names is not None else None
        self._it: Iterator[Feed] | None = None
        self.count = 0

    def get_next(self) -> Feed | None:
        if self._it is None:
            self._it = iter(self._feeds)
        feed = next(self._it, None)
        if feed is None:
            return None
        self.count += 1
        return {k: v for k, v in feed.items() if self._names is None or k in self._names}

    def rewind(self) -> None:
        self._it = None
        self.count = 0


def _as_reader(feeds: Iterable[Feed], input_names: list[str]) -> Any:
    """A FeedReader that is also an instance of ORT's abstract `CalibrationDataReader`."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(FeedReader, CalibrationDataReader):
        pass

    return _Reader(feeds, input_names)


def select_excluded_nodes(
    model: Any, op_types: list[str], exclude_op_types: list[str], exclude_patterns: list[str]
) -> tuple[list[str], dict[str, str]]:
    """Nodes of a quantizable type that stay float: (names, {name: why}).

    A node is excluded when its op type is in `exclude_op_types`, or a pattern of `exclude_patterns`
    (fnmatch) matches its name or its detector module path (`export.node_module_paths`). A pattern that
    names a module also covers its children (`head` covers `head.reg`).
    """
    from pfactory.optimize.export import node_module_paths

    paths = node_module_paths(model)
    excluded: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in op_types:
            continue
        if node.op_type in exclude_op_types:
            excluded[node.name] = f"op type {node.op_type}"
            continue
        mod = paths.get(node.name, "")
        for pat in exclude_patterns:
            if fnmatch.fnmatchcase(node.name, pat):
                excluded[node.name] = f"name matches {pat!r}"
                break
            if mod and (fnmatch.fnmatchcase(mod, pat) or fnmatch.fnmatchcase(mod, pat + ".*")):
                excluded[node.name] = f"module {mod} matches {pat!r}"
                break
    return sorted(excluded), excluded


INT8_FORMAT_KEY = "pfactory.int8.format"
"""ONNX metadata key of an INT8 artifact: its kernel format (JSON of `int8_format`)."""
X86_EXACT_KEY = "pfactory.int8.x86_exact"
"""ONNX metadata key: "true" when no x86 integer kernel can saturate on the artifact (7-bit weights)."""
_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


def int8_format(params: Int8Params, for_tensorrt: bool = False) -> dict[str, Any]:
    """The kernel format an INT8 artifact is built in (recorded in backend.json and the ONNX metadata).

    `x86_saturation_free`: ORT's x86 integer kernels without VNNI sum two u8 x s8 products in int16
    (`vpmaddubsw`, saturating); int8 activations are shifted to uint8 for the same kernels. With 7-bit
    weights |w| <= 64 the pair sum is <= 2 * 255 * 64 = 32640 < 32767 on every x86 CPU.
    """
    symmetric = for_tensorrt or params.activation_type == "int8"
    wmax = 64 if params.reduce_range and not for_tensorrt else 127
    return {
        "quant_format": "QDQ",
        "activations": "int8 symmetric per-tensor" if symmetric else "uint8 asymmetric per-tensor",
        "weights": f"int8 symmetric {'per-channel' if params.per_channel else 'per-tensor'}, [-{wmax}, {wmax}]",
        "weight_bits": 7 if wmax == 64 else 8,
        "x86_saturation_free": wmax == 64,
        "max_pair_sum": 2 * 255 * wmax,
        "int16_max": 32767,
    }


@dataclass
class Layer:
    """A quantizable node of the (pre-processed) float model, the unit the sensitivity profile works on."""

    name: str
    """Node name in the model `quantize_static` reads (what `nodes_to_quantize` takes)."""
    op_type: str
    module: str
    """Detector module path that produced it (exporter metadata), '' if unknown."""
    weight: str
    """Name of its weight initializer (stable across ORT's pre-processing, unlike some node names)."""
    macs: int | None = None
    """Multiply-accumulates per frame when every dim of its output is static (the cost of keeping it float)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def preprocess(src: str | Path, dst: str | Path) -> tuple[Path, str]:
    """ORT's `quant_pre_process` (symbolic shape inference + basic cleanup) of `src` -> (model to quantize,
    what was done). Skipped, with the reason, on a graph its shape inference gives up on."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
        return Path(dst), "quant_pre_process"
    except Exception as e:  # symbolic shape inference gives up on some graphs: quantize the export as is
        return Path(src), f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _numel_per_frame(model: Any, tensor: str, points: int | None) -> int | None:
    """Elements of `tensor` per frame: static dims multiplied, the symbolic `batch` taken as 1 and `points`
    as the given per-frame point count (ORT's shape inference writes products such as `batch*points`);
    None when a dim is unknown."""
    shapes = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    v = shapes.get(tensor)
    if v is None or not v.type.tensor_type.HasField("shape"):
        return None
    n = 1
    for d in v.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            n *= int(d.dim_value)
            continue
        for factor in (d.dim_param or "?").split("*"):
            if factor == "batch":
                continue
            if factor == "points" and points:
                n *= int(points)
                continue
            return None
    return n


def quantizable_layers(
    export_model: Any, base_model: Any, params: Int8Params, points: int | None = None
) -> tuple[list[Layer], dict[str, str], list[str]]:
    """(layers, forced exclusions {node name: why}, patterns of `exclude_nodes` that matched nothing).

    `layers`: nodes of `params.op_types` in `base_model` (the model quantized) that neither an excluded
    op type nor an `exclude_nodes` pattern removes, in graph order. Module paths live in the export's node
    metadata, which pre-processing drops, so nodes are matched to the export by their weight initializer.
    `points`: the per-frame point count used for the MACs of layers that run per point (the point MLP).
    """
    from pfactory.optimize.export import node_module_paths

    paths = node_module_paths(export_model)
    module_of_weight = {
        n.input[1]: paths.get(n.name, "") for n in export_model.graph.node if n.op_type in params.op_types
    }
    _, forced_export = select_excluded_nodes(
        export_model, params.op_types, params.exclude_op_types, params.exclude_nodes
    )
    forced_weights = {
        n.input[1]: why for n in export_model.graph.node if (why := forced_export.get(n.name)) is not None
    }
    inits = {i.name: i for i in base_model.graph.initializer}
    layers: list[Layer] = []
    forced: dict[str, str] = {}
    for node in base_model.graph.node:
        if node.op_type not in params.op_types or len(node.input) < 2:
            continue
        weight = node.input[1]
        if node.op_type in params.exclude_op_types:
            forced[node.name] = f"op type {node.op_type}"
            continue
        if weight in forced_weights:
            forced[node.name] = forced_weights[weight]
            continue
        macs = None
        w = inits.get(weight)
        out = _numel_per_frame(base_model, node.output[0], points)
        if w is not None and out is not None:
            if node.op_type in ("Conv", "ConvTranspose"):
                k = int(np.prod(w.dims[1:]))  # C_in/groups * kh * kw (ConvTranspose: C_out/groups * kh * kw)
            else:  # Gemm / MatMul: each output element is a dot product over the weight's reduced dim
                k = int(np.prod(w.dims)) // max(1, int(w.dims[0] if _trans_b(node) else w.dims[-1]))
            macs = out * k
        layers.append(Layer(node.name, node.op_type, module_of_weight.get(weight, ""), weight, macs))
    matched = {why.split("matches ")[-1].strip("'") for why in forced.values() if "matches" in why}
    unmatched = [p for p in params.exclude_nodes if p not in matched]
    return layers, forced, unmatched


def _trans_b(node: Any) -> bool:
    return any(a.name == "transB" and a.i == 1 for a in node.attribute)


def _histogram_feeds(feeds: Iterable[Feed]) -> list[Feed]:
    # ORT's histogram calibrators stack each tensor across frames: one shape for all, so every frame is
    # padded to the largest point count (padding rows are ignored by the model). MinMax reduces per frame.
    feeds = list(feeds)
    if not feeds:
        return feeds
    p_max = max(f["points"].shape[1] for f in feeds)
    return [pad_points(f, p_max) for f in feeds]


def calibrate(
    base: str | Path, feeds: Iterable[Feed], method: str, cache_path: str | Path, params: Int8Params,
    work_dir: str | Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Activation ranges of `base` over `feeds` with `method` -> the calibration cache `cache_path`
    (ORT's TensorsData JSON, ranges only); returns {method, frames, tensors, seconds, settings}.

    Calls ORT's calibrators directly (not through `quantize_static`), because `quantize_static` cannot
    set the histogram size and its Entropy default (128 bins = 128 quantized bins) leaves the KL search
    no candidate threshold: it returned exactly the MinMax ranges on the default model. Entropy here
    uses TensorRT's setting (2048 bins, 128 quantized bins); Percentile `params.percentile` of 2048 bins.
    """
    import contextlib
    import io
    import tempfile

    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        TensorData,
        TensorsData,
        create_calibrator,
        save_tensors_data,
    )

    t0 = time.perf_counter()
    settings: dict[str, Any] = {}
    if method == "entropy":
        settings = {"num_bins": 2048, "num_quantized_bins": 128}
    elif method == "percentile":
        settings = {"num_bins": 2048, "percentile": params.percentile}
    feeds = _histogram_feeds(feeds) if method != "minmax" else list(feeds)
    model = onnx_input_names(base)
    reader = _as_reader(feeds, model)
    with tempfile.TemporaryDirectory(prefix=".calib-", dir=str(work_dir) if work_dir else None) as tmp:
        calibrator = create_calibrator(
            Path(base), list(params.op_types), augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=getattr(CalibrationMethod, _METHODS[method]), extra_options=settings,
            providers=["CPUExecutionProvider"],
        )  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):  # its progress prints
            calibrator.collect_data(reader)
            data = calibrator.compute_data()
        del calibrator
    # By tensor name: ORT collects the tensors to calibrate in a set, whose order follows the process's string
    # hash seed, so the cache (an output of the stage, hashed in backend.json and by DVC) differed between two
    # identical runs with the same ranges.
    ranges = {
        name: TensorData(lowest=td.range_value[0], highest=td.range_value[1])
        for name, td in sorted(data.data.items())
    }
    save_tensors_data(TensorsData(data.calibration_method, ranges), Path(cache_path))
    return {
        "method": method,
        "frames": reader.count,
        "tensors": len(ranges),
        "seconds": round(time.perf_counter() - t0, 3),
        "settings": settings,
        "cache": Path(cache_path).name,
    }


def onnx_input_names(path: str | Path) -> list[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def quantize_layers(
    base: str | Path, dst: str | Path, cache_path: str | Path, method: str, params: Int8Params,
    nodes: Iterable[str], for_tensorrt: bool = False,
) -> dict[str, int]:  # fmt: skip
    """QDQ model of `base` with exactly `nodes` quantized, from the calibration cache (no calibration run:
    ~0.05 s on the default model) -> `dst`; returns the op-type counts of `dst`.

    Format: `int8_format(params, for_tensorrt)` (per-channel weights, 7-bit with `reduce_range`),
    recorded in the model's metadata (`INT8_FORMAT_KEY`, `X86_EXACT_KEY`).
    """
    import contextlib
    import io
    import logging

    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    nodes = list(nodes)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    symmetric = for_tensorrt or params.activation_type == "int8"
    fmt = int8_format(params, for_tensorrt)
    if not nodes:  # nothing to quantize: quantize_static would quantize every op type; copy the float model
        model = onnx.load(str(base))
    else:
        level = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # "please use QDQ for S8S8" and similar chatter
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                quantize_static(
                    str(base), str(dst), None, quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=list(params.op_types), nodes_to_quantize=nodes,
                    per_channel=params.per_channel, reduce_range=fmt["weight_bits"] == 7,
                    activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, _METHODS[method]),
                    extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
                    calibration_cache_path=str(cache_path),
                )  # fmt: skip
        finally:
            logging.getLogger().setLevel(level)
        model = onnx.load(str(dst))
    props = {p.key: p.value for p in model.metadata_props}
    props[INT8_FORMAT_KEY] = json.dumps({**fmt, "calibration": method})
    props[X86_EXACT_KEY] = "true" if fmt["x86_saturation_free"] else "false"
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(dst))
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class QuantizeResult:
    """What `quantize_int8` did (recorded in backend.json)."""

    path: str
    method: str
    activation_type: str
    weight_type: str
    symmetric_activations: bool
    per_channel: bool
    op_types: list[str]
    calibration_frames: int
    quantized_nodes: int
    excluded_nodes: dict[str, str]
    unmatched_patterns: list[str]
    preprocess: str
    calibration_cache: str | None
    quantize_s: float
    node_op_types: dict[str, int] = field(default_factory=dict)
    format: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def quantize_int8(
    src: str | Path,
    dst: str | Path,
    feeds: Iterable[Feed],
    params: Int8Params,
    *,
    for_tensorrt: bool = False,
    cache_path: str | Path | None = None,
    work_dir: str | Path | None = None,
    keep_float: Iterable[str] = (),
    method: str | None = None,
) -> QuantizeResult:
    """Static INT8 QDQ quantization of `src` calibrated on `feeds` -> `dst`, in one call.

    Steps: `preprocess`, `quantizable_layers` (minus the forced exclusions and minus `keep_float`, node
    names or weight names, e.g. a sensitivity profile's choice), `calibrate` (skipped when `cache_path`
    already exists: its ranges are reused), `quantize_layers`. `for_tensorrt` forces symmetric int8
    activations and 8-bit weights (TensorRT's explicit-quantization requirement); otherwise the format
    follows `params` (`int8_format`). `method`: the calibration method (default `params.ort_method`;
    "auto" here means its first candidate: the stage's sensitivity step compares them).
    """
    import onnx

    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else dst.parent
    t0 = time.perf_counter()
    method = method or params.ort_method
    if method == "auto":
        method = params.calibration_methods[0]
    pre = work / f".{dst.stem}.preprocessed.onnx"
    try:
        base, how = preprocess(src, pre)
        layers, excluded, unmatched = quantizable_layers(onnx.load(str(src)), onnx.load(str(base)), params)
        keep = set(keep_float)
        for layer in layers:
            if layer.name in keep or layer.weight in keep:
                excluded[layer.name] = "kept float (sensitivity)"
        nodes = [layer.name for layer in layers if layer.name not in excluded]
        cache = Path(cache_path) if cache_path else work / f".{dst.stem}.calibration.json"
        calib = None
        if not cache.is_file():
            calib = calibrate(base, feeds, method, cache, params, work)
        counts = quantize_layers(base, dst, cache, method, params, nodes, for_tensorrt)
    finally:
        if pre.exists():
            os.unlink(pre)
        if not cache_path:
            (work / f".{dst.stem}.calibration.json").unlink(missing_ok=True)
    fmt = int8_format(params, for_tensorrt)
    return QuantizeResult(
        path=dst.name,
        method=method,
        activation_type="int8" if fmt["activations"].startswith("int8") else "uint8",
        weight_type="int8",
        symmetric_activations=fmt["activations"].startswith("int8"),
        per_channel=params.per_channel,
        op_types=list(params.op_types),
        calibration_frames=calib["frames"] if calib else 0,
        quantized_nodes=len(nodes),
        excluded_nodes=excluded,
        unmatched_patterns=unmatched,
        preprocess=how,
        calibration_cache=cache.name if cache_path and cache.exists() else None,
        quantize_s=round(time.perf_counter() - t0, 3),
        node_op_types=counts,
        format=fmt,
        calibration=calib,
    )
