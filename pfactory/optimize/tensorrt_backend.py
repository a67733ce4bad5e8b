"""TensorRT backend: FP16 / INT8 engines from `model.onnx`, calibration, timing cache, engine metadata.

In:  `model.onnx` (and, for INT8 on TensorRT >= 11, the symmetric-int8 QDQ model), `OptimizeParams`,
     calibration feeds (dicts of numpy inputs). Needs `tensorrt` and a CUDA GPU to *build and run*; the
     PyPI wheels come from NVIDIA's own index, so it is an optional extra (`pip install '.[tensorrt]'`),
     never a CI requirement.
Out: `tensorrt/model.<precision>.plan`, `tensorrt/timing.cache`, `tensorrt/calibration.cache` (INT8 with
     implicit calibration), and the engine metadata (TensorRT version, GPU, compute capability, CUDA,
     I/O tensors, optimization profile) recorded in backend.json.

Two TensorRT generations, one spec (`engine_spec`, pure Python, unit-tested without TensorRT):
- TensorRT <= 10 (weakly typed): FP16 = BuilderFlag.FP16; INT8 = BuilderFlag.INT8 (+ FP16 fallback) with
  an implicit calibrator, `IInt8EntropyCalibrator2` or `IInt8MinMaxCalibrator` (`optimize.int8.calibrator`),
  its cache kept; the layers the sensitivity profile keeps float (`onnxruntime/sensitivity.json`, the same
  choice as ONNX Runtime's INT8) and `optimize.int8.exclude_nodes` are pinned to FP16 layers.
  (Implicit calibration is deprecated since 10.1.)
- TensorRT >= 11 removed the precision flags and the calibrators (strong typing only: docs.nvidia.com,
  "Migrating from TensorRT 10.x to 11.x"): FP16 = the ONNX model cast to FP16 (ORT's float16 converter,
  precision-sensitive op types kept FP32); INT8 = explicit quantization from the QDQ model built the same
  way as ONNX Runtime's INT8 but with symmetric int8 activations and 8-bit weights, calibrated with
  `calibrator`'s method, the same sensitivity-chosen layers left unquantized, and its float part cast to
  FP16 (Q/DQ and `fp16_keep_fp32_op_types` kept FP32): those layers run in FP16.
Both: an optimization profile over batch and padded point count (min/opt/max from `optimize.tensorrt`),
the workspace limit, the builder optimization level and a timing cache reused across builds.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.optimize.calibration import pad_points as fix_points
from pfactory.optimize.errors import BackendUnavailable, OptimizeError
from pfactory.optimize.export import INPUT_NAMES, OUTPUT_NAMES, TensorSpec
from pfactory.optimize.feed import Feed
from pfactory.optimize.params import OptimizeParams
from pfactory.optimize.runner import Runner

PLAN = "model.{precision}.plan"
TIMING_CACHE = "timing.cache"
CALIBRATION_CACHE = "calibration.cache"


class OnnxSource(str, enum.Enum):
    """Which ONNX file the engine is parsed from."""

    FP32 = "fp32"  # model.onnx as exported
    FP16_CAST = "fp16_cast"  # model.onnx cast to FP16 (TensorRT >= 11, strongly typed)
    INT8_QDQ = "int8_qdq"  # symmetric-int8 QDQ model (TensorRT >= 11, explicit quantization)


def trt_major(version: str) -> int:
    """Major version of a TensorRT version string ("10.3.0.26" -> 10)."""
    try:
        return int(str(version).split(".")[0])
    except ValueError as e:
        raise ValueError(f"unparseable TensorRT version {version!r}") from e


@dataclass
class EngineSpec:
    """Everything that configures one engine build; built by `engine_spec`, applied by `apply_spec`."""

    precision: str
    tensorrt_version: str
    strongly_typed: bool
    onnx_source: str
    flags: list[str]
    calibrator: str | None
    workspace_bytes: int
    optimization_level: int
    profile: dict[str, tuple[list[int], list[int], list[int]]]
    calibration_profile: dict[str, tuple[list[int], list[int], list[int]]] | None
    calibration_points: int
    fp16_layers: list[str] = field(default_factory=list)
    """ONNX node names whose layers are pinned to FP16 in an INT8 build (TensorRT <= 10): the layers the
    sensitivity profile keeps float."""
    timing_cache: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _static_dims(spec: TensorSpec) -> list[int]:
    """The non-batch dims of an input, with the point dim marked -1."""
    return [d if isinstance(d, int) else -1 for d in spec.shape[1:]]


def engine_spec(
    params: OptimizeParams,
    precision: str,
    tensorrt_version: str,
    inputs: list[TensorSpec],
    max_batch: int,
    fp16_layers: list[str] | None = None,
) -> EngineSpec:
    """The build spec of a `precision` engine for TensorRT `tensorrt_version` (module docstring).

    `inputs`: the export's input specs (fixed camera count and image size; dynamic batch/points).
    `max_batch`: largest batch of the profile (1 when the export has a fixed batch).
    `fp16_layers`: ONNX node names kept out of INT8, in FP16, on TensorRT <= 10 (layer names = node names);
    `sensitivity_fp16_layers` derives them from the sensitivity report.
    """
    if precision not in ("fp32", "fp16", "int8"):
        raise ValueError(f"TensorRT precision must be fp32 | fp16 | int8, got {precision!r}")
    major = trt_major(tensorrt_version)
    tp = params.tensorrt
    by_name = {s.name: s for s in inputs}
    names = [n for n in INPUT_NAMES if n in by_name]  # the graph's own: a prefix of INPUT_NAMES
    if names != list(INPUT_NAMES[: max(2, len(names))]) or len(by_name) != len(names):
        raise ValueError(f"export inputs {sorted(by_name)}: expected a prefix of {list(INPUT_NAMES)}")
    fixed_batch = isinstance(by_name["points"].shape[0], int)
    b_min, b_opt, b_max = (1, 1, 1) if fixed_batch else (1, 1, max(1, max_batch))

    def shapes(
        p_min: int, p_opt: int, p_max: int, bounds: tuple[int, int, int]
    ) -> dict[str, tuple[list[int], list[int], list[int]]]:
        out = {}
        for name in names:
            rest = _static_dims(by_name[name])
            mn, op, mx = [], [], []
            for b, p, target in ((bounds[0], p_min, mn), (bounds[1], p_opt, op), (bounds[2], p_max, mx)):
                target.extend([b, *[p if d == -1 else d for d in rest]])
            out[name] = (mn, op, mx)
        return out

    profile = shapes(tp.min_points, tp.opt_points, tp.max_points, (b_min, b_opt, b_max))
    flags: list[str] = []
    calibrator: str | None = None
    calibration_profile = None
    source = OnnxSource.FP32
    strongly_typed = major >= 11
    layers: list[str] = []
    if major >= 11:
        # Strong typing: the precision is in the ONNX file, not in builder flags (removed in 11).
        if precision == "fp16":
            source = OnnxSource.FP16_CAST
        elif precision == "int8":
            source = OnnxSource.INT8_QDQ
    elif precision == "fp16":
        flags = ["FP16"]
    elif precision == "int8":
        # FP16 as well: layers TensorRT cannot (or should not) run in INT8 fall back to FP16, not FP32.
        flags = ["INT8", "FP16"]
        calibrator = params.int8.calibrator
        # Implicit calibration of a dynamic-shape network runs at one fixed shape: the calibration
        # profile (batch 1, opt_points); `CalibrationBatches` pads/truncates every frame to it.
        calibration_profile = shapes(tp.opt_points, tp.opt_points, tp.opt_points, (1, 1, 1))
        layers = sorted(fp16_layers or [])
        if layers:
            flags.append("PREFER_PRECISION_CONSTRAINTS")
    return EngineSpec(
        precision=precision,
        tensorrt_version=str(tensorrt_version),
        strongly_typed=strongly_typed,
        onnx_source=source.value,
        flags=flags,
        calibrator=calibrator,
        workspace_bytes=int(tp.workspace_gib * (1 << 30)),
        optimization_level=tp.optimization_level,
        profile=profile,
        calibration_profile=calibration_profile,
        calibration_points=tp.opt_points,
        fp16_layers=layers,
        timing_cache=tp.timing_cache,
    )


def apply_spec(
    trt: Any, builder: Any, network: Any, config: Any, spec: EngineSpec, calibrator: Any = None,
    timing_cache: bytes | None = None,
) -> Any:  # fmt: skip
    """Configure `config` (an IBuilderConfig) for `spec`; returns the timing cache object attached (or None).

    Only calls documented TensorRT Python API (IBuilderConfig.set_flag / set_memory_pool_limit /
    builder_optimization_level / add_optimization_profile / int8_calibrator / set_calibration_profile /
    create_timing_cache / set_timing_cache, ILayer.precision / set_output_type), so it runs against a
    recording fake in the tests.
    """
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_bytes)
    config.builder_optimization_level = spec.optimization_level
    for flag in spec.flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))

    profile = builder.create_optimization_profile()
    for name, (mn, opt, mx) in spec.profile.items():
        profile.set_shape(name, mn, opt, mx)
    config.add_optimization_profile(profile)

    if spec.calibrator is not None:
        if calibrator is None:
            raise ValueError(f"spec asks for the {spec.calibrator} calibrator but none was given")
        config.int8_calibrator = calibrator
        if spec.calibration_profile is not None:
            cal = builder.create_optimization_profile()
            for name, (mn, opt, mx) in spec.calibration_profile.items():
                cal.set_shape(name, mn, opt, mx)
            config.set_calibration_profile(cal)

    if spec.fp16_layers:
        # TensorRT's ONNX parser names a layer after its node (sometimes with a suffix): prefix match.
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if any(
                layer.name == n or layer.name.startswith(n + "_") or layer.name.startswith(n + " ")
                for n in spec.fp16_layers
            ):
                layer.precision = trt.float16
                for j in range(layer.num_outputs):
                    layer.set_output_type(j, trt.float16)

    cache = None
    if spec.timing_cache:
        cache = config.create_timing_cache(timing_cache or b"")
        config.set_timing_cache(cache, False)  # ignore_mismatch=False: a cache from another GPU is refused
    return cache


def _torch_to_device() -> Callable[[np.ndarray], tuple[int, Any]]:
    """Host array -> (device pointer, owner) using torch CUDA tensors (no pycuda/cuda-python needed)."""
    import torch

    def to_device(a: np.ndarray) -> tuple[int, Any]:
        t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
        return int(t.data_ptr()), t

    return to_device


class CalibrationBatches:
    """The data side of a TensorRT INT8 calibrator, free of TensorRT (so it is unit-testable).

    Feeds come one batch at a time from `feeds`; `get_batch(names)` copies the next one (points fixed to
    `points` rows) to the device and returns one device pointer per requested input name, in order,
    or None when exhausted (TensorRT's contract). Device buffers of the current batch are kept alive
    until the next call. The calibration cache is read from / written to `cache_path`.
    """

    def __init__(
        self,
        feeds: Iterable[Feed],
        points: int,
        cache_path: str | Path | None = None,
        to_device: Callable[[np.ndarray], tuple[int, Any]] | None = None,
        batch_size: int = 1,
    ) -> None:
        self._feeds = feeds
        self._it: Iterator[Feed] | None = None
        self.points = int(points)
        self.cache_path = Path(cache_path) if cache_path else None
        self._to_device = to_device
        self.batch_size = int(batch_size)
        self._held: list[Any] = []
        self.batches_served = 0

    def get_batch_size(self) -> int:
        return self.batch_size

    def get_batch(self, names: list[str]) -> list[int] | None:
        if self._it is None:
            self._it = iter(self._feeds)
        feed = next(self._it, None)
        if feed is None:
            self._held = []
            return None
        if feed["points"].shape[0] != self.batch_size:
            raise ValueError(
                f"calibration feed has batch {feed['points'].shape[0]}, calibrator batch is {self.batch_size}"
            )
        feed = fix_points(feed, self.points)
        unknown = [n for n in names if n not in feed]
        if unknown:
            raise KeyError(f"TensorRT asked for inputs {unknown}; feeds have {sorted(feed)}")
        to_device = self._to_device or _torch_to_device()
        ptrs, held = [], []
        for n in names:
            ptr, owner = to_device(feed[n])
            ptrs.append(ptr)
            held.append(owner)
        self._held = held  # keep this batch's buffers alive while TensorRT reads them
        self.batches_served += 1
        return ptrs

    def read_calibration_cache(self) -> bytes | None:
        if self.cache_path is not None and self.cache_path.is_file():
            return self.cache_path.read_bytes()
        return None

    def write_calibration_cache(self, cache: Any) -> None:
        if self.cache_path is not None:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            self.cache_path.write_bytes(bytes(cache))


def make_calibrator(trt: Any, kind: str, batches: CalibrationBatches) -> Any:
    """A TensorRT calibrator object (`kind` "entropy" -> IInt8EntropyCalibrator2, "minmax" ->
    IInt8MinMaxCalibrator) delegating to `batches`. TensorRT <= 10 only."""
    bases = {"entropy": "IInt8EntropyCalibrator2", "minmax": "IInt8MinMaxCalibrator"}
    if kind not in bases:
        raise ValueError(f"calibrator must be entropy | minmax, got {kind!r}")
    base = getattr(trt, bases[kind], None)
    if base is None:
        raise BackendUnavailable(
            f"this TensorRT has no {bases[kind]} (removed in TensorRT 11: use the QDQ path)"
        )

    class _Calibrator(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)  # pybind11 classes need the explicit base constructor
            self.batches = batches

        def get_batch_size(self) -> int:
            return self.batches.get_batch_size()

        def get_batch(self, names: list[str]) -> list[int] | None:
            return self.batches.get_batch(names)

        def read_calibration_cache(self) -> bytes | None:
            return self.batches.read_calibration_cache()

        def write_calibration_cache(self, cache: Any) -> None:
            self.batches.write_calibration_cache(cache)

    return _Calibrator()


def sensitivity_fp16_layers(
    export_model: Any, report: dict[str, Any] | None, exclude_nodes: list[str]
) -> list[str]:
    """Node names of `export_model` (what TensorRT parses) kept out of INT8 in FP16: the layers the
    sensitivity report keeps float (matched by weight initializer: ORT's pre-processing renames some
    nodes) plus the nodes matching the `exclude_nodes` patterns. ORT-specific op-type exclusions
    (`exclude_op_types`: no int8 ConvTranspose kernel on ORT's CPU EP) do not apply to TensorRT."""
    from pfactory.optimize.ort_backend import select_excluded_nodes

    kept_weights = set()
    if report is not None:
        by_name = {layer["name"]: layer for layer in report.get("layers", [])}
        kept_weights = {by_name[n]["weight"] for n in report.get("kept_float", []) if n in by_name}
    names = {n.name for n in export_model.graph.node if len(n.input) > 1 and n.input[1] in kept_weights}
    if exclude_nodes:
        op_types = sorted({n.op_type for n in export_model.graph.node})
        names |= set(select_excluded_nodes(export_model, op_types, [], exclude_nodes)[0])
    return sorted(names)


def cast_onnx_fp16(
    src: str | Path, dst: str | Path, keep_fp32_op_types: list[str], model: Any = None
) -> Path:
    """`src` with float tensors and weights cast to FP16, I/O kept FP32 and `keep_fp32_op_types` in FP32
    (ONNX Runtime's converter; what TensorRT >= 11's strongly typed FP16 build parses)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(
        model if model is not None else onnx.load(str(src)),
        keep_io_types=True,
        op_block_list=list(keep_fp32_op_types),
    )
    # The converter appends its input casts at the end of the node list; ONNX needs topological order.
    _toposort(model.graph)
    onnx.checker.check_model(model)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return dst


def _toposort(graph: Any) -> None:
    """Reorder `graph.node` in place so every node comes after the producers of its inputs (Kahn)."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending = list(graph.node)
    ordered = []
    while pending:
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise OptimizeError(f"graph has a cycle or undefined inputs at {[n.name for n in rest[:3]]}")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def import_tensorrt() -> Any:
    """`tensorrt`, or BackendUnavailable with the install hint."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailable(
            "TensorRT is not installed: pip install '.[tensorrt]' on a machine with an NVIDIA GPU "
            "(the wheels come from NVIDIA's index)"
        ) from e
    return trt


def engine_metadata(trt: Any, plan: bytes | None = None) -> dict[str, Any]:
    """TensorRT version, GPU, compute capability, CUDA version, and the engine's I/O tensors."""
    import torch

    meta: dict[str, Any] = {"tensorrt_version": trt.__version__, "cuda_runtime": torch.version.cuda}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["compute_capability"] = ".".join(str(v) for v in torch.cuda.get_device_capability(0))
    if plan is not None:
        engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
        tensors = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            tensors.append({
                "name": name,
                "mode": "input" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output",
                "dtype": str(engine.get_tensor_dtype(name)),
                "shape": list(engine.get_tensor_shape(name)),
            })  # fmt: skip
        meta["io_tensors"] = tensors
    return meta


def build_engine(
    onnx_path: str | Path,
    spec: EngineSpec,
    out_dir: str | Path,
    calibration_feeds: Iterable[Feed] | None = None,
    previous_timing_cache: str | Path | None = None,
    reference_onnx: str | Path | None = None,
    check_feeds: list[Feed] | None = None,
) -> dict[str, Any]:
    """Build `spec`'s engine from `onnx_path` into `out_dir` (plan + caches) and run its self-check; returns
    its manifest entry, the verdict under "selfcheck" ({path, status, reason, figures, key}).

    Needs `tensorrt` and CUDA. `previous_timing_cache`: a timing cache from an earlier build on the same
    GPU/TensorRT (e.g. the last optimized directory's), reused to cut build time. The self-check
    (`verify_engine`) runs the engine against ONNX Runtime FP32 on `reference_onnx` (default: the export
    `model.onnx` beside `out_dir`, as in an optimized directory, else `onnx_path`) with `check_feeds`
    (default: the first two calibration feeds when given as a list, else `synthetic_feeds` at the
    profile's opt shapes with at most 4096 points); the optimize stage passes its export and the first
    two held-out parity feeds. A failed verdict is said in one warning line and recorded; this function
    keeps the engine file: the optimize stage (`optimize.refuse_failed_engine`, on `selfcheck_failure`)
    deletes it and ships the next artifact that passes, and `open_engine` (what `runtime.open_runner`
    opens an engine with) runs ONNX Runtime FP32 in place of a failed engine opened elsewhere.
    """
    trt = import_tensorrt()
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("TensorRT engines need a CUDA GPU; none is visible")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if spec.strongly_typed and strongly is not None:
        flags |= 1 << int(strongly)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise OptimizeError(f"TensorRT could not parse {onnx_path}:\n  " + "\n  ".join(errors))
    config = builder.create_builder_config()

    calibrator = None
    batches = None
    if spec.calibrator is not None:
        if calibration_feeds is None:
            raise ValueError("INT8 with implicit calibration needs calibration feeds")
        batches = CalibrationBatches(calibration_feeds, spec.calibration_points, out_dir / CALIBRATION_CACHE)
        calibrator = make_calibrator(trt, spec.calibrator, batches)
    cache_in = None
    if spec.timing_cache and previous_timing_cache and Path(previous_timing_cache).is_file():
        cache_in = Path(previous_timing_cache).read_bytes()
    cache = apply_spec(trt, builder, network, config, spec, calibrator, cache_in)

    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise OptimizeError(f"TensorRT failed to build the {spec.precision} engine (see its log above)")
    build_s = time.perf_counter() - t0
    plan_bytes = bytes(plan)
    plan_path = out_dir / PLAN.format(precision=spec.precision)
    plan_path.write_bytes(plan_bytes)
    if cache is not None:
        (out_dir / TIMING_CACHE).write_bytes(bytes(cache.serialize()))
    if reference_onnx is None:
        from pfactory.optimize.manifest import ONNX_FILE

        sibling = out_dir.parent / ONNX_FILE
        reference_onnx = sibling if sibling.is_file() else onnx_path
    if check_feeds is None and isinstance(calibration_feeds, list) and calibration_feeds:
        check_feeds = calibration_feeds[:2]
    if check_feeds is None:
        shapes = {name: list(opt) for name, (lo, opt, _) in spec.profile.items()}
        shapes["points"][1] = max(spec.profile["points"][0][1], min(shapes["points"][1], 4096))
        check_feeds = synthetic_feeds(shapes)
    device = torch.device("cuda", torch.cuda.current_device())
    verdict = verify_engine(plan_path, reference_onnx, spec.precision, device, check_feeds)
    return {
        "file": plan_path.name,
        "build_s": round(build_s, 3),
        "spec": spec.to_json(),
        "calibration_batches": batches.batches_served if batches else None,
        "metadata": engine_metadata(trt, plan_bytes),
        "selfcheck": selfcheck_record(verdict),
    }


def selfcheck_record(verdict: Any) -> dict[str, Any]:
    """An engine's manifest entry "selfcheck" from its `verify_engine` verdict: {path, status, reason,
    figures, key}."""
    return {"path": ENGINE_PATH, **{k: getattr(verdict, k) for k in ("status", "reason", "figures", "key")}}


def selfcheck_failure(entry: dict[str, Any]) -> str | None:
    """Why the engine of a `build_engine` manifest entry is not trusted: "self-check vs ONNX Runtime FP32
    failed: <reason>" when its recorded verdict is failed; None when verified or skipped (no CUDA check
    could run: the optimize stage's parity gate still judges it)."""
    from kernels import selfcheck

    check = entry.get("selfcheck") or {}
    if check.get("status") != selfcheck.FAILED:
        return None
    return f"self-check vs ONNX Runtime FP32 failed: {check.get('reason') or 'no reason recorded'}"


class TensorRTRunner(Runner):
    """A TensorRT engine on a CUDA device, behind the common runner call (pfactory.optimize.runtime)."""

    backend = "tensorrt"

    def __init__(self, plan_path: str | Path, precision: str, device: str = "cuda") -> None:
        trt = import_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable("TensorRT engines need a CUDA GPU; none is visible")
        self.trt = trt
        self.precision = precision
        self.device = device if device.startswith("cuda") else "cuda"
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            Path(plan_path).read_bytes()
        )
        if self.engine is None:
            raise OptimizeError(
                f"{plan_path}: TensorRT could not deserialize the engine (other TensorRT version or GPU?)"
            )
        self.context = self.engine.create_execution_context()
        engine, trt = self.engine, self.trt
        io = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        # The engine's own inputs, in INPUT_NAMES order (a lidar-only graph takes points and num_points).
        self.input_names = [
            n for n in INPUT_NAMES if n in io and engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT
        ]

    def run(self, feed: Feed) -> dict[str, np.ndarray]:
        import torch

        trt = self.trt
        held = {}
        for name in self.input_names:
            want = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            t = torch.from_numpy(np.ascontiguousarray(feed[name], dtype=want)).to(self.device)
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, int(t.data_ptr()))
            held[name] = t
        outs = {}
        for name in OUTPUT_NAMES:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            outs[name] = torch.from_numpy(np.empty(shape, dtype=dtype)).to(self.device)
            self.context.set_tensor_address(name, int(outs[name].data_ptr()))
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise OptimizeError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        del held  # inputs stay alive until the engine is done with them
        return {
            "boxes": outs["boxes"].float().cpu().numpy(),
            "scores": outs["scores"].float().cpu().numpy(),
            "labels": outs["labels"].long().cpu().numpy(),
        }

    def check_shapes(self, points: int = 4096) -> dict[str, list[int]]:
        """Input shapes a self-check feeds: the optimization profile's opt point (profile 0), the point
        count lowered to `points` where the profile allows (small inputs)."""
        shapes = {}
        for n in self.input_names:
            lo, opt, _ = (list(s) for s in self.engine.get_tensor_profile_shape(n, 0))
            if n == "points":
                opt[1] = max(lo[1], min(opt[1], points))
            shapes[n] = opt
        return shapes


