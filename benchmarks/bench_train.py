"""Training benchmarks: throughput (samples/s, data-wait) and accuracy vs training-set size.

    python benchmarks/bench_train.py throughput --data PREPARED [--steps 20] [--batch 4]
        Model step alone (in-memory batches) camera vs lidar-only, then the whole loop with the DALI
        and the PyTorch loaders: samples/s, CPU ms/step, data-wait fraction, and ratios. On CUDA also
        fp32 eager vs bf16 eager vs bf16 + torch.compile.
    python benchmarks/bench_train.py variants --data PREPARED [--steps 20] [--variants NAME ...] [--interleaved]
        The training step (targets + forward + loss + backward + AdamW, `pfactory.train.trainer.train_step`
        on the default params) in several variants side by side, each in its own process (its own peak
        RSS, its own compile): samples/s (median step), the per-phase split, peak memory, and for the
        compiled variants the compile time (first steps) and the recompiles after warm-up over batches of
        varying point counts. Variants: eager (the default), nchw (no channels_last), c0686b9-net (the
        round's starting network: 3x3 stem and head conv, sincos heading), s2d-head1 (space-to-depth stem,
        1x1 shared head conv), gather-paint (camera painting by `sample_bilinear` instead of grid_sample),
        compiled (Inductor, fullgraph, automatic dynamic shapes), torch-ops (PFK_NATIVE=0: the PyTorch ops
        instead of the native CPU kernels, kernels/native.py). `--interleaved`: the variants in one process
        on the same batches, their steps alternating (robust ratios on a machine whose speed drifts).
    python benchmarks/bench_train.py ab --baseline TREE --data PREPARED [--rounds 3] [--steps 10]
        This tree's default training step vs another source tree's (a checkout of an earlier commit),
        each with its own code and embedded defaults, on the same in-memory batches, interleaved
        round by round, one process per run: samples/s, step ms, CPU ms, and the ratio of the medians.
    python benchmarks/bench_train.py explain --data PREPARED [--compile-backend eager]
        torch._dynamo.explain over the default training step on a real batch (graph breaks), then one
        compiled epoch over every training batch: graphs compiled and recompiles from the point counts.
    python benchmarks/bench_train.py frames [--frames 200 800 2000] [--seed 7] [--steps N] [--work DIR]
        One synthetic dataset of the largest size (frames are generated per index, so every smaller
        set is a prefix of it); each size is prepared from the first frames and trained for the same
        number of optimizer steps (the default CPU budget); every model is scored on the val split of
        the largest set, which no train split contains (the split is a hash of the frame id).
        Prints Car AP@2m, mAP, per class and per range, for camera on and off (`--ablation`).
    python benchmarks/bench_train.py ablation --data PREPARED [--steps N]
        Camera on vs lidar-only on one prepared dataset: mAP, per class, per range.

Numbers are recorded in docs/MODEL.md. `-S section.key=value` overrides apply to every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def make_params(overrides: list[str]) -> Any:
    """The embedded default params (= the shipped params.yaml, a test keeps them equal) + overrides."""
    from flows.params import load_params

    return load_params(None, overrides)


def loader_factory(backend: str):
    def factory(data, split, batch_size, shuffle, augment, seed, device, num_threads):
        from pfactory.prepare.loader import make_loader

        return make_loader(
            data, split, batch_size=batch_size, shuffle=shuffle, augment=augment, seed=seed,
            device=device.type, num_threads=num_threads, backend=backend,
        )  # fmt: skip

    return factory


def kpi_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a KPI summary."""
    row = {"mAP": metrics["mAP"], "NDS": metrics["NDS"]}
    for name, c in metrics["classes"].items():
        row[f"{name} AP@2m"] = c["ap"]["2.0"]
        row[f"{name} mAP"] = c["mean_ap"]
    for bucket, block in metrics["by_range"].items():
        row[f"{bucket} m mAP"] = block["mAP"]
        for name, c in block["classes"].items():
            row[f"{bucket} m {name} AP@2m"] = c["ap"]["2.0"]
    return row


def print_table(rows: list[dict[str, Any]], keys: list[str] | None = None) -> None:
    keys = keys or list(dict.fromkeys(k for r in rows for k in r))
    widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).rjust(widths[k]) for k in keys))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


