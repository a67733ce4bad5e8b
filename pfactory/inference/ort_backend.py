"""ONNX Runtime backend: graph-optimized FP32 model, INT8 static QDQ quantization, sessions.

In:  `model.onnx` (pfactory.inference.export), calibration feeds (dicts of numpy inputs), `Int8Params`.
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
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.inference.calibration import pad_points
from pfactory.inference.errors import BackendUnavailable
from pfactory.inference.params import Int8Params

Feed = dict[str, np.ndarray]


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
) -> Any:
    """An InferenceSession for `path` with every graph optimization on (sequential executor unless
    `inter_op_threads` > 1: `session_options`)."""
    import onnxruntime as ort

    return ort.InferenceSession(
        str(path),
        session_options(intra_op_threads, "all", spin, inter_op_threads),
        providers=providers_for(device),
    )


def write_rewritten(src: str | Path, dst: str | Path) -> dict[str, Any]:
    """`src` through `graph_rewrite.rewrite_for_ort` (exact, faster ORT ops) saved to `dst`; returns the report."""
    import onnx

    from pfactory.inference.graph_rewrite import rewrite_for_ort

    model, report = rewrite_for_ort(onnx.load(str(src)))
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
    from pfactory.inference.export import node_module_paths

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
) -> QuantizeResult:
    """Static INT8 QDQ quantization of `src` calibrated on `feeds` -> `dst`.

    Steps: ORT's `quant_pre_process` (symbolic shape inference + basic graph cleanup, recommended
    before quantizing; skipped with the reason recorded if it fails on a graph), node selection,
    `quantize_static` (QDQ, per-channel weights). `for_tensorrt` forces symmetric int8 activations
    and weights (TensorRT's explicit-quantization requirement); otherwise activations follow
    `params.activation_type` (uint8: ORT's x86 fast path). `cache_path`: JSON tensor ranges, written on
    the first calibration and reused (no calibration run) when it already exists.
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else dst.parent
    t0 = time.perf_counter()

    pre = work / f".{dst.stem}.preprocessed.onnx"
    try:
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=False)
        base, preprocess = pre, "quant_pre_process"
    except Exception as e:  # symbolic shape inference gives up on some graphs: quantize the export as is
        base, preprocess = (
            src,
            f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
        )

    # Module paths live in the export's node metadata, which pre-processing drops while keeping node
    # names (measured: 328 of 329 names kept), so select on the export and keep the names still present.
    model = onnx.load(str(base))
    present = {n.name for n in model.graph.node}
    _, excluded = select_excluded_nodes(
        onnx.load(str(src)), params.op_types, params.exclude_op_types, params.exclude_nodes
    )
    excluded = {k: v for k, v in excluded.items() if k in present}
    excluded_names = sorted(excluded)
    matched_patterns = {why.split("matches ")[-1].strip("'") for why in excluded.values() if "matches" in why}
    unmatched = [p for p in params.exclude_nodes if p not in matched_patterns]

    input_names = [i.name for i in model.graph.input]
    if params.ort_method != "minmax":
        # ORT's histogram calibrators stack each tensor across frames: one shape for all, so pad every
        # frame to the largest point count (padding rows are ignored by the model). MinMax reduces per
        # frame and takes any shape.
        feeds = list(feeds)
        if feeds:
            p_max = max(f["points"].shape[1] for f in feeds)
            feeds = [pad_points(f, p_max) for f in feeds]
    reader = _as_reader(feeds, input_names)
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[params.ort_method]  # fmt: skip
    symmetric = for_tensorrt or params.activation_type == "int8"
    act = QuantType.QInt8 if symmetric else QuantType.QUInt8
    extra = {
        "ActivationSymmetric": symmetric,
        "WeightSymmetric": True,
        # Calibration runs the model once per feed with every calibrated tensor as an extra output;
        # fine for the ~32 frames used here.
    }
    cache = Path(cache_path) if cache_path else None
    try:
        quantize_static(
            str(base),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(params.op_types),
            per_channel=params.per_channel,
            activation_type=act,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded_names,
            calibrate_method=method,
            extra_options=extra,
            calibration_cache_path=str(cache) if cache else None,
        )
    finally:
        if pre.exists():
            os.unlink(pre)
    out = onnx.load(str(dst))
    counts: dict[str, int] = {}
    for n in out.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    quantized = sum(1 for n in model.graph.node if n.op_type in params.op_types and n.name not in excluded)
    return QuantizeResult(
        path=dst.name,
        method=params.ort_method,
        activation_type="int8" if symmetric else "uint8",
        weight_type="int8",
        symmetric_activations=symmetric,
        per_channel=params.per_channel,
        op_types=list(params.op_types),
        calibration_frames=reader.count,
        quantized_nodes=quantized,
        excluded_nodes=excluded,
        unmatched_patterns=unmatched,
        preprocess=preprocess,
        calibration_cache=cache.name if cache and cache.exists() else None,
        quantize_s=round(time.perf_counter() - t0, 3),
        node_op_types=dict(sorted(counts.items())),
    )


def describe_session(session: Any) -> dict[str, Any]:
    """Providers and I/O of a session (for backend.json)."""
    return {
        "providers": session.get_providers(),
        "inputs": [{"name": i.name, "type": i.type, "shape": i.shape} for i in session.get_inputs()],
        "outputs": [{"name": o.name, "type": o.type, "shape": o.shape} for o in session.get_outputs()],
    }