# --------------------------------------------------------------------------------------------------
# the engine's self-check (kernels/selfcheck.py): an engine is trusted once it computes what its ONNX
# graph computes in ONNX Runtime FP32, on this GPU
# --------------------------------------------------------------------------------------------------
ENGINE_PATH = "tensorrt.engine"
SCORE_FLOOR = 0.3
"""Reference detections compared box by box: score >= this (a confident peak; lower ones can swap with a
neighbouring cell under rounding, which the sorted-scores figure covers)."""
ENGINE_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (5e-3, 0.02),  # TF32 convolutions (TensorRT's default on Ampere and later)
    "fp16": (2e-2, 0.1),
    "int8": (0.1, 0.5),  # calibration error; the optimize stage's parity gate judges quality
}
"""precision -> (max |err| of the sorted scores, max |err| in m of a matched box's centre and size)."""


def tensorrt_missing() -> str | None:
    """Why TensorRT cannot be used here ("TensorRT is not installed ..."), or None when it imports."""
    try:
        import_tensorrt()
    except BackendUnavailable as e:
        return str(e)
    return None


def _trt_version() -> str:
    try:
        return str(import_tensorrt().__version__)
    except BackendUnavailable:
        return "not installed"


def synthetic_feeds(shapes: dict[str, list[int]], frames: int = 2, seed: int = 0) -> list[Feed]:
    """`frames` seeded feeds of the given input shapes (points/num_points, plus images/proj for a camera
    graph): points spread over x 0..50 m, y -25..25 m, z -2.5..0.5 m (a share lands in any detector's
    range), unit-normal images, a forward pinhole camera. What an engine's self-check runs when no real
    frames are given."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(frames):
        b, p, c = shapes["points"]
        pts = rng.random((b, p, c), dtype=np.float32)
        pts[..., :3] = pts[..., :3] * np.float32([50.0, 50.0, 3.0]) + np.float32([0.0, -25.0, -2.5])
        feed: Feed = {"points": pts, "num_points": np.full((b,), p, np.int64)}
        feed["num_points"][-1] = max(1, p // 2)  # a half-full frame: padding is exercised
        if "images" in shapes:
            bi, n, ch, h, w = shapes["images"]
            feed["images"] = rng.standard_normal((bi, n, ch, h, w), dtype=np.float32)
            k = np.array([[0.7 * w, 0, w / 2], [0, 0.7 * w, h / 2], [0, 0, 1]], np.float32)
            r = np.array([[0, -1, 0, 0], [0, 0, -1, 0], [1, 0, 0, 0]], np.float32)  # lidar -> camera axes
            feed["proj"] = np.ascontiguousarray(np.broadcast_to(k @ r, (bi, n, 3, 4)), dtype=np.float32)
        out.append(feed)
    return out


def compare_engine_outputs(
    figures: dict[str, float], precision: str, frame: int, got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
) -> None:  # fmt: skip
    """Add the figures of one feed's outputs (`got`: the engine's, `want`: ONNX Runtime FP32's) to `figures`
    and raise `selfcheck.Mismatch` past `ENGINE_TOLERANCES[precision]`:

    `<precision> scores`  max |difference| of each frame's K scores sorted descending (stable under rank
                          swaps of near-equal detections; any wrong heatmap moves it);
    `<precision> boxes`   for every reference detection scoring >= SCORE_FLOOR, max |difference| of centre
                          and size (m) against the nearest engine detection of the same label (yaw is
                          left out: a near-square box may flip it); no such detection: infinite."""
    from kernels import selfcheck

    tol_s, tol_b = ENGINE_TOLERANCES[precision]
    gs, ws = np.asarray(got["scores"], np.float64), np.asarray(want["scores"], np.float64)
    if gs.shape != ws.shape:
        figures[f"{precision} scores"] = float("inf")
        raise selfcheck.Mismatch(f"frame {frame}: scores shape {gs.shape} != {ws.shape}", figures)
    sorted_err = np.abs(-np.sort(-gs, axis=-1) - -np.sort(-ws, axis=-1))
    sorted_err = np.where(np.isnan(sorted_err), np.inf, sorted_err)
    box_err = 0.0
    for b in range(ws.shape[0]):
        gb, wb = np.asarray(got["boxes"][b], np.float64), np.asarray(want["boxes"][b], np.float64)
        gl, wl = np.asarray(got["labels"][b]), np.asarray(want["labels"][b])
        for i in np.flatnonzero(ws[b] >= SCORE_FLOOR):
            same = np.flatnonzero((gl == wl[i]) & (gs[b] > 0))
            if same.size == 0:
                box_err = float("inf")
                break
            j = same[np.argmin(np.linalg.norm(gb[same, :2] - wb[i, :2], axis=-1))]
            err = float(np.abs(gb[j, :6] - wb[i, :6]).max())
            box_err = max(box_err, err if np.isfinite(err) else float("inf"))
    errors = {"scores": (float(sorted_err.max(initial=0.0)), tol_s), "boxes": (box_err, tol_b)}
    for name, (err, _) in errors.items():
        figures[f"{precision} {name}"] = max(figures.get(f"{precision} {name}", 0.0), err)
    for name, (err, tol) in errors.items():
        if not err <= tol:
            raise selfcheck.Mismatch(
                f"{precision} {name}: max|err| {err:.3g} > tol {tol:.3g} (frame {frame})", figures
            )


def _ort_fp32(reference_onnx: Path) -> Callable[[Feed], dict[str, np.ndarray]]:
    """The reference: the FP32 ONNX graph in an ONNX Runtime CPU session (its own inputs of the feed)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(reference_onnx), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(feed: Feed) -> dict[str, np.ndarray]:
        return dict(zip(OUTPUT_NAMES, session.run(list(OUTPUT_NAMES), {n: feed[n] for n in names})))

    return run