# --------------------------------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------------------------------
def model_step_rate(params: Any, batches: list[dict], steps: int, device: torch.device, bf16: bool = False,
                    compile: bool = False) -> dict[str, float]:  # fmt: skip
    """samples/s of forward + loss + backward + AdamW on in-memory batches (no data loading)."""
    from pfactory.detectors import registry
    from pfactory.detectors.contract import DataSpec, LossContext, batch_inputs, for_compile

    torch.manual_seed(0)
    image_wh = (batches[0]["images"].shape[-1], batches[0]["images"].shape[-2])
    spec = DataSpec(tuple(params.prepare.classes), tuple(params.prepare.pc_range), image_wh)
    model = registry.build(params.model.arch, params.model.selected, spec).to(device)
    ctx = LossContext(lambda t: t)
    fwd = torch.compile(for_compile(model)) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    times, cpu = [], []
    for i in range(steps + 3):
        b = batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = fwd(*batch_inputs(model, b))
            loss = model.loss(out, b, ctx)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # warm-up: allocator, oneDNN primitive caches, compilation
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    bsz = batches[0]["points"].shape[0]
    med = statistics.median(times)
    return {
        "samples/s": bsz / med,
        "best samples/s": bsz / min(times),
        "CPU ms/step": 1000 * statistics.median(cpu),
    }


def cmd_throughput(args: argparse.Namespace) -> None:
    import tasks.train
    from pfactory.prepare.loader import make_loader

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = make_params([*args.set, f"train.batch_size={args.batch}"])
    loader = make_loader(args.data, "train", args.batch, shuffle=True, augment=base.train.augment, seed=0,
                         device="cpu", backend="torch")  # fmt: skip
    it = iter(loader)
    batches = [dict(vars(next(it))) for _ in range(min(4, len(loader)))]
    rows = []
    for camera in (True, False):
        p = make_params([*args.set, f"model.painted_pillars.camera={camera}"])
        r = model_step_rate(p, batches, args.steps, device)
        rows.append({"run": f"model step, camera={camera}", **r})
        if device.type == "cuda":
            for bf16, comp in ((True, False), (True, True)):
                r = model_step_rate(p, batches, args.steps, device, bf16=bf16, compile=comp)
                rows.append({"run": f"model step, camera={camera}, bf16{' + compile' if comp else ''}", **r})
    for backend in ("torch", "dali"):
        with tempfile.TemporaryDirectory() as tmp:
            s = tasks.train.run(
                make_params([*args.set, f"train.batch_size={args.batch}", "train.checkpoint_every_steps=100000"]),
                Path(args.data), Path(tmp), track=False, max_steps=args.steps, loader_factory=loader_factory(backend),
                progress=False,
            )  # fmt: skip
        curve = s["timings_s"]
        rows.append({"run": f"train loop, {backend} loader", "samples/s": s["samples_per_s"],
                     "data-wait": s["data_wait_fraction"], "data s": curve.get("data")})  # fmt: skip
    print_table(rows)
    if len(rows) >= 2:
        print(f"\nlidar-only / camera model-step speed: {rows[1]['samples/s'] / rows[0]['samples/s']:.2f}x")


# --------------------------------------------------------------------------------------------------
# variants of the training step, one process each
# --------------------------------------------------------------------------------------------------
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"set": []},
    "nchw": {"set": [], "memory_format": "contiguous"},
    "c0686b9-net": {"set": ["model.painted_pillars.bev_stem=conv3x3", "model.painted_pillars.head_kernel=3", "model.painted_pillars.heading=sincos"]},
    "s2d-head1": {"set": ["model.painted_pillars.bev_stem=space_to_depth", "model.painted_pillars.head_kernel=1"]},
    "gather-paint": {"set": ["model.painted_pillars.paint_sampler=gather"]},
    "compiled": {"set": [], "compile": True},
    "fp32": {"set": ["train.bf16=false"]},
    "fp32-compiled": {"set": ["train.bf16=false"], "compile": True},
    # the PyTorch ops where the native CPU kernels run (kernels/native.py): GroupNorm + ReLU, scatter-max,
    # the dense canvas and stem conv instead of the sparse stem
    "torch-ops": {"set": [], "env": {"PFK_NATIVE": "0"}},
}


