"""The whole detector -> one ONNX graph, from padded points to decoded boxes, and the checks it must pass.

In:  a detector of any architecture (the contract, `pfactory.detectors.contract`): its `forward_export` over the
     inputs it declares (`deploy_inputs`: points and num_points, then images and proj for a camera model),
     in its export formulation (its `for_export` hook).
Out: `model.onnx` with
    inputs   points     [batch, points, 4] float32   padded lidar points (x, y, z, intensity), lidar frame, m
             num_points [batch]            int64     valid rows of `points` per frame (the rest is padding)
             images     [batch, N, 3, H, W] float32  normalized camera images (N, H, W fixed by the model)
             proj       [batch, N, 3, 4]   float32   lidar -> model-input image pixels
    outputs  boxes      [batch, K, 7]      float32   (x, y, z, l, w, h, yaw), lidar frame
             scores     [batch, K]         float32   in [0, 1), sorted descending
             labels     [batch, K]         int64     class index
`points` (the padded point count) is always dynamic; `batch` is dynamic unless the model cannot be traced
with a symbolic batch (then 1, and runners split larger batches: `ExportResult.dynamic_batch`).

Fixed K and invalid detections: top-K always returns K = `model.max_detections` entries. The decoder
zeroes every non-peak cell before top-K, so an entry with score 0 is padding (fewer than K peaks) and
its box/label are meaningless; otherwise scores are sigmoid outputs > 0. Nothing is thresholded in the
graph (the graph stays static and identical to PyTorch); consumers keep `scores >= threshold` (> 0).

Pillar scatter and decoding are inside the graph: under export the `kernels` ops trace their PyTorch
reference (ScatterElements(reduction="max"), opset >= 18), so there is no custom op and the same file
runs in ONNX Runtime and TensorRT. `check_onnx` verifies that (checker with full shape inference,
default domain only) and `node_module_paths` maps node names to the detector modules that produced
them (exporter metadata), which is how INT8 exclusions are written (`head.heatmap`).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pfactory.detectors.contract import DEPLOY_INPUTS, OUTPUT_NAMES, for_export

INPUT_NAMES = DEPLOY_INPUTS  # every input a deployed graph may take; a model's own: `deploy_inputs`
# Domains a node may use: the ONNX default domain only (no custom ops, no contrib ops).
ALLOWED_DOMAINS = ("", "ai.onnx")
# Metadata key under which the exporter records the nn.Module scope of each node (torch >= 2.6).
_SCOPE_KEY = "pkg.torch.onnx.name_scopes"
_WRAPPER_ATTR = "model"


class ExportCheckError(ValueError):
    """The exported graph fails a requirement (checker, shape inference, custom domain, I/O names)."""


class ExportWrapper(nn.Module):
    """Exposes `model.forward_export` as `forward`, so the exporter traces padded points -> boxes. The model's
    `deploy_inputs` are a prefix of `INPUT_NAMES`; the exporter passes exactly those."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inputs = tuple(model.deploy_inputs)
        self.model = for_export(model)  # the architecture's export formulation (its hook), or itself

    def forward(
        self, points: Tensor, num_points: Tensor, images: Tensor | None = None, proj: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.model.forward_export(*(points, num_points, images, proj)[: len(self.inputs)])


def deploy_args(model: Any, args: tuple[Tensor, ...] | list[Any]) -> tuple[Any, ...]:
    """The model's deployed inputs out of the four `INPUT_NAMES`-ordered values `args`."""
    return tuple(args[: len(model.deploy_inputs)])


@dataclass
class TensorSpec:
    """Name, ONNX element type name and shape (ints, or strings for dynamic dims) of a graph I/O."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class ExportResult:
    """What `export_onnx` wrote and how."""

    path: Path
    opset: int
    dynamic_batch: bool
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    export_s: float
    torch_version: str
    fallback_reason: str | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    cache: str = "off"  # the template: "off" (no cache), "miss", "hit" or "stale" (export_onnx)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = self.path.name
        return d


def example_inputs(
    model: nn.Module, batch: int, num_points: int, cameras: int, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Plausible inputs for tracing/tests: points inside the model's range, a forward-looking camera.

    Returns points [B, P, 4], num_points [B] (the last frame half full, so padding is exercised),
    images [B, N, 3, H, W], proj [B, N, 3, 4].
    """
    pc_range = model.spec.pc_range
    wi, hi = model.spec.image_size
    g = torch.Generator().manual_seed(seed)
    lo = torch.tensor([*pc_range[:3], 0.0])
    span = torch.tensor([pc_range[3] - pc_range[0], pc_range[4] - pc_range[1], pc_range[5] - pc_range[2], 1.0])
    points = torch.rand(batch, num_points, 4, generator=g) * span + lo  # [B, P, 4]
    counts = torch.full((batch,), num_points, dtype=torch.int64)  # [B]
    counts[-1] = max(1, num_points // 2)
    images = torch.randn(batch, cameras, 3, hi, wi, generator=g)  # [B, N, 3, H, W]
    # Pinhole camera looking along +x (lidar x forward -> camera z), principal point at the image centre.
    k = torch.tensor([[0.7 * wi, 0.0, wi / 2], [0.0, 0.7 * wi, hi / 2], [0.0, 0.0, 1.0]])
    r = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])  # lidar -> camera axes
    proj = (
        (k @ torch.cat([r, torch.zeros(3, 1)], dim=1)).expand(batch, cameras, 3, 4).contiguous()
    )  # [B, N, 3, 4]
    return points, counts, images, proj