def engine_fingerprint(plan_path: str | Path, reference_onnx: str | Path, version: str) -> str:
    """What an engine's verdict holds for besides the machine: the TensorRT version, the engine's and the
    reference ONNX graph's sha256 (16 hex each) and this module's (the check's code)."""
    from kernels import selfcheck

    return (
        f"tensorrt {version}; engine {selfcheck.sources_hash([plan_path])}; "
        f"onnx {selfcheck.sources_hash([reference_onnx])}; check {selfcheck.sources_hash([__file__])}"
    )


def verify_engine(
    plan_path: str | Path,
    reference_onnx: str | Path,
    precision: str,
    device: Any = "cuda",
    feeds: list[Feed] | None = None,
    engine: Callable[[], Runner] | None = None,
    version: str | None = None,
    device_types: tuple[str, ...] = ("cuda",),
) -> Any:
    """The self-check verdict (`kernels.selfcheck.Verdict`) of the engine `plan_path` on `device`: its
    outputs vs ONNX Runtime FP32 running `reference_onnx` (the graph it was built from, before any FP16 cast
    or quantization) on `feeds` (default: `synthetic_feeds` at the engine profile's opt shapes, at most 4096
    points), within `ENGINE_TOLERANCES[precision]`. Recorded under path `tensorrt.engine` and a key of the
    machine (device, driver, CUDA, torch, Triton) and `engine_fingerprint` (TensorRT version, engine and
    ONNX hashes): once per engine and machine, read back afterwards.

    `engine`: opens the runner under test (default `TensorRTRunner(plan_path, precision, device)`) and
    `version` its version (default TensorRT's); `device_types` the devices the check applies to. A failed
    verdict says so in one warning line per engine and process (logger `pfk.selfcheck`), naming the path,
    the plan file and the figures. TensorRT or CUDA missing: skipped."""
    from kernels import selfcheck

    plan_path, reference_onnx = Path(plan_path), Path(reference_onnx)
    if engine is None:

        def engine() -> Runner:
            return TensorRTRunner(plan_path, precision, device=str(device))

    def run(dev: Any) -> selfcheck.Figures:
        try:
            runner = engine()
        except BackendUnavailable as e:
            raise selfcheck.Skip(str(e)) from e
        use = feeds if feeds is not None else synthetic_feeds(runner.check_shapes())  # type: ignore[attr-defined]
        reference = _ort_fp32(reference_onnx)
        figures: selfcheck.Figures = {}
        for i, feed in enumerate(use):
            compare_engine_outputs(figures, precision, i, runner.run(feed), reference(feed))
        return figures

    def fingerprint() -> str:
        return engine_fingerprint(plan_path, reference_onnx, version or _trt_version())

    what = "a TensorRT engine vs ONNX Runtime FP32 of its ONNX graph: sorted scores, matched boxes"
    selfcheck.register(selfcheck.Check(ENGINE_PATH, run, fingerprint, device_types, what))
    verdict = selfcheck.verify(ENGINE_PATH, device)
    if verdict.status == selfcheck.FAILED:
        selfcheck.warn_once(  # one line per engine and process
            f"{ENGINE_PATH}:{verdict.key.get('source', str(plan_path))}",
            f"pfk self-check: {ENGINE_PATH} ({plan_path.name}) on {verdict.key.get('device', device)} "
            f"FAILED ({verdict.reason}); using ONNX Runtime FP32",
        )
    return verdict


