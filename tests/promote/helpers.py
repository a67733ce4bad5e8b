"""A tiny but real promotion bench: synthetic data prepared twice, the tiny detector through the real optimize
stage, and evaluations computed with the KPI library (never canned numbers).

`build_bench(root)` is idempotent (a `.done` marker), so the registry suite and the stage test share one
build per pytest session. `write_eval(...)` writes a kpis.json in the evaluate stage's layout from
predictions derived from the ground truth with a chosen position jitter (the larger the jitter, the worse
the KPIs: a controllable "better" / "worse" candidate); `real_evaluate(...)` runs the optimized model
(ONNX Runtime) on a prepared split and scores it: the champion re-evaluation used by the tests.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.optimize import helpers

ROOT = Path(__file__).resolve().parents[2]
SPLIT = "val"


def build_bench(root: Path) -> dict[str, Path]:
    """raw (10 synthetic KITTI frames), prepared_a / prepared_b (two data versions), model, optimized."""
    paths = {
        "raw": root / "raw",
        "prepared_a": root / "prepared_a",
        "prepared_b": root / "prepared_b",
        "model": root / "model",
        "optimized": root / "optimized",
    }
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # pytest-xdist workers may build concurrently
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".done").is_file():
            return paths
        from pfactory.optimize.params import OptimizeParams
        from pfactory.prepare.params import PrepareParams
        from pfactory.prepare.stage import prepare_dataset
        from pfactory.synth.dataset import generate_dataset
        from tests.archs.painted_pillars.helpers import save_trained

        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import tasks.optimize

        generate_dataset(paths["raw"], frames=10, seed=3, cameras=1, image_size=(208, 64))
        for key, val_fraction in (("prepared_a", 0.5), ("prepared_b", 0.4)):
            prepare_dataset(
                paths["raw"], paths[key],
                PrepareParams(
                    image_size=list(helpers.IMAGE_SIZE), batch_size=4, shard_max_frames=4, val_fraction=val_fraction,
                    max_reject_fraction=0.5, pc_range=[0.0, -8.0, -3.0, 16.0, 8.0, 1.0], voxel_size=None,
                ),
            )  # fmt: skip
        save_trained(paths["model"], helpers.make_model(), ["image_2"])
        opt = OptimizeParams.model_validate(
            {
                "precision": "fp32", "dynamic_batch": False, "intra_op_threads": 1, "export_points": 512,
                "parity": {"frames": 2}, "latency": {"batch_sizes": [1], "warmup": 1, "iterations": 3, "eager": False},
            }
        )  # fmt: skip
        tasks.optimize.run(opt, paths["model"], paths["prepared_a"], paths["optimized"], track=False)
        (root / ".done").write_text("ok\n")
    return paths


def data_block(prepared: Path, frames: int) -> dict[str, Any]:
    """kpis.json's "data": a content hash of the evaluated split (its shards' sha256, manifest order)."""
    import hashlib

    manifest = json.loads((prepared / "manifest.json").read_text())
    shards = manifest["splits"][SPLIT]["shards"]
    digest = hashlib.sha256("\n".join(f"{s['file']}\t{s['sha256']}" for s in shards).encode()).hexdigest()
    return {"prepared_hash": digest, "split": SPLIT, "frames": frames}


def _batches(prepared: Path):
    from pfactory.prepare.loader import make_loader

    return make_loader(
        prepared, SPLIT, batch_size=2, shuffle=False, augment=None, seed=0, device="cpu", num_threads=1,
        backend="torch",
    )  # fmt: skip


def ground_truth(prepared: Path) -> list[Any]:
    """`FrameDetections` of the split's labelled boxes (training classes only)."""
    from pfactory.metrics import FrameDetections

    classes = json.loads((prepared / "manifest.json").read_text())["classes"]
    frames = []
    for batch in _batches(prepared):
        for i, fid in enumerate(batch.frame_ids):
            n = int(batch.num_boxes[i])
            labels = batch.labels[i, :n].numpy()
            keep = labels >= 0
            frames.append(
                FrameDetections(
                    str(fid), batch.boxes[i, :n].numpy()[keep], np.array([classes[k] for k in labels[keep]])
                )
            )
    return frames


def _document(
    metrics: dict[str, Any], reference: dict[str, Any] | None, data: dict[str, Any]
) -> dict[str, Any]:
    from pfactory.evaluate.report import kpi_delta

    doc = dict(metrics)
    doc["data"] = data
    if reference is not None:
        doc["reference"] = reference
        doc["delta"] = kpi_delta(metrics, reference)  # the evaluate stage's own delta: class AP, range
    return doc


def jittered(gt: list[Any], jitter_m: float, seed: int) -> list[Any]:
    """Predictions = ground truth with N(0, jitter_m) BEV centre noise and random scores."""
    from pfactory.metrics import FrameDetections

    rng = np.random.default_rng(seed)
    out = []
    for f in gt:
        boxes = f.boxes.copy()
        boxes[:, :2] += rng.normal(0.0, jitter_m, size=(len(boxes), 2))
        out.append(FrameDetections(f.frame_id, boxes, f.names, rng.uniform(0.3, 1.0, len(boxes))))
    return out


