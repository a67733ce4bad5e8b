"""What a run report is made from, found from an evaluation directory, an MLflow run or a registered model.

In:  `EVAL_DIR` (the evaluate stage's output: `kpis.json`, `report/predictions.parquet`, optionally
     `report/per_frame.json` and `report/worst/*.png`), with the optimize stage's directory (parity.json,
     latency.json) and the prepared data beside it (`../optimized`, `../prepared`) or given; or an MLflow
     run (a pipeline run, or its evaluate stage run), or `MODEL@ALIAS` / `MODEL/VERSION` of the registry,
     whose artifacts are downloaded into a work directory first (`pfactory.report.sources`, the MLflow and
     registry side, kept apart so the evaluate stage's report depends on nothing of the registry).
Out: `ReportInputs` (KPI document, ground truth and detections, parity, latency, prepared data, the
     baseline to compare against, provenance, and notes on what could not be found and why).
Bad input raises `ReportError` naming the file or run and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import FrameDetections
from pfactory.report.frames import read_pngs


class ReportError(ValueError):
    """An input of the report that is missing or malformed (the message names it)."""


@dataclass
class Baseline:
    """The KPIs a report compares against: the champion's, or another run's."""

    label: str
    kpis: dict[str, Any]
    """`registry.evidence.kpi_summary` layout: mAP, NDS, classes {name: {mean_ap, ap, ate, ase, aoe}}."""
    note: str = ""
    """Why the comparison may not be like with like (other evaluation data), or ""."""


@dataclass
class ReportInputs:
    """Everything `build_report` reads (module docstring)."""

    name: str
    kpis: dict[str, Any]
    gt: list[FrameDetections]
    pred: list[FrameDetections]
    provenance: list[tuple[str, str]] = field(default_factory=list)
    parity: dict[str, Any] | None = None
    latency: dict[str, Any] | None = None
    prepared: Any | None = None
    """A `PreparedDataset` holding the evaluated split (checked by content hash), for the worst frames."""
    prerendered: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Worst-frame panels already drawn by the evaluate stage (`report/worst/`), by frame id."""
    baseline: Baseline | None = None
    no_baseline: str = "no champion in the registry"
    """Why there is no baseline, when there is none (the headline says it)."""
    notes: list[str] = field(default_factory=list)
    run_ids: dict[str, str] = field(default_factory=dict)
    """MLflow runs it came from (`pipeline`, `evaluate`), when it came from MLflow."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object (`registry.evidence.read_json`), its errors as `ReportError`."""
    from pfactory.promote.errors import EvidenceError
    from pfactory.promote.evidence import read_json

    try:
        return read_json(path, what)
    except EvidenceError as e:
        raise ReportError(str(e)) from None


def read_kpis(path: Path) -> dict[str, Any]:
    """An evaluate stage's kpis.json, checked for the fields the report reads."""
    kpis = _read_json(path, "the evaluate stage's KPI document")
    for key in ("mAP", "classes", "params", "data"):
        if key not in kpis:
            raise ReportError(f"{path}: field '{key}' missing; not written by the evaluate stage?")
    return kpis


