"""What each stage's outputs are called (where they live: `pfactory.config.paths.PathsParams`), and the small readers of those files.

- the file names inside each stage's directory (`KPIS`, `BACKEND`, `WEIGHTS`, ...): every module that
  writes or reads a stage's output names it through here;
- readers (`kpis`, `parity`, `latency`, `backend_manifest`, `promotion`, `kpi_scalars`) for the flow,
  `factory compare` and the registry: JSON and arithmetic only, nothing heavy imported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# --- each stage's output layout: file names inside its `paths.<stage>` directory ----------------------

# prepare (`paths.prepared`)
PREPARED_MANIFEST = "manifest.json"  # schema version, counts, content hashes (pfactory.prepare.shards)
REJECTED = "rejected.jsonl"  # one refused frame per line
# train (`paths.model`)
WEIGHTS = "model.pt"  # state dict; torch.load(weights_only=True)
MODEL_CONFIG = "model_config.json"  # ModelParams + image size + cameras: rebuilds the network
CHECKPOINT = "checkpoint.pt"  # everything to resume (pfactory.train.checkpoint)
CURVES = "curves.json"  # per step (DVC plots)
VAL_CURVES = "val_curves.json"  # per validation (DVC plots)
TRAIN_METRICS = "metrics.json"  # final summary (DVC metrics)
# optimize (`paths.optimized`)
BACKEND = "backend.json"  # the optimized directory's manifest: artifacts, sha256 of every file, I/O
ONNX_FILE = "model.onnx"
ORT_DIR = "onnxruntime"
TRT_DIR = "tensorrt"
PARITY = "parity.json"
LATENCY = "latency.json"
# evaluate (`paths.eval`)
KPIS = "kpis.json"  # every KPI: per class, threshold, range, error type, frame (layout: docs/EVALUATE.md)
EVAL_METRICS = "metrics.json"  # the headline KPIs of kpis.json (`headline`): what DVC shows (dvc metrics)
PR_DIR = "pr"  # <class>.csv, DVC plots
REPORT_DIR = "report"  # predictions, per-frame counts, PNGs, timings
# promote (`paths.release`; the decision record under `paths.artifacts`)
PROMOTION = "promotion.json"
RELEASE_JSON = "release.json"
MODEL_CARD = "MODEL_CARD.md"
AUDIT_LOG = "audit.jsonl"


# --- small readers of the stage outputs (no heavy imports: flows and compare use them) ---------------


def read_json(path: Path) -> dict[str, Any] | None:
    """A stage's JSON output, or None when the stage has not written it."""
    return json.loads(path.read_text()) if path.is_file() else None


def kpis(eval_dir: Path) -> dict[str, Any] | None:
    """evaluate's kpis.json, or None."""
    return read_json(Path(eval_dir) / KPIS)


def parity(optimized: Path) -> dict[str, Any] | None:
    """optimize's parity.json, or None."""
    return read_json(Path(optimized) / PARITY)


def latency(optimized: Path) -> dict[str, Any] | None:
    """optimize's latency.json, or None."""
    return read_json(Path(optimized) / LATENCY)


def backend_manifest(optimized: Path) -> dict[str, Any] | None:
    """optimize's backend.json, or None."""
    return read_json(Path(optimized) / BACKEND)


def promotion(artifacts: Path) -> dict[str, Any] | None:
    """promote's decision record (promotion.json under `paths.artifacts`), or None."""
    return read_json(Path(artifacts) / PROMOTION)


def headline(kpis: dict[str, Any]) -> dict[str, Any]:
    """The headline of a kpis.json: the few numbers `dvc metrics show` / `dvc exp show` display and the
    pipeline's MLflow run carries: mAP, NDS, per class its AP (mean over thresholds) and TP errors, mAP per
    range bucket, the optimized - PyTorch delta, the reference mAP, frames, p50/p99 latency (batch 1)."""

    def num(x: Any) -> float | None:
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
        return float(x) if ok else None

    out: dict[str, Any] = {"mAP": num(kpis.get("mAP")), "NDS": num(kpis.get("NDS"))}
    out["classes"] = {
        name: {k: num(c.get(src)) for k, src in (("ap", "mean_ap"), ("ate", "ate"), ("ase", "ase"), ("aoe", "aoe"))}
        for name, c in (kpis.get("classes") or {}).items()
    }
    out["by_range"] = {b: num(block.get("mAP")) for b, block in (kpis.get("by_range") or {}).items()}
    out["delta_mAP"] = num((kpis.get("delta") or {}).get("mAP"))
    out["reference_mAP"] = num((kpis.get("reference") or {}).get("mAP"))
    out["frames"] = (kpis.get("data") or {}).get("frames")
    lat = kpis.get("latency") or {}
    primary = (lat.get("batch_1") or {}).get(lat.get("runner", ""), {})
    if primary:
        out["latency_ms"] = {"p50": num(primary.get("p50_ms")), "p99": num(primary.get("p99_ms"))}
    return out