def write_eval(
    eval_dir: Path,
    prepared: Path,
    jitter_m: float,
    seed: int = 0,
    reference_jitter: float = 1.0,
    copies: int = 1,
) -> dict[str, Any]:
    """Write `eval_dir/kpis.json` for predictions jittered by `jitter_m`; the PyTorch reference's
    predictions are the same ones (same seed) jittered by `reference_jitter * jitter_m` (1: identical
    KPIs, delta 0 -- an optimized artifact that computes what PyTorch computes). `copies` > 1 evaluates
    the split's frames that many times (independent noise per copy): an evaluation with enough objects
    per class that one flipped detection is worth less than the parity tolerances."""
    from pfactory.metrics import FrameDetections, evaluate_detections
    from pfactory.storage.fsutil import atomic_write_json

    gt = [
        FrameDetections(f"{f.frame_id}#{k}" if copies > 1 else f.frame_id, f.boxes, f.names)
        for k in range(copies)
        for f in ground_truth(prepared)
    ]
    kpis = evaluate_detections(gt, jittered(gt, jitter_m, seed)).metrics
    ref = evaluate_detections(gt, jittered(gt, jitter_m * reference_jitter, seed)).metrics
    doc = _document(kpis, ref, data_block(prepared, len(gt)))
    atomic_write_json(eval_dir / "kpis.json", doc)
    return doc


def real_evaluate(optimized: Path, prepared: Path) -> dict[str, Any]:
    """KPIs of the optimized model's primary artifact (ONNX Runtime) on the split: inference + KPI library."""
    from pfactory.metrics import FrameDetections, evaluate_detections
    from pfactory.optimize.calibration import batch_to_feed
    from pfactory.optimize.runtime import load_runner, valid_detections

    classes = json.loads((prepared / "manifest.json").read_text())["classes"]
    runner = load_runner(optimized, intra_op_threads=1)
    preds = []
    for batch in _batches(prepared):
        out = runner.run(batch_to_feed(batch))
        for fid, det in zip(batch.frame_ids, valid_detections(out, 0.05)):
            names = np.array([classes[int(k)] for k in det["labels"]])
            preds.append(FrameDetections(str(fid), det["boxes"].astype(np.float64), names, det["scores"]))
    gt = ground_truth(prepared)
    return _document(evaluate_detections(gt, preds).metrics, None, data_block(prepared, len(gt)))


def candidate(
    root: Path, bench: dict[str, Path], name: str, jitter_m: float, prepared: str = "prepared_a"
) -> dict:
    """A candidate folder pair: a copy of the optimized dir (its own files) + an eval dir with kpis.json."""
    optimized = root / name / "optimized"
    shutil.copytree(bench["optimized"], optimized)
    kpis = write_eval(root / name / "eval", bench[prepared], jitter_m)
    return {"optimized": optimized, "eval": root / name / "eval", "kpis": kpis}


def honest_candidate(root: Path, bench: dict[str, Path], name: str, prepared: str = "prepared_a") -> dict:
    """`candidate`, with the kpis.json the evaluate stage writes for its artifact (`real_evaluate`; the
    reference = itself): what promotion's verification recomputes."""
    c = candidate(root, bench, name, 0.0, prepared)
    doc = real_evaluate(c["optimized"], bench[prepared])
    metrics = {k: v for k, v in doc.items() if k != "data"}
    c["kpis"] = _document(metrics, metrics, doc["data"])
    (c["eval"] / "kpis.json").write_text(json.dumps(c["kpis"]))
    return c


def promote_params(**over: Any):
    from pfactory.promote.params import PromoteParams

    base = {
        "model_name": "test-detector",
        "min_map": 0.2,
        "max_p99_latency_ms": 60000.0,
        "lock_timeout_s": 60.0,
    }
    return PromoteParams(**{**base, **over})


def run_cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`factory ...` in a subprocess (the real console entry), text output captured."""
    code = "from factory.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def reseal(optimized: Path) -> None:
    """Re-record the sha256 of `optimized`'s evidence files in its backend.json after a test edited them,
    as the optimize stage records what it wrote (the gates read evidence only after checking it). The
    artifacts' own hashes are left alone: a test that edits evidence is about the gates, not the check."""
    from pfactory.optimize.manifest import MANIFEST, file_hashes

    path = optimized / MANIFEST
    if not path.is_file():
        return
    manifest = json.loads(path.read_text())
    artifacts = {str(a["file"]) for a in manifest.get("artifacts") or []}
    for rel, sha in file_hashes(optimized).items():
        if rel.endswith(".json") and rel not in artifacts and rel in manifest.get("files", {}):
            manifest["files"][rel] = sha
    path.write_text(json.dumps(manifest, indent=1))
