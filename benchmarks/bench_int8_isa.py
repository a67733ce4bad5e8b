"""Does an INT8 artifact compute the same on every x86 CPU? ONNX Runtime's integer kernels per ISA, measured.

ORT's x86 integer kernels dispatch on the CPU: with AVX512-VNNI (or AVX-VNNI) U8S8 products accumulate
in int32 (`vpdpbusd`); with AVX2 or AVX-512 without VNNI they go through `vpmaddubsw`, which adds two
u8 x s8 products into an int16 *with saturation*. This benchmark runs the same INT8 models on the same
inputs on several CPUs -- this machine natively, and others emulated by QEMU user mode, whose TCG
implements AVX2 but neither AVX-512 nor VNNI (QEMU >= 7.2; `apt-get install qemu-user`) -- and
compares each integer run with the *float simulation of the same quantized graph* (the QDQ model with
ORT's graph optimizations off: QuantizeLinear/DequantizeLinear run as float fake-quant, nothing fused),
and each CPU's integer outputs with this machine's.

Formats (all QDQ, per-channel symmetric weights, uint8 asymmetric activations unless named):
    u8s8      8-bit weights [-127, 127] (the optimize stage's format until 2026-12)
    u8s8_rr   7-bit weights [-64, 64] (`reduce_range`: the stage's format now)
    s8s8      int8 asymmetric activations, 8-bit weights
    u8u8      uint8 weights
Two parts:
- probe: one 1x1 conv whose inputs are at the extremes (u8 255, weight 127; K = 64): the exact result
  is 64.0; a pairwise-saturating kernel returns ~32.6. Kernel behaviour, independent of any model.
- model: the trained detector's INT8 graph in each format (`--layers stage`: the layers the stage
  quantized; `all`: every quantizable layer, the most exposure to saturation), on `--frames` val frames:
  integer vs own fake-quant, integer vs this machine's integer, and vs FP32: the heatmap logits (the
  `--probe-module` conv's output, added as an extra graph output) and the confident-detection
  agreement (score >= 0.3). The FP32 model run on each CPU gives the float floor: ORT's float kernels
  differ per ISA too (vector width changes the summation order), so "computes the same" means "differs
  across CPUs no more than FP32 does".

Run (needs the trained model's optimized directory and its prepared data; several minutes per emulated
CPU: TCG runs AVX2 code ~50x slower than native):
    python benchmarks/bench_int8_isa.py --optimized artifacts/optimized --data artifacts/prepared \\
        --emulate EPYC-Milan Nehalem --json isa.json
`--worker DIR TAG` is the part that runs on each CPU (numpy + onnxruntime only, no torch).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = {
    "u8s8": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": False},
    "u8s8_rr": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": True},
    "s8s8": {"activation_type": "int8", "weight_type": "int8", "reduce_range": False},
    "u8u8": {"activation_type": "uint8", "weight_type": "uint8", "reduce_range": False},
}
OUTPUTS = ("boxes", "scores", "labels", "probe")


def _probe_model(fmt: str) -> Any:
    """1x1 conv, K = 64 input channels, every input u8 255 (float 1.0), half the filters all 127."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    k, m = 64, 16
    act_s8 = fmt == "s8s8"
    lim = 64 if fmt == "u8s8_rr" else 127
    w = np.full((m, k, 1, 1), lim, np.int32)
    w[m // 2 :] = np.random.default_rng(0).integers(-lim, lim + 1, (m - m // 2, k, 1, 1))
    w_u8 = fmt == "u8u8"
    wq = (w + (128 if w_u8 else 0)).astype(np.uint8 if w_u8 else np.int8)
    xzp = np.array(-128 if act_s8 else 0, np.int8 if act_s8 else np.uint8)
    inits = [
        nh.from_array(np.array(1 / 255, np.float32), "xs"),
        nh.from_array(xzp, "xzp"),
        nh.from_array(wq, "wq"),
        nh.from_array(np.array(1 / lim, np.float32), "ws"),
        nh.from_array(np.array(128 if w_u8 else 0, np.uint8 if w_u8 else np.int8), "wzp"),
        nh.from_array(np.array(k / 100, np.float32), "ys"),
        nh.from_array(xzp.copy(), "yzp"),
    ]
    nodes = [
        h.make_node("QuantizeLinear", ["x", "xs", "xzp"], ["xq"]),
        h.make_node("DequantizeLinear", ["xq", "xs", "xzp"], ["xd"]),
        h.make_node("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"]),
        h.make_node("Conv", ["xd", "wd"], ["c"]),
        h.make_node("QuantizeLinear", ["c", "ys", "yzp"], ["cq"]),
        h.make_node("DequantizeLinear", ["cq", "ys", "yzp"], ["y"]),
    ]
    g = h.make_graph(
        nodes, "probe", [h.make_tensor_value_info("x", T.FLOAT, [1, k, 2, 2])],
        [h.make_tensor_value_info("y", T.FLOAT, None)], inits,
    )  # fmt: skip
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def _session(model: Any, optimize: bool, threads: int = 1) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    src = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def worker(work: Path, tag: str) -> None:
    """On the CPU under test: every model of `work` with integer kernels and as fake-quant -> out.<tag>.npz."""
    import onnxruntime as ort

    meta = json.loads((work / "variants.json").read_text())
    z = np.load(work / "feeds.npz")
    feeds = [
        {k: z[f"{i}:{k}"] for k in ("points", "num_points", "images", "proj")} for i in range(meta["frames"])
    ]
    res: dict[str, np.ndarray] = {}
    x = np.ones((1, 64, 2, 2), np.float32)
    probe = {}
    for fmt in FORMATS:
        m = _probe_model(fmt)
        probe[fmt] = {
            "integer": float(_session(m, True).run(None, {"x": x})[0][0, 0, 0, 0]),
            "fake_quant": float(_session(m, False).run(None, {"x": x})[0][0, 0, 0, 0]),
        }
    t0 = time.perf_counter()
    for name in meta["models"]:
        for mode, optimize in (("int", True), ("fake", False)):
            if name == "fp32" and mode == "fake":
                continue
            s = _session(work / f"{name}.onnx", optimize)
            for i, f in enumerate(feeds):
                for o, v in zip(OUTPUTS, s.run(None, f)):
                    res[f"{name}|{mode}|{i}|{o}"] = v
    np.savez(work / f"out.{tag}.npz", **res)
    (work / f"probe.{tag}.json").write_text(
        json.dumps({"probe": probe, "seconds": round(time.perf_counter() - t0, 1), "ort": ort.__version__})
    )