def headline_scalars(kpis: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """`headline` as MLflow metrics, named like `kpi_scalars`: `eval/mAP`, `eval/Car/mean_ap`, `eval/Car/ate`,
    `eval/0-20/mAP`, `eval/delta/mAP`, `eval/reference/mAP`, plus the error breakdown (`error_scalars`:
    `eval/Car/errors/localization`, `eval/Car/dap/localization`, ...): the pipeline run's KPIs; the stage
    runs keep the detail."""
    h = headline(kpis)
    out = {f"{prefix}mAP": h["mAP"], f"{prefix}NDS": h["NDS"]}
    for name, c in h["classes"].items():
        out[f"{prefix}{name}/mean_ap"] = c["ap"]
        for k in ("ate", "ase", "aoe"):
            out[f"{prefix}{name}/{k}"] = c[k]
    for bucket, m in h["by_range"].items():
        out[f"{prefix}{bucket.replace('+', '-inf')}/mAP"] = m
    out[f"{prefix}delta/mAP"] = h["delta_mAP"]
    out[f"{prefix}reference/mAP"] = h["reference_mAP"]
    out.update(error_scalars(kpis, prefix))
    out.update(kitti_scalars(kpis, keys=("kitti",)))  # kitti/Car/3d/moderate, ... (R40, strict)
    return {k: float(v) for k, v in out.items() if v is not None}


KITTI_KEYS = ("kitti", "kitti_R11", "kitti_loose", "kitti_loose_R11")
"""kpis.json's KITTI tables (`pfactory.metrics.kitti_eval.KPI_KEYS`), each `[Class][metric][difficulty]`."""


def kitti_scalars(kpis: dict[str, Any], keys: tuple[str, ...] = KITTI_KEYS) -> dict[str, float]:
    """MLflow metrics of kpis.json's KITTI tables (docs/KPIS.md): `kitti/Car/3d/moderate` (R40, strict
    overlaps), `kitti_R11/...`, `kitti_loose/...`, `kitti_loose_R11/...`; undefined values left out."""
    out: dict[str, float] = {}
    for key in keys:
        for c, by_m in (kpis.get(key) or {}).items():
            for m, by_d in by_m.items():
                for d, v in by_d.items():
                    if v is not None:
                        out[f"{key}/{c}/{m}/{d}"] = float(v)
    return out


ERROR_COUNTS = ("tp", "duplicate", "classification", "localization", "both", "background", "missed", "heading_flip")
"""The counts of kpis.json's error breakdown (`errors.<class>`, pfactory/metrics/errors.py) logged to MLflow."""


def error_scalars(kpis: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """kpis.json's error breakdown (docs/KPIS.md "Error breakdown") as MLflow metrics, per class:
    `eval/<class>/errors/<label>` (detections of each label above the score threshold, `missed` ground
    truth, `heading_flip` tp) and `eval/<class>/dap/<type>` (the AP gained by fixing every error of that
    type). Empty when the document has no breakdown; non-finite values left out."""
    out: dict[str, float] = {}
    for name, block in (kpis.get("errors") or {}).items():
        for k in ERROR_COUNTS:
            if isinstance(block.get(k), int | float):
                out[f"{prefix}{name}/errors/{k}"] = float(block[k])
        for k, v in (block.get("dap") or {}).items():
            if isinstance(v, int | float) and math.isfinite(v):
                out[f"{prefix}{name}/dap/{k}"] = float(v)
    return out


def kpi_scalars(metrics: dict[str, Any], prefix: str = "val/") -> dict[str, float]:
    """Flatten a KPI summary (kpis.json, or train's validation KPIs) to MLflow scalars: `val/mAP`,
    `val/Car/ap_2.0`, `val/40-inf/Car/ap_2.0`, ... (non-finite and missing values left out)."""
    out: dict[str, float] = {f"{prefix}mAP": metrics["mAP"], f"{prefix}NDS": metrics["NDS"]}

    def classes(block: dict[str, Any], pre: str) -> None:
        for name, c in block["classes"].items():
            for th, ap in c["ap"].items():
                out[f"{pre}{name}/ap_{th}"] = ap
            out[f"{pre}{name}/mean_ap"] = c["mean_ap"]
            for k in ("ate", "ase", "aoe"):
                out[f"{pre}{name}/{k}"] = c[k]

    classes(metrics, prefix)
    for bucket, block in metrics.get("by_range", {}).items():
        key = bucket.replace("+", "-inf")  # MLflow names allow no "+": "40+" -> "40-inf"
        out[f"{prefix}{key}/mAP"] = block["mAP"]
        classes(block, f"{prefix}{key}/")
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}