class _Variant:
    """One variant's model, optimizer and training step, built in this process."""

    def __init__(
        self, name: str, data: Path, overrides: list[str], batches: list[dict] | None = None
    ) -> None:
        from pfactory.detectors import registry
        from pfactory.train.data import data_info, epoch_batches, make_loader_factory, to_device
        from pfactory.train.rng import seed_everything
        from pfactory.train.runtime import Timer, setup_runtime, use_bf16
        from pfactory.train.schedule import make_optimizer

        v = VARIANTS[name]
        self.name, self.compiled = name, bool(v.get("compile"))
        params = make_params([*overrides, *v["set"]])
        mp, self.tp = params.model, params.train
        self.rt = setup_runtime("cpu" if not torch.cuda.is_available() else self.tp.device)
        info = data_info(data)
        seed_everything(self.tp.seed)
        if batches is None:
            loader = make_loader_factory(self.tp)(data, "train", self.tp.batch_size, True, self.tp.augment,
                                                  self.tp.seed, self.rt.device, self.tp.num_threads)  # fmt: skip
            batches = [to_device(b, self.rt.device) for _, b in zip(range(8), epoch_batches(loader, 0, 0))]
        self.batches = batches
        self.model = registry.build(mp.arch, mp.selected, info.spec()).to(self.rt.device)
        if v.get("memory_format") == "contiguous":
            self.model = self.model.to(memory_format=torch.contiguous_format)
        self.optimizer = make_optimizer(self.model, self.tp)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.forward: Any = self.model
        if self.compiled:
            from pfactory.detectors.contract import for_compile

            # what `factory train -S train.compile=true` compiles: the for_compile conversion, the C kernels
            # as custom ops; automatic dynamic shapes: P goes symbolic on its 1st change
            self.forward = torch.compile(for_compile(self.model), fullgraph=True)
        self.bf16 = use_bf16(self.tp.bf16, self.rt.device)
        self.timer = Timer()

    def step(self, i: int) -> float:
        """One training step on batch i (mod the batches); its seconds."""
        from pfactory.train.trainer import train_step

        t0 = time.perf_counter()
        train_step(self.forward, self.model, self.batches[i % len(self.batches)], self.optimizer, self.scheduler,
                   self.tp, self.rt, self.timer, self.bf16)  # fmt: skip
        return time.perf_counter() - t0

    def frames(self) -> int:
        from torch._dynamo.utils import counters

        return sum(counters["frames"].values())

    def row(self, times: list[float], first: float, steps: int, recompiles: int | None) -> dict[str, Any]:
        row: dict[str, Any] = {"variant": self.name, "samples/s": self.tp.batch_size / statistics.median(times),
                               "step ms": 1000 * statistics.median(times)}  # fmt: skip
        for k in ("targets", "forward", "backward", "optimizer"):
            row[f"{k} ms"] = 1000 * self.timer.totals.get(k, 0.0) / steps
        row["warm-up s"] = first
        if self.compiled:
            row["recompiles"] = recompiles
        points = sorted({int(b["points"].shape[1]) for b in self.batches})
        row["point counts"] = f"{points[0]}..{points[-1]}"
        return row


def variant_step_rate(
    name: str, data: Path, steps: int, overrides: list[str], warmup: int = 3
) -> dict[str, Any]:
    """samples/s, phase split (ms/step), peak RSS of `train_step` for one variant (this process)."""
    import resource

    v = _Variant(name, data, overrides)
    times, first, frames_after_warmup = [], 0.0, 0
    for i in range(warmup + steps):
        dt = v.step(i)
        if i < warmup:
            first += dt
            if i == warmup - 1:
                v.timer.totals.clear()
                frames_after_warmup = v.frames()
        else:
            times.append(dt)
    row = v.row(times, first, steps, v.frames() - frames_after_warmup)
    row["peak RSS MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def interleaved_step_rates(
    names: list[str], data: Path, steps: int, overrides: list[str], warmup: int = 16
) -> list[dict[str, Any]]:
    """The variants in one process on the same in-memory batches, their steps alternating (the first to
    go rotates each round), so a machine whose speed drifts (a shared VM) slows all of them alike.
    `warmup` untimed steps each first: every batch twice for a compiled variant (the point count goes
    dynamic on its 2nd shape). Variants that need their own environment (torch-ops) are refused."""
    env = [n for n in names if VARIANTS[n].get("env")]
    if env:
        raise SystemExit(f"--interleaved: {', '.join(env)} need their own process (environment variables)")
    built: list[_Variant] = []
    for n in names:
        built.append(_Variant(n, data, overrides, built[0].batches if built else None))
    first = []
    for v in built:
        t0 = time.perf_counter()
        for i in range(warmup):
            v.step(i)
        first.append(time.perf_counter() - t0)
        v.timer.totals.clear()
    start = built[0].frames()
    times: list[list[float]] = [[] for _ in built]
    for i in range(steps):
        for k in range(len(built)):
            j = (i + k) % len(built)
            times[j].append(built[j].step(i))
    recompiles = built[0].frames() - start  # Dynamo's counter is per process: every compiled variant's
    return [v.row(t, f, steps, recompiles) for v, t, f in zip(built, times, first)]