def reference_onnx_of(plan_path: str | Path) -> Path:
    """The FP32 ONNX graph beside an optimized directory's engine (`<dir>/tensorrt/<plan>` ->
    `<dir>/model.onnx`): what the engine is checked against."""
    from pfactory.optimize.manifest import ONNX_FILE

    return Path(plan_path).resolve().parent.parent / ONNX_FILE


def open_engine(
    plan_path: str | Path,
    precision: str,
    device: str,
    fallback: Callable[[Path], Runner],
    reference_onnx: str | Path | None = None,
    engine: Callable[[], Runner] | None = None,
    version: str | None = None,
    device_types: tuple[str, ...] = ("cuda",),
) -> Runner:
    """The runner of the engine `plan_path` once it is trusted on `device` (`verify_engine`, read from the
    store when recorded); else `fallback(path)` of the ONNX Runtime FP32 model beside it
    (`<dir>/onnxruntime/model.fp32.onnx`, else the reference `model.onnx`), after the one warning line.
    TensorRT or CUDA missing: BackendUnavailable, as before. `engine`, `version`, `device_types`: as in
    `verify_engine` (the tests check the decision with an ONNX Runtime session standing in for the
    engine)."""
    from kernels import selfcheck
    from pfactory.optimize.manifest import ORT_DIR

    reference = Path(reference_onnx) if reference_onnx is not None else reference_onnx_of(plan_path)
    opener = engine or (lambda: TensorRTRunner(plan_path, precision, device=device))
    if engine is None:
        import_tensorrt()  # the install hint, not a skipped verdict, when TensorRT is missing
    verdict = verify_engine(plan_path, reference, precision, device, None, opener, version, device_types)
    if verdict.status == selfcheck.VERIFIED:
        return opener()
    if verdict.status == selfcheck.SKIPPED and engine is None:
        raise BackendUnavailable(f"{plan_path}: {verdict.reason}")
    ort_model = reference.parent / ORT_DIR / "model.fp32.onnx"
    return fallback(ort_model if ort_model.is_file() else reference)
