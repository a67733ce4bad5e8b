"""Exact ONNX graph rewrites that make the exported detector cheaper on ONNX Runtime's CPU kernels.

In:  the exported `onnx.ModelProto` (pfactory.optimize.export), out: a rewritten copy + a report of what
changed. Every rewrite computes bit-identical outputs (tests/optimize/test_graph_rewrite.py compares
ORT outputs before/after with `==`, and checks repeatability with 2 threads):

1. Row scatters go 1-D: `ScatterElements(data [M, C], idx [N, C'], upd [N, C'], axis=0, reduction=r)` ->
   `ScatterElements(data.flat, (idx mod-wrapped) * C + col, upd.flat, axis=0, reduction=r)` reshaped back.
   Same elements, same row-major order (ORT's ScatterElements is a sequential loop), so even `add` sums
   in the same order. ORT's loop recomputes a multi-dim offset per element; the 1-D form does not, and
   when idx is `row[:, None].expand(N, C)` (the kernels' reference) the offsets are computed on [N, 1]
   and broadcast once. Measured on the default detector, 50k-point frames: the whole ORT model
   ~1.4x faster (docs/OPTIMIZE.md, "ONNX Runtime").
2. ReduceSum over axes of static size 1 (painting's sum over cameras when there is one camera) ->
   Squeeze (keepdims=0) or Identity (keepdims=1): a sum of one element is that element.
3. Dead nodes (outputs used by nothing, e.g. the index Expand left behind by 1) are removed.

Deliberately NOT done: the row scatter as `ScatterND(idx [N, 1], reduction=r)`. It was faster still, and
exact on one thread -- but ORT's ScatterND reduction splits the index rows over the intra-op threads with
a plain read-modify-write (onnxruntime/core/providers/cpu/tensor/scatter_nd.cc, `ScatterNDDispatchTarget`),
so pillars with several points race: with 2 threads 18 of 40 repeated runs of one frame differed, by up to
6e-3 on a score. The parity gate caught it (ORT issues #18048, #23396; the ONNX spec wants ScatterND
indices unique); `parity.json` now also checks that every artifact is repeatable.

`model.onnx` keeps the plain export (the TensorRT input and the artifact that documents the reference
decomposition); the ONNX Runtime models are built from the rewritten graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _attrs(node: Any) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _shapes(model: Any) -> dict[str, list[int | str]]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    out: dict[str, list[int | str]] = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            out[v.name] = [
                d.dim_param if d.dim_param else int(d.dim_value) for d in v.type.tensor_type.shape.dim
            ]
    for init in inferred.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def _const_ints(model: Any, name: str) -> list[int] | None:
    """Values of an int initializer or Constant node output, else None."""
    import onnx

    for init in model.graph.initializer:
        if init.name == name:
            return [int(v) for v in onnx.numpy_helper.to_array(init).ravel()]
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = _attrs(node).get("value")
            if value is not None:
                return [int(v) for v in onnx.numpy_helper.to_array(value).ravel()]
    return None


def _prune_dead(model: Any) -> int:
    """Remove nodes none of whose outputs reach a graph output; returns how many were removed."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    removed = len(model.graph.node) - len(keep)
    if removed:
        keep.reverse()
        del model.graph.node[:]
        model.graph.node.extend(keep)
        used = {i for n in model.graph.node for i in n.input}
        inits = [i for i in model.graph.initializer if i.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(inits)
    return removed


def _flatten_scatter(
    node: Any,
    attrs: dict[str, Any],
    shapes: dict[str, list[int | str]],
    producers: dict[str, Any],
    model: Any,
    out: list,
    fresh: Any,
) -> bool:
    """Append the 1-D form of a 2-D axis-0 ScatterElements to `out`; False (nothing appended) if not applicable.

    output[idx[i, j], j] = reduce(..., upd[i, j])  ==  flat[idx[i, j] * C + j] = reduce(..., upd_flat[i * C' + j])
    over the same elements in the same (row-major) order, so even `add` sums in the same order: bit-identical.
    """
    import onnx
    from onnx import helper

    if int(attrs.get("axis", 0)) != 0 or len(node.input) != 3:
        return False
    data, idx, upd = node.input
    d_shape, i_shape = shapes.get(data, []), shapes.get(idx, [])
    if (
        len(d_shape) != 2
        or len(i_shape) != 2
        or not isinstance(d_shape[1], int)
        or not isinstance(i_shape[1], int)
    ):
        return False
    c, ci = d_shape[1], i_shape[1]
    name = fresh(node.name or "scatter")
    # `row[:, None].expand(N, C)` (how the kernels' reference scatters rows): offset arithmetic on the [N, 1]
    # rows and one broadcast in the last Add is ~C x less int64 work; the Expand is then dead and pruned.
    src = producers.get(idx)
    if src is not None and src.op_type == "Expand" and shapes.get(src.input[0], [None, None])[1:] == [1]:
        idx = src.input[0]

    def const(tag: str, value: np.ndarray) -> str:
        n = fresh(f"{name}_{tag}")
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, n))
        return n

    minus1 = const("flat", np.array([-1], dtype=np.int64))
    zero = const("zero", np.array(0, dtype=np.int64))
    cols = const("cols", np.arange(ci, dtype=np.int64)[None, :])  # [1, C']
    width = const("width", np.array(c, dtype=np.int64))
    t = {k: fresh(f"{name}_{k}") for k in ("shape", "rows", "neg", "wrapped", "idx", "scaled", "flat_idx",
                                            "flat_data", "flat_upd", "flat_out")}  # fmt: skip
    out += [
        helper.make_node("Shape", [data], [t["shape"]], name=fresh(name + "_shape_op")),
        helper.make_node("Gather", [t["shape"], zero], [t["rows"]], name=fresh(name + "_rows_op"), axis=0),
        # ONNX allows negative indices (from the end); the flat offset needs them wrapped first.
        helper.make_node("Less", [idx, zero], [t["neg"]], name=fresh(name + "_neg_op")),
        helper.make_node("Add", [idx, t["rows"]], [t["wrapped"]], name=fresh(name + "_wrap_op")),
        helper.make_node("Where", [t["neg"], t["wrapped"], idx], [t["idx"]], name=fresh(name + "_where_op")),
        helper.make_node("Mul", [t["idx"], width], [t["scaled"]], name=fresh(name + "_mul_op")),
        helper.make_node("Add", [t["scaled"], cols], [t["flat_idx"] + "_2d"], name=fresh(name + "_col_op")),
        helper.make_node("Reshape", [t["flat_idx"] + "_2d", minus1], [t["flat_idx"]], name=fresh(name + "_ri")),
        helper.make_node("Reshape", [data, minus1], [t["flat_data"]], name=fresh(name + "_rd")),
        helper.make_node("Reshape", [upd, minus1], [t["flat_upd"]], name=fresh(name + "_ru")),
        helper.make_node(
            "ScatterElements", [t["flat_data"], t["flat_idx"], t["flat_upd"]], [t["flat_out"]],
            name=fresh(name + "_1d"), axis=0, **({"reduction": attrs["reduction"]} if "reduction" in attrs else {}),
        ),
        helper.make_node("Reshape", [t["flat_out"], t["shape"]], list(node.output), name=fresh(name + "_ro")),
    ]  # fmt: skip
    return True