def build(
    optimized: Path, data: Path, frames: int, probe_module: str, work: Path, layers: str
) -> dict[str, Any]:
    """Feeds and the model variants (the stage's float/quantized split or every layer, each format) into `work`."""
    import onnx

    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.export import node_module_paths
    from pfactory.optimize.ort_backend import preprocess, quantize_layers, write_rewritten
    from pfactory.optimize.params import Int8Params

    work.mkdir(parents=True, exist_ok=True)
    report = json.loads((optimized / "onnxruntime" / "sensitivity.json").read_text())
    method = report["calibration"]["chosen"]
    cache = optimized / "onnxruntime" / f"calibration.{method}.json"
    write_rewritten(optimized / "model.onnx", work / "rewritten.onnx")
    base, _ = preprocess(work / "rewritten.onnx", work / "base.onnx")
    export = onnx.load(str(optimized / "model.onnx"))
    paths = node_module_paths(export)
    probe = next((n.output[0] for n in export.graph.node if paths.get(n.name) == probe_module), None)
    if probe is None:
        convs = sorted({paths.get(n.name, "") for n in export.graph.node if n.op_type == "Conv"} - {""})
        raise SystemExit(f"--probe-module {probe_module!r}: no node of that module; conv modules: {convs}")
    feeds = load_feeds(data, "val", 1, frames).feeds
    np.savez(work / "feeds.npz", **{f"{i}:{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
    quantized = report["quantized"] if layers == "stage" else [row["name"] for row in report["layers"]]
    models = {}
    for name, fmt in FORMATS.items():
        params = Int8Params(activation_type=fmt["activation_type"], reduce_range=fmt["reduce_range"])
        dst = work / f"{name}.onnx"
        quantize_layers(base, dst, cache, method, params, quantized)
        if fmt["weight_type"] == "uint8":
            _weights_to_uint8(dst)
        models[name] = fmt
    fp32 = onnx.load(str(base))
    onnx.save(fp32, str(work / "fp32.onnx"))
    for name in [*FORMATS, "fp32"]:
        m = onnx.load(str(work / f"{name}.onnx"))
        m.graph.output.append(onnx.helper.make_tensor_value_info(probe, onnx.TensorProto.FLOAT, None))
        onnx.save(m, str(work / f"{name}.onnx"))
    meta = {
        "frames": len(feeds),
        "models": [*FORMATS, "fp32"],
        "probe_tensor": probe,
        "quantized": quantized,
        "layers": layers,
    }
    (work / "variants.json").write_text(json.dumps(meta))
    return meta


def _weights_to_uint8(path: Path) -> None:
    """int8 weight initializers (zero point 0) -> uint8 with zero point 128: the U8U8 format."""
    import onnx
    from onnx import numpy_helper as nh

    m = onnx.load(str(path))
    inits = {i.name: i for i in m.graph.initializer}
    for node in m.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        w = inits[node.input[0]]
        if w.data_type != onnx.TensorProto.INT8 or len(node.input) < 3 or node.input[2] not in inits:
            continue
        zp = inits[node.input[2]]
        q = nh.to_array(w).astype(np.int16) + 128
        w.CopyFrom(nh.from_array(q.astype(np.uint8), w.name))
        z = nh.to_array(zp).astype(np.int16) + 128
        zp.CopyFrom(nh.from_array(z.astype(np.uint8), zp.name))
    onnx.save(m, str(path))


def _load(work: Path, tag: str) -> dict[tuple[str, str], list[dict[str, np.ndarray]]]:
    z = np.load(work / f"out.{tag}.npz")
    d: dict[tuple[str, str], dict[int, dict[str, np.ndarray]]] = {}
    for k in z.files:
        name, mode, i, o = k.split("|")
        d.setdefault((name, mode), {}).setdefault(int(i), {})[o] = z[k]
    return {k: [v[i] for i in sorted(v)] for k, v in d.items()}


def _compare(a: list[dict], b: list[dict]) -> dict[str, Any]:
    from pfactory.optimize.parity import detection_agreement

    h = np.concatenate([np.abs(x["probe"].astype(np.float64) - y["probe"]).ravel() for x, y in zip(a, b)])
    ag = detection_agreement(a, b, 0.3, 0.5)
    return {
        "probe_max": float(h.max()),
        "probe_p999": float(np.quantile(h, 0.999)),
        "bit_identical": bool(
            h.max() == 0 and all(np.array_equal(x["scores"], y["scores"]) for x, y in zip(a, b))
        ),
        "match_rate": ag["match_rate"],
        "scores_max": ag["scores_abs_diff"]["max"],
        "scores_p99": ag["scores_abs_diff"]["p99"],
    }


def compare(work: Path, tags: list[str]) -> dict[str, Any]:
    runs = {t: _load(work, t) for t in tags}
    native = tags[0]
    ref = runs[native][("fp32", "int")]
    out: dict[str, Any] = {}
    for name in FORMATS:
        row: dict[str, Any] = {}
        for t in tags:
            row[t] = {
                "int_vs_own_fake_quant": _compare(runs[t][(name, "int")], runs[t][(name, "fake")]),
                "int_vs_fp32": _compare(ref, runs[t][(name, "int")]),
            }
            if t != native:
                row[t]["int_vs_native_int"] = _compare(runs[native][(name, "int")], runs[t][(name, "int")])
        out[name] = row
    out["fp32"] = {t: {"int_vs_native_int": _compare(ref, runs[t][("fp32", "int")])} for t in tags[1:]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--optimized", type=Path, help="an optimize stage's output (model.onnx, sensitivity.json)"
    )
    ap.add_argument("--data", type=Path, help="its prepared directory (val frames)")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--probe-module", default="head.heatmap", help="module whose conv output is compared")
    ap.add_argument(
        "--layers", choices=["stage", "all"], default="all", help="layers quantized in every format"
    )
    ap.add_argument("--emulate", nargs="*", default=["EPYC-Milan"], help="QEMU -cpu models to run under")
    ap.add_argument("--qemu", default="qemu-x86_64", help="QEMU user-mode binary")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--probe-only", action="store_true", help="the kernel probe only (no model: seconds, not minutes)"
    )
    ap.add_argument("--worker", nargs=2, metavar=("DIR", "TAG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1])
        return None
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_int8_isa."))
    t0 = time.perf_counter()
    if args.probe_only:
        work.mkdir(parents=True, exist_ok=True)
        meta = {"frames": 0, "models": [], "probe_tensor": None, "quantized": [], "layers": "none"}
        (work / "variants.json").write_text(json.dumps(meta))
        np.savez(work / "feeds.npz")
    elif args.optimized is None or args.data is None:
        ap.error("--optimized and --data are required (or --probe-only)")
    else:
        meta = build(args.optimized, args.data, args.frames, args.probe_module, work, args.layers)
    tags = ["native", *args.emulate]
    seconds = {}
    for tag in tags:
        t1 = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(work), tag]
        if tag != "native":
            cmd = [*shlex.split(args.qemu), "-cpu", tag, *cmd]
        print("running:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{tag}: worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
        seconds[tag] = round(time.perf_counter() - t1, 1)
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": tags,
        "frames": meta["frames"],
        "probe_tensor": meta["probe_tensor"],
        "quantized_layers": len(meta["quantized"]),
        "layers": meta["layers"],
        "kernel_probe": {t: json.loads((work / f"probe.{t}.json").read_text())["probe"] for t in tags},
        "model": compare(work, tags) if meta["models"] else None,
        "seconds": {**seconds, "total": round(time.perf_counter() - t0, 1)},
    }
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(r: dict[str, Any]) -> None:
    tags = r["cpus"]
    print(
        "\nkernel probe (1x1 conv, 64 channels of u8 255 x weight max; exact = 64.0), integer result per CPU:"
    )
    print(f"  {'format':10s}" + "".join(f"{t:>14s}" for t in tags))
    for fmt in FORMATS:
        print(f"  {fmt:10s}" + "".join(f"{r['kernel_probe'][t][fmt]['integer']:14.3f}" for t in tags))
    if r["model"] is None:
        print(f"seconds: {r['seconds']}")
        return
    print(f"\nmodel ({r['frames']} val frames, {r['quantized_layers']} layers quantized; probe = {r['probe_tensor']} "
          "logits; agreement at score >= 0.3):")  # fmt: skip
    for t, c in r["model"]["fp32"].items():
        n = c["int_vs_native_int"]
        same = (
            "bit-identical"
            if n["bit_identical"]
            else f"logits p99.9 {n['probe_p999']:.4f} max {n['probe_max']:.3f}"
        )
        print(
            f"  fp32     {t:11s} vs native fp32: {same}, match {n['match_rate']:.3f}, scores max {n['scores_max'] or 0:.4f}"
        )
    for fmt, row in r["model"].items():
        if fmt == "fp32":
            continue
        for t in tags:
            c = row[t]
            own, fp = c["int_vs_own_fake_quant"], c["int_vs_fp32"]
            line = (
                f"  {fmt:8s} {t:11s} int vs own fake-quant: logits p99.9 {own['probe_p999']:.4f} max {own['probe_max']:.3f}"
                f" | vs FP32: logits p99.9 {fp['probe_p999']:.3f}, match {fp['match_rate']:.3f}, scores max {fp['scores_max'] or 0:.3f}"
            )
            if "int_vs_native_int" in c:
                n = c["int_vs_native_int"]
                same = (
                    "bit-identical"
                    if n["bit_identical"]
                    else f"logits p99.9 {n['probe_p999']:.4f} max {n['probe_max']:.3f}"
                )
                line += f" | vs native int: {same}, match {n['match_rate']:.3f}, scores max {n['scores_max'] or 0:.3f}"
            print(line)
    print(f"seconds: {r['seconds']}")


if __name__ == "__main__":
    main()