def read_predictions(path: Path, frame_ids: list[str] | None = None) -> dict[str, list[FrameDetections]]:
    """`predictions.parquet` -> `{"ground_truth": [...], "optimized": [...], "reference": [...]}`, frames
    sorted by id, boxes in stored rank order: the order the evaluate stage scored them in. `frame_ids`
    adds frames without any box (the table has no row for them)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if not path.is_file():
        raise ReportError(f"{path}: missing; expected the evaluate stage's predictions table")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ReportError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    need = {"kind", "frame_id", "rank", "name", "score", "x", "y", "z", "l", "w", "h", "yaw"}
    if not need <= set(table.column_names):
        raise ReportError(f"{path}: columns {sorted(need - set(table.column_names))} missing")
    table = table.sort_by([("kind", "ascending"), ("frame_id", "ascending"), ("rank", "ascending")])
    out: dict[str, list[FrameDetections]] = {}
    all_ids = sorted(set(frame_ids or []) | set(table.column("frame_id").to_pylist()))
    for kind in ("ground_truth", "optimized", "reference"):
        t = table.filter(pc.equal(table.column("kind"), kind))
        if kind == "reference" and t.num_rows == 0:
            continue
        ids = np.asarray(t.column("frame_id").to_pylist(), dtype=object)
        boxes = np.stack([t.column(k).to_numpy() for k in ("x", "y", "z", "l", "w", "h", "yaw")], 1)  # [N, 7]
        names = np.asarray(t.column("name").to_pylist(), dtype=str)
        scores = None if kind == "ground_truth" else t.column("score").to_numpy(zero_copy_only=False)
        bounds = np.flatnonzero(ids[1:] != ids[:-1]) + 1 if len(ids) else np.zeros(0, np.int64)
        starts, stops = np.r_[0, bounds], np.r_[bounds, len(ids)]
        by_id = {ids[a]: (a, b) for a, b in zip(starts, stops) if b > a}
        frames = []
        for fid in all_ids:
            a, b = by_id.get(fid, (0, 0))
            frames.append(
                FrameDetections(fid, boxes[a:b], names[a:b], None if scores is None else scores[a:b])
            )
        out[kind] = frames
    return out


def _prepared_for(path: Path, kpis: dict[str, Any], notes: list[str]) -> Any | None:
    """The prepared dataset at `path` if it holds the evaluated split (same content hash), else None + a note."""
    from pfactory.evaluate.inputs import split_hash
    from pfactory.prepare.errors import SchemaError
    from pfactory.prepare.shards import open_prepared

    data = kpis.get("data") or {}
    try:
        ds = open_prepared(path)
        shards = ds.manifest["splits"][data.get("split", "val")]["shards"]
    except (SchemaError, KeyError, OSError, json.JSONDecodeError) as e:
        notes.append(f"prepared data at {path} not usable for the worst frames ({e})")
        return None
    got = split_hash(shards)
    if got != data.get("prepared_hash"):
        notes.append(
            f"prepared data at {path} is not the evaluated version (split hash {got[:12]}..., "
            f"kpis.json has {str(data.get('prepared_hash'))[:12]}...): worst frames drawn without it"
        )
        return None
    return ds


def load_eval_dir(
    eval_dir: Path,
    optimized: Path | None = None,
    prepared: Path | None = None,
    name: str | None = None,
) -> ReportInputs:
    """Inputs from an evaluation directory (module docstring); `optimized` / `prepared` default to the
    siblings `../optimized` and `../prepared` when those exist."""
    eval_dir = Path(eval_dir)
    if not eval_dir.is_dir():
        raise ReportError(
            f"{eval_dir}: not a directory; expected the evaluate stage's output (kpis.json, report/)"
        )
    kpis = _read_json(eval_dir / "kpis.json", "the evaluate stage's KPI document")
    for key in ("mAP", "classes", "params", "data"):
        if key not in kpis:
            raise ReportError(
                f"{eval_dir / 'kpis.json'}: field '{key}' missing; not written by the evaluate stage?"
            )
    per_frame = eval_dir / "report" / "per_frame.json"
    ids = None
    if per_frame.is_file():
        rows = (_read_json(per_frame, "per-frame counts").get("optimized")) or []
        ids = [r["frame_id"] for r in rows if isinstance(r, dict) and "frame_id" in r]
    kinds = read_predictions(eval_dir / "report" / "predictions.parquet", ids)
    notes: list[str] = []
    provenance = [("evaluation", str(eval_dir))]
    inputs = ReportInputs(
        name=name or str(eval_dir),
        kpis=kpis,
        gt=kinds["ground_truth"],
        pred=kinds["optimized"],
        provenance=provenance,
        notes=notes,
        prerendered=read_pngs(eval_dir / "report" / "worst"),
    )
    opt = optimized if optimized is not None else eval_dir.parent / "optimized"
    if opt.is_dir():
        provenance.append(("optimized", str(opt)))
        for fname, attr in (("parity.json", "parity"), ("latency.json", "latency")):
            if (opt / fname).is_file():
                setattr(inputs, attr, _read_json(opt / fname, f"the optimize stage's {fname}"))
            else:
                notes.append(f"{opt / fname} missing: no {attr} summary")
    else:
        notes.append(f"no optimize output at {opt}: no parity / latency summary (pass --optimized)")
    prep = prepared if prepared is not None else eval_dir.parent / "prepared"
    if prep.is_dir():
        inputs.prepared = _prepared_for(prep, kpis, notes)
        if inputs.prepared is not None:
            provenance.append(("prepared data", str(prep)))
    elif not inputs.prerendered:
        notes.append(
            f"no prepared data at {prep} and no drawn frames in report/worst/: worst frames not drawn"
        )
    return inputs


def summary_of(kpis: dict[str, Any], source: str) -> dict[str, Any]:
    """The comparable part of a KPI document (`registry.evidence.kpi_summary`), as `ReportError`."""
    from pfactory.promote.errors import EvidenceError
    from pfactory.promote.evidence import kpi_summary

    try:
        return kpi_summary(kpis, source)
    except EvidenceError as e:
        raise ReportError(str(e)) from None