def _const_array(model: Any, name: str) -> np.ndarray | None:
    """A float initializer's value, else None."""
    import onnx

    for init in model.graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    return None


def _affine_as_conv(
    mul: Any, add: Any, shapes: dict[str, list[int | str]], model: Any, out: list, fresh: Any
) -> bool:
    """`Add(Mul(x [B, C, H, W], gamma [C, 1, 1]), beta [C, 1, 1])` (GroupNorm's affine after the
    InstanceNormalization it exports to) -> one depthwise 1x1 `Conv(x, gamma [C, 1, 1, 1], beta [C],
    group=C)`, which ORT fuses with the following Relu and runs in its NCHWc layout: one pass over x
    instead of two or three. x * gamma + beta, rounded once (an FMA) instead of twice: within 1 ulp."""
    import onnx
    from onnx import helper

    x_shape = shapes.get(mul.input[0])
    if not x_shape or len(x_shape) != 4:
        return False
    gamma = _const_array(model, mul.input[1])
    c = int(gamma.size) if gamma is not None else 0
    # x's channel count is often symbolic after the exporter's Reshape; a [C, 1, 1] gamma broadcasts only
    # against C (or 1) channels, and a grouped Conv on any other count raises at session run, never computes.
    if isinstance(x_shape[1], int) and x_shape[1] != c:
        return False
    beta = _const_array(model, add.input[1]) if add.input[0] == mul.output[0] else None
    if gamma is None or beta is None or gamma.size != c or beta.size != c:
        return False
    if gamma.shape not in ((c, 1, 1), (1, c, 1, 1)) or beta.shape not in ((c, 1, 1), (1, c, 1, 1)):
        return False
    w = fresh(f"{mul.name or 'affine'}_dw_weight")
    b = fresh(f"{mul.name or 'affine'}_dw_bias")
    model.graph.initializer.append(
        onnx.numpy_helper.from_array(gamma.reshape(c, 1, 1, 1).astype(np.float32), w)
    )
    model.graph.initializer.append(onnx.numpy_helper.from_array(beta.reshape(c).astype(np.float32), b))
    out.append(
        helper.make_node(
            "Conv", [mul.input[0], w, b], list(add.output), name=fresh((mul.name or "affine") + "_dwconv"),
            group=c, kernel_shape=[1, 1],
        )
    )  # fmt: skip
    return True


