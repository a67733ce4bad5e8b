"""`factory bench scale` (benchmarks/bench_scale.py) for real at tiny sizes: each stage a process in a temp
project, its figures read back from the JSON and checked against what the stage wrote.

The default tier runs synth + prepare at 12 and 24 frames (~30 s on 2 cores); the full tier adds one-epoch
train, an FP32 optimize and evaluate (~2.5 min).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KITTI_FILES_PER_FRAME = 4  # image_2/*.png, velodyne/*.bin, label_2/*.txt, calib/*.txt
SYNTH_EXTRA_FILES = 2  # synth.json and the stage's .pfactory-output marker


def _bench(tmp: Path, *args: str) -> tuple[dict, str]:
    out = tmp / "scale.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--workdir", str(tmp / "work"),
         "--json", str(out), "--svg", str(tmp / "scale.svg"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]  # 1: a target failed
    return json.loads(out.read_text()), res.stdout


def _finite_positive(row: dict, *keys: str) -> None:
    for k in keys:
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0, (k, row)


def test_synth_and_prepare_figures(tmp_path: Path) -> None:
    doc, stdout = _bench(tmp_path, "--sizes", "12,24", "--stages", "synth,prepare")
    rows = {(r["size"], r["stage"]): r for r in doc["rows"]}
    assert set(rows) == {(12, "synth"), (12, "prepare"), (24, "synth"), (24, "prepare")}
    for (size, stage), r in rows.items():
        _finite_positive(r, "seconds", "s_per_frame", "peak_rss_mb", "maxrss_mb", "bytes", "files")
        assert r["frames"] == size
        assert r["s_per_frame"] == pytest.approx(r["seconds"] / size, rel=1e-3, abs=1e-5)
        assert r["peak_rss_mb"] >= 0.5 * r["maxrss_mb"], r  # the tree's sampled peak vs its largest process
        out = (
            tmp_path
            / "work"
            / f"n{size}"
            / "artifacts"
            / ("data/raw/synth" if stage == "synth" else "prepared")
        )
        files = [p for p in out.rglob("*") if p.is_file()]
        assert (r["files"], r["bytes"]) == (len(files), sum(p.stat().st_size for p in files))
        assert r["dvc_add_s"] > 0 and r["dvc_status_s"] > 0
    for size in (12, 24):
        synth, prep = rows[size, "synth"], rows[size, "prepare"]
        assert synth["files"] == KITTI_FILES_PER_FRAME * size + SYNTH_EXTRA_FILES
        # one cache object per distinct file (calib files repeat) plus the directory's listing
        assert 2 * size < synth["dvc_objects"] <= synth["files"] + 1
        assert synth["mlflow_runs"] == 0 and prep["mlflow_runs"] == 1 and prep["mlflow_params"] > 0
        manifest = json.loads(
            (tmp_path / "work" / f"n{size}" / "artifacts/prepared/manifest.json").read_text()
        )
        assert manifest["counts"]["total"] == size
        assert prep["manifest_bytes"] == len(
            (tmp_path / "work" / f"n{size}" / "artifacts/prepared/manifest.json").read_bytes()
        )
        assert prep["dvc_cache_total"] == synth["dvc_objects"] + prep["dvc_objects"]
    targets = {(v["stage"], v["target"].split(" ")[0]) for v in doc["verdicts"]}
    for stage in ("synth", "prepare"):
        assert {
            (stage, "s/frame"),
            (stage, "peak"),
            (stage, "bytes/frame"),
            (stage, "files/frame"),
        } <= targets
    assert "| raw frames | stage |" in stdout
    assert stdout.count("| PASS |") + stdout.count("| FAIL |") == len(doc["verdicts"]) > 0
    svg = ET.fromstring((tmp_path / "scale.svg").read_text())
    assert len(svg.findall("{http://www.w3.org/2000/svg}svg")) == 2  # seconds per frame, peak memory
    merged = tmp_path / "merged.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--merge",
                    str(tmp_path / "scale.json"), str(tmp_path / "scale.json"), "--json", str(merged)],
                   cwd=ROOT, capture_output=True, timeout=120)  # fmt: skip
    assert len(json.loads(merged.read_text())["rows"]) == 2 * len(rows)


@pytest.mark.full
def test_every_stage_with_train_and_evaluate(tmp_path: Path) -> None:
    doc, _ = _bench(tmp_path, "--quick")
    rows = {(r["size"], r["stage"]): r for r in doc["rows"]}
    assert set(rows) == {(s, st) for s in (20, 40) for st in ("synth", "prepare", "train", "evaluate")}
    for size in (20, 40):
        manifest = json.loads(
            (tmp_path / "work" / f"n{size}" / "artifacts/prepared/manifest.json").read_text()
        )
        train, ev = rows[size, "train"], rows[size, "evaluate"]
        assert train["frames"] == manifest["counts"]["train"]
        assert ev["frames"] == manifest["counts"]["val"] > 0
        _finite_positive(train, "seconds", "s_per_frame", "peak_rss_mb")
        _finite_positive(ev, "seconds", "s_per_frame", "peak_rss_mb", "files", "mlflow_metrics")
        assert ev["mlflow_runs"] == 1 and train["mlflow_runs"] == 1
        # evaluate's LocalCluster: the tree (driver + 2 workers) holds more than its largest process
        assert ev["peak_rss_mb"] > ev["maxrss_mb"]
    assert (tmp_path / "work" / "shared" / "optimized" / "backend.json").is_file()