def _dtype_name(elem_type: int) -> str:
    import onnx

    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def io_specs(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of an `onnx.ModelProto` as `TensorSpec`s."""

    def spec(v: Any) -> TensorSpec:
        t = v.type.tensor_type
        dims: list[int | str] = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
        return TensorSpec(v.name, _dtype_name(t.elem_type), dims)

    inits = {i.name for i in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]


def _input_dims(model: Any) -> dict[str, list[int | str]]:
    """{input name: dims} with symbolic dims as their names."""
    return {
        v.name: [d.dim_param if d.dim_param else int(d.dim_value) for d in v.type.tensor_type.shape.dim]
        for v in model.graph.input
    }


def _rename_dims(model: Any, mapping: dict[str, str]) -> None:
    """Rename symbolic dims (the exporter's `s0`, `s1`...) everywhere in the graph, consistently."""
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    for v in values:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param in mapping:
                d.dim_param = mapping[d.dim_param]


def _name_dynamic_dims(model: Any) -> None:
    """Give the dynamic I/O dims readable names: `batch` and `points` (what backend.json shows)."""
    mapping: dict[str, str] = {}
    inputs = {v.name: v for v in model.graph.input}
    for name, axis, new in (("points", 0, "batch"), ("points", 1, "points")):
        dim = inputs[name].type.tensor_type.shape.dim[axis]
        if dim.dim_param and dim.dim_param not in mapping:
            mapping[dim.dim_param] = new
    _rename_dims(model, mapping)


# Node metadata the exporter writes that names where the Python code lives: the stack of every op, with the
# absolute path of the source file (a run workspace's path: model.onnx would differ between two identical runs
# and publish the path), and the dotted class path of every module above the op (`namespace`, `class_hierarchy`:
# moving a module to another package would change model.onnx with the graph unchanged). The module scopes
# (`_SCOPE_KEY`: attribute paths inside the detector, what `node_module_paths` reads) stay.
_MACHINE_KEYS = ("pkg.torch.onnx.stack_trace", "namespace", "pkg.torch.onnx.class_hierarchy")


def _drop_machine_metadata(model: Any) -> None:
    """Remove `_MACHINE_KEYS` from every node's metadata (graph and local functions)."""
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    for node in nodes:
        keep = [p for p in node.metadata_props if p.key not in _MACHINE_KEYS]
        if len(keep) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(keep)


def _set_metadata(model: Any, meta: dict[str, Any]) -> None:
    import onnx

    props = {p.key: p.value for p in model.metadata_props}
    props.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    onnx.helper.set_model_props(model, props)


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence the exporter's progress prints and deprecation chatter (errors still raise)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _error_gist(e: BaseException) -> str:
    """The line after the exporter's "Exception summary" header (the actual error), else the first line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for i, ln in enumerate(lines[:-1]):
        if "Exception summary" in ln:
            return lines[i + 1][:400]
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def _trace(wrapper: nn.Module, args: tuple[Tensor, ...], opset: int, dynamic_batch: bool) -> Any:
    """torch.onnx's dynamo export of `wrapper` on `args` (the four example inputs; the model's own are
    traced), unoptimized: an `ONNXProgram` (the template)."""
    from torch.export import Dim

    # Example P > 1 and batch >= 2 when dynamic: torch.export specializes dims of size 0 and 1.
    batch = Dim("batch", min=1, max=1024) if dynamic_batch else None
    points = Dim("points", min=1, max=1 << 24)
    dyn: dict[str, Any] = {
        "points": {0: batch, 1: points} if batch is not None else {1: points},
        "num_points": {0: batch} if batch is not None else None,
        "images": {0: batch} if batch is not None else None,
        "proj": {0: batch} if batch is not None else None,
    }
    names = wrapper.inputs
    dyn = {k: v for k, v in dyn.items() if k in names}
    with _quiet():
        return torch.onnx.export(
            wrapper,
            tuple(args[: len(names)]),
            None,
            input_names=list(names),
            output_names=list(OUTPUT_NAMES),
            opset_version=opset,
            dynamo=True,
            dynamic_shapes=dyn,
            optimize=False,  # done on the template with the weights applied (_from_template)
            verbose=False,
        )


def _trace_template(
    model: nn.Module, wrapper: nn.Module, template: Path, *, cameras: int, opset: int, dynamic_batch: bool,
    export_points: int,
) -> dict[str, Any]:  # fmt: skip
    """Trace `wrapper` into the unoptimized graph `template`; returns the facts of the trace:
    {"dynamic_batch": bool, "fallback_reason": str | None}.

    With `dynamic_batch`, a model whose code cannot trace a symbolic batch (e.g. a kernel wrapper that
    insists on a Python int cell count) falls back to a fixed batch of 1; the reason is recorded."""
    import onnx

    fallback: str | None = None
    if dynamic_batch:
        try:
            _trace(wrapper, example_inputs(model, 2, export_points, cameras), opset, True).save(str(template))
            # The exporter can specialize a dynamic dim to the example's value without raising
            # (seen with torch 2.13 on the default detector: every input came out with batch 2).
            batch_dim = _input_dims(onnx.load(str(template), load_external_data=False))["points"][0]
            if not isinstance(batch_dim, str):
                raise ExportCheckError(f"the exporter fixed the batch dim to {batch_dim}")
        except Exception as e:  # the exporter raises many types; keep the gist as evidence
            fallback = _error_gist(e)
            dynamic_batch = False
    if not dynamic_batch:
        _trace(wrapper, example_inputs(model, 1, export_points, cameras), opset, False).save(str(template))
    return {"dynamic_batch": dynamic_batch, "fallback_reason": fallback}


def _from_template(template: Path, weights: dict[str, Tensor], path: Path) -> None:
    """`path` = the graph of `template` with `weights` (state-dict keys = initializer names), optimized
    (constant folding, fusions: what `torch.onnx.export(optimize=True)` runs)."""
    import onnx_ir

    program = torch.onnx.ONNXProgram(onnx_ir.load(str(template)), None)
    initializers = program.model.graph.initializers
    program.apply_weights({k: v for k, v in weights.items() if k in initializers})
    with _quiet():
        program.optimize()
    program.save(str(path))


def _template_parity(wrapper: nn.Module, model: nn.Module, path: Path, cameras: int, batch: int) -> list[str]:
    """The FP32 parity failures ([] = passed) of the graph at `path` vs the PyTorch `wrapper` on example
    inputs: how a template reused from the cache proves it holds no constant derived from other weights."""
    import onnxruntime as ort

    from pfactory.optimize.params import ParityParams
    from pfactory.optimize.parity import compare_outputs, gate, tolerance_for

    inputs = deploy_args(model, example_inputs(model, batch, 512, cameras, seed=1))
    with torch.no_grad():
        ref = dict(zip(OUTPUT_NAMES, (t.numpy() for t in wrapper(*inputs))))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    got = dict(zip(OUTPUT_NAMES, session.run(None, dict(zip(INPUT_NAMES, (t.numpy() for t in inputs))))))
    params = ParityParams()
    tol = tolerance_for(params, "fp32")
    return gate(compare_outputs([ref], [got], params, tol), tol)


def export_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    cameras: int,
    opset: int = 18,
    dynamic_batch: bool = True,
    export_points: int = 4096,
    metadata: dict[str, Any] | None = None,
    cache: Path | None = None,
) -> ExportResult:
    """Export `model.forward_export` to `path` (see the module docstring) and run `check_onnx` on it.

    The graph is traced into a template (`_trace_template`) and built from it with the model's weights, or
    built from the template of the same architecture in `cache` (a folder: `export_cache`; None: no cache)
    when one is there and passes FP32 parity with the model. `ExportResult.cache` says which: "off", "miss",
    "hit", or "stale" (a cached template that failed parity: traced anew).
    """
    import tempfile

    import onnx

    from pfactory.optimize import export_cache

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = ExportWrapper(model).eval()
    weights = wrapper.state_dict()
    t0 = time.perf_counter()
    state = "off"
    facts: dict[str, Any] | None = None
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix=".export-", dir=path.parent) as scratch:
        key = export_cache.template_key(
            wrapper, model, cameras=cameras, opset=opset, dynamic_batch=dynamic_batch, export_points=export_points
        )  # fmt: skip
        found = export_cache.lookup(cache, key) if cache is not None else None
        if found is not None:
            template, facts = found
            try:
                _from_template(template, weights, path)
            except OSError:  # removed by another process's `forget`/`prune` since the lookup: trace
                facts = None
            batch = 2 if facts and facts["dynamic_batch"] else 1
            if facts is not None and _template_parity(wrapper, model, path, cameras, batch):
                export_cache.forget(cache, key)  # type: ignore[arg-type]
                state, facts = "stale", None
            elif facts is not None:
                state = "hit"
        if facts is None:
            template = Path(scratch) / "template.onnx"
            facts = _trace_template(
                model, wrapper, template, cameras=cameras, opset=opset, dynamic_batch=dynamic_batch,
                export_points=export_points,
            )  # fmt: skip
            _from_template(template, weights, path)
            if cache is not None:
                state = "miss" if state == "off" else state
                try:
                    export_cache.store(cache, key, template, facts)
                except OSError as e:  # a cache is an optimization: the export stands without it
                    print(f"export: traced graph not kept in {cache}: {e}", file=sys.stderr)
    export_s = time.perf_counter() - t0

    proto = onnx.load(str(path))
    points_dim = _input_dims(proto)["points"][1]
    if not isinstance(points_dim, str):
        raise ExportCheckError(
            f"{path}: the padded point count came out fixed ({points_dim}); it must be dynamic"
        )
    _name_dynamic_dims(proto)
    _drop_machine_metadata(proto)
    _set_metadata(proto, metadata or {})
    onnx.save(proto, str(path))
    checks = check_onnx(path)
    inputs, outputs = io_specs(proto)
    return ExportResult(
        path=path,
        opset=opset,
        dynamic_batch=facts["dynamic_batch"],
        inputs=inputs,
        outputs=outputs,
        export_s=round(export_s, 3),
        torch_version=torch.__version__,
        fallback_reason=facts["fallback_reason"],
        checks=checks,
        cache=state,
    )


def check_onnx(path: str | Path) -> dict[str, Any]:
    """Checker (full, with strict shape inference), I/O names, no custom domain. Raises `ExportCheckError`.

    Returns a summary: op types and counts, opset imports, node count.
    """
    import onnx

    path = Path(path)
    model = onnx.load(str(path))
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportCheckError(f"{path}: ONNX checker / shape inference failed: {e}") from e
    names_in = [v.name for v in model.graph.input]
    names_out = [v.name for v in model.graph.output]
    if tuple(names_in) != INPUT_NAMES[: max(2, len(names_in))] or tuple(names_out) != OUTPUT_NAMES:
        raise ExportCheckError(
            f"{path}: I/O {names_in} -> {names_out}, expected a prefix of {list(INPUT_NAMES)} (points and "
            f"num_points at least) -> {list(OUTPUT_NAMES)}"
        )
    custom = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in ALLOWED_DOMAINS})
    imports = {o.domain: o.version for o in model.opset_import}
    extra_domains = sorted(d for d in imports if d not in ALLOWED_DOMAINS)
    if custom or model.functions or extra_domains:
        raise ExportCheckError(
            f"{path}: custom ops/domains in the graph (TensorRT/ORT would need plugins): nodes {custom}, "
            f"functions {[f.name for f in model.functions]}, opset imports {extra_domains}"
        )
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return {
        "checker": "passed",
        "shape_inference": "passed",
        "custom_domains": [],
        "opset_imports": imports,
        "nodes": len(model.graph.node),
        "op_types": dict(sorted(counts.items())),
    }


def node_module_paths(model: Any) -> dict[str, str]:
    """ONNX node name -> dotted path of the detector module that produced it ('' outside any submodule).

    Read from the exporter's `pkg.torch.onnx.name_scopes` metadata (e.g. `['', 'model', 'model.head',
    'model.head.reg', 'conv2d_15']` -> `head.reg`); the export wrapper's `model.` prefix is stripped.
    """
    out: dict[str, str] = {}
    prefix = _WRAPPER_ATTR + "."
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        scopes_raw = meta.get(_SCOPE_KEY)
        path = ""
        if scopes_raw:
            try:
                scopes = json.loads(scopes_raw.replace("'", '"'))
            except json.JSONDecodeError:
                scopes = []
            # The last entry is the op itself; the one before it is the innermost module.
            modules = [s for s in scopes[:-1] if s.startswith(prefix)]
            if modules:
                path = modules[-1][len(prefix) :]
        out[node.name] = path
    return out