def rewrite_for_ort(model: Any, affine_conv: bool = False) -> tuple[Any, dict[str, Any]]:
    """A rewritten copy of `model` (module docstring) and `{"scatter_flattened", "reduce_sum": [names], "pruned": n}`
    (+ "affine_conv": [names] with `affine_conv`: GroupNorm affines as depthwise 1x1 convs, `_affine_as_conv`)."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(model.SerializeToString())  # work on a copy
    shapes = _shapes(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    report: dict[str, Any] = {"scatter_flattened": [], "reduce_sum": [], "pruned": 0}
    if affine_conv:
        report["affine_conv"] = []
    fused_adds: set[int] = set()
    new_nodes = []
    taken = {n.name for n in model.graph.node}

    def fresh(base: str) -> str:
        """A node/tensor name not used in the graph yet (exported nodes are named; others may not be)."""
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    for i, node in enumerate(model.graph.node):
        if id(node) in fused_adds:
            continue
        a = _attrs(node)
        base = node.name or f"{node.op_type}_{i}"
        if affine_conv and node.op_type == "Mul":
            nxt = consumers.get(node.output[0], [])
            if (
                len(nxt) == 1
                and nxt[0].op_type == "Add"
                and node.output[0] not in {o.name for o in model.graph.output}
                and _affine_as_conv(node, nxt[0], shapes, model, new_nodes, fresh)
            ):
                fused_adds.add(id(nxt[0]))
                report["affine_conv"].append(base)
                continue
        if node.op_type == "ScatterElements" and _flatten_scatter(
            node, a, shapes, producers, model, new_nodes, fresh
        ):
            report["scatter_flattened"].append(base)
            continue
        if node.op_type == "ReduceSum" and len(node.input) >= 2 and node.input[1]:
            axes = _const_ints(model, node.input[1])
            in_shape = shapes.get(node.input[0])
            if axes and in_shape and all(isinstance(in_shape[ax], int) and in_shape[ax] == 1 for ax in axes):
                if int(a.get("keepdims", 1)):
                    new_nodes.append(
                        helper.make_node(
                            "Identity", [node.input[0]], list(node.output), name=fresh(base + "_id")
                        )
                    )
                else:
                    new_nodes.append(
                        helper.make_node("Squeeze", [node.input[0], node.input[1]], list(node.output), name=fresh(base + "_sq"))
                    )  # fmt: skip
                report["reduce_sum"].append(base)
                continue
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    report["pruned"] = _prune_dead(model)
    onnx.checker.check_model(model)
    return model, report