def cmd_variants(args: argparse.Namespace) -> None:
    import os
    import subprocess

    if args.child:
        print("VARIANT " + json.dumps(variant_step_rate(args.child, Path(args.data), args.steps, args.set)))
        return
    if args.interleaved:
        rows = interleaved_step_rates(args.variants, Path(args.data), args.steps, args.set)
        print_table(rows)
        for r in rows:
            print(
                f"{r['variant']}: {r['samples/s'] / rows[0]['samples/s']:.2f}x {rows[0]['variant']} samples/s"
            )
        return
    rows = []
    for name in args.variants:
        cmd = [
            sys.executable,
            __file__,
            "variants",
            "--data",
            args.data,
            "--steps",
            str(args.steps),
            "--child",
            name,
        ]
        for over in args.set:
            cmd += ["-S", over]
        t0 = time.perf_counter()
        env = {**os.environ, **VARIANTS[name].get("env", {})}
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("VARIANT ")]
        if res.returncode or not line:
            print(f"{name}: failed (exit {res.returncode})\n{res.stderr[-3000:]}", file=sys.stderr)
            continue
        row = json.loads(line[-1].removeprefix("VARIANT "))
        row["process s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    base = next((r for r in rows if r["variant"] == "eager"), None)
    if base:
        for r in rows:
            print(f"{r['variant']}: {r['samples/s'] / base['samples/s']:.2f}x eager samples/s")


# --------------------------------------------------------------------------------------------------
# dynamo over an epoch of real batches
# --------------------------------------------------------------------------------------------------
def cmd_explain(args: argparse.Namespace) -> None:
    """`torch._dynamo.explain` over the default training step (forward + targets + loss) on the first
    real batch, then one compiled epoch (fullgraph, automatic dynamic shapes, forward + backward) over
    every training batch: graph breaks, graphs, and the recompiles the varying point counts cause."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from pfactory.detectors import registry
    from pfactory.detectors.contract import LossContext
    from pfactory.train.data import data_info, epoch_batches, make_loader_factory

    params = make_params(args.set)
    mp, tp = params.model, params.train
    info = data_info(Path(args.data))
    loader = make_loader_factory(tp)(Path(args.data), "train", tp.batch_size, True, tp.augment, tp.seed,
                                     torch.device("cpu"), tp.num_threads)  # fmt: skip
    from pfactory.detectors.contract import for_compile

    model = for_compile(registry.build(mp.arch, mp.selected, info.spec()))
    ctx = LossContext(lambda t: t)

    def step(points, num_points, images, proj, cam_valid, boxes, labels, num_boxes):
        out = model(points, num_points, images, proj, cam_valid)
        batch = {"boxes": boxes, "labels": labels, "num_boxes": num_boxes}
        return model.loss(out, batch, ctx)["loss"]

    keys = ("points", "num_points", "images", "proj", "cam_valid", "boxes", "labels", "num_boxes")
    batches = [tuple(b[k] for k in keys) for b in epoch_batches(loader, 0, 0)]
    torch._dynamo.reset()
    ex = torch._dynamo.explain(step)(*batches[0])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend=args.compile_backend, fullgraph=True)
    t0 = time.perf_counter()
    for b in batches:
        compiled(*b).backward()
    points = sorted(int(b[0].shape[1]) for b in batches)
    print(json.dumps({
        "graph breaks": ex.graph_break_count, "graphs (explain)": ex.graph_count,
        "break reasons": [str(r.reason) for r in ex.break_reasons],
        "epoch batches": len(batches), "distinct point counts": len(set(points)),
        "point counts": f"{points[0]}..{points[-1]}", "graphs compiled over the epoch": counters["stats"]["unique_graphs"],
        "recompiles": counters["stats"]["unique_graphs"] - 1, "backend": args.compile_backend,
        "epoch s": round(time.perf_counter() - t0, 1),
    }, indent=2))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# A/B against another source tree (e.g. a checkout of an earlier commit)
# --------------------------------------------------------------------------------------------------
def cmd_ab(args: argparse.Namespace) -> None:
    """Each tree's own default training step on the same prepared data, interleaved round by round
    (baseline, this tree, baseline, ...), each run its own process (`benchmarks/ab_step.py` with the
    tree first on PYTHONPATH): medians per tree and the ratio of the medians."""
    import os
    import subprocess

    trees = {"baseline": Path(args.baseline).resolve(), "this tree": ROOT}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for label, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_step.py"), str(Path(args.data).resolve()),
                   str(args.steps), "3", json.dumps(args.set)]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("AB ")]
            if res.returncode or not line:
                raise SystemExit(f"{label} ({tree}) failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
            row = {"round": r + 1, "tree": label, **json.loads(line[-1].removeprefix("AB "))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    med = {k: statistics.median(x["samples/s"] for x in rows if x["tree"] == k) for k in trees}
    print(f"\nmedian samples/s: baseline {med['baseline']:.2f}, this tree {med['this tree']:.2f} -> "
          f"{med['this tree'] / med['baseline']:.2f}x")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# accuracy: frames and ablation
# --------------------------------------------------------------------------------------------------
def _subset_kitti(raw: Path, dst: Path, frames: int) -> Path:
    """The first `frames` frames of a KITTI-layout dataset (hard links: no copy)."""
    src = raw / "training"
    for part in ("velodyne", "image_2", "calib", "label_2"):
        (dst / "training" / part).mkdir(parents=True, exist_ok=True)
        for f in sorted((src / part).iterdir())[:frames]:
            target = dst / "training" / part / f.name
            if not target.exists():
                target.hardlink_to(f)
    return dst


def _prepare(params: Any, raw: Path, out: Path) -> Path:
    import tasks.prepare

    if not (out / "manifest.json").is_file():
        tasks.prepare.run(params, raw, out, track=False)
    return out


def _train_and_score(params: Any, data: Path, out: Path, val_data: Path, backend: str) -> dict[str, Any]:
    import tasks.train
    from pfactory.detectors.inference import evaluate_kpis, predict
    from pfactory.detectors.io import load_model
    from pfactory.prepare.loader import make_loader

    t0 = time.perf_counter()
    c0 = time.process_time()
    s = tasks.train.run(
        params, data, out, track=False, loader_factory=loader_factory(backend), progress=False
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    model, config = load_model(out)
    val = make_loader(val_data, "val", 8, device="cpu", backend=backend)
    gts, preds = predict(model, val, config["classes"], params.evaluate.score_threshold)
    kpis = evaluate_kpis(gts, preds, config["classes"]).metrics
    return {"train s": s["train_seconds"], "run wall s": wall, "run CPU s": cpu, "steps": s["steps"],
            "epochs": s["epochs"], "val frames": len(gts), **kpi_row(kpis), "kpis": kpis}  # fmt: skip


def cmd_frames(args: argparse.Namespace) -> None:
    from pfactory.synth.dataset import generate_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = make_params(args.set)
    val_fraction = base.prepare.val_fraction
    sizes = sorted(args.frames)
    total = math.ceil(sizes[-1] / (1 - val_fraction))
    raw = work / f"raw_seed{args.seed}_{total}"
    if not raw.is_dir():
        t0 = time.perf_counter()
        generate_dataset(raw, frames=total, seed=args.seed, workers=args.workers)
        print(f"synth {total} frames: {time.perf_counter() - t0:.0f} s", flush=True)
    # Prepared data depends on params.prepare (e.g. voxel_size): its hash names the directories.
    tag = hashlib.sha256(
        json.dumps(base.prepare.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()[:8]
    full = _prepare(base, raw, work / f"prep_seed{args.seed}_{total}_{tag}")
    rows = []
    for n in sizes:
        k = math.ceil(n / (1 - val_fraction))
        if k >= total:
            data = full
        else:
            subset = _subset_kitti(raw, work / f"raw_seed{args.seed}_{k}", k)
            data = _prepare(base, subset, work / f"prep_seed{args.seed}_{k}_{tag}")
        for camera in (True, False) if args.ablation else (True,):
            over = [*args.set, f"model.painted_pillars.camera={camera}", "train.checkpoint_every_steps=100000"]
            if args.steps:
                over += [f"train.max_steps={args.steps}", "train.epochs=1000"]
            params = make_params(over)
            out = work / f"model_{k}_cam{int(camera)}_{args.steps or 'epochs'}"
            shutil.rmtree(out, ignore_errors=True)
            r = _train_and_score(params, data, out, full, args.backend)
            manifest = json.loads((data / "manifest.json").read_text())
            row = {"train frames": manifest["splits"]["train"]["frames"], "camera": camera, **r}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kpis"}), flush=True)
    budget = f"steps{args.steps}" if args.steps else "epochs"
    (work / f"frames_results_{budget}.json").write_text(json.dumps(rows, indent=1))
    keys = ["train frames", "camera", "steps", "epochs", "train s", "mAP", "Car AP@2m", "Pedestrian AP@2m",
            "Cyclist AP@2m", "0-20 m mAP", "20-40 m mAP", "40+ m mAP"]  # fmt: skip
    print_table(rows, keys)


def cmd_ablation(args: argparse.Namespace) -> None:
    rows = []
    for camera in (True, False):
        over = [*args.set, f"model.painted_pillars.camera={camera}", "train.checkpoint_every_steps=100000"]
        if args.steps:
            over += [f"train.max_steps={args.steps}", "train.epochs=1000"]
        with tempfile.TemporaryDirectory() as tmp:
            r = _train_and_score(make_params(over), Path(args.data), Path(tmp), Path(args.data), args.backend)
        rows.append({"camera": camera, **r})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kpis"}), flush=True)
    keys = [k for k in rows[0] if k not in ("kpis",)]
    print_table(rows, keys)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("throughput", "variants", "ab", "explain", "frames", "ablation"):
        p = sub.add_parser(name)
        p.add_argument("-S", "--set", action="append", default=[], help="section.key=value override")
        p.add_argument(
            "--backend", default="torch", choices=["torch", "dali"], help="loader for accuracy runs"
        )
        if name in ("throughput", "ablation", "variants", "ab", "explain"):
            p.add_argument("--data", required=True, help="a prepared directory")
        if name == "variants":
            p.add_argument("--steps", type=int, default=20, help="timed steps per variant (after 3 warm-up)")
            p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
            p.add_argument("--child", default=None, help=argparse.SUPPRESS)
            p.add_argument(
                "--interleaved",
                action="store_true",
                help="all variants in one process, steps alternating (medians robust to a drifting machine)",
            )
        if name == "explain":
            p.add_argument(
                "--compile-backend",
                default="eager",
                help="torch.compile backend for the epoch (inductor: slow)",
            )
        if name == "ab":
            p.add_argument("--baseline", required=True, help="the other source tree (a checkout)")
            p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 warm-up)")
            p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one run per tree each)")
        if name == "throughput":
            p.add_argument("--steps", type=int, default=20)
            p.add_argument("--batch", type=int, default=4)
        if name in ("frames", "ablation"):
            p.add_argument(
                "--steps", type=int, default=None, help="fixed optimizer-step budget (default: epochs)"
            )
        if name == "frames":
            p.add_argument(
                "--frames", type=int, nargs="+", default=[200, 800, 2000], help="train-split sizes"
            )
            p.add_argument("--seed", type=int, default=7)
            p.add_argument("--workers", type=int, default=2)
            p.add_argument(
                "--work", default="artifacts/bench_train", help="scratch directory (kept for reuse)"
            )
            p.add_argument("--ablation", action="store_true", help="also train lidar-only at each size")
    args = parser.parse_args(argv)
    {
        "throughput": cmd_throughput,
        "variants": cmd_variants,
        "ab": cmd_ab,
        "explain": cmd_explain,
        "frames": cmd_frames,
        "ablation": cmd_ablation,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
