"""Scale: synth -> prepare -> (train, one epoch) -> evaluate at 1x, 4x, 16x the default frame count.

Each size gets its own temporary project (`<workdir>/n<frames>/`: a copy of params.yaml, `dvc init --no-scm`,
its own sqlite MLflow store); each stage runs there as its own process, `python -m tasks.<stage> -S ...`,
one at a time. Per stage and size it records:
  seconds and seconds per frame (frames the stage handles: synth/prepare all of them, train the train split,
  evaluate the evaluated split), peak resident memory of the whole process tree (the stage process and its
  descendants, /proc sampled every 0.1 s through psutil; `ru_maxrss` from wait4 as the largest single
  process, a cross-check), bytes and files the stage wrote (its output folder walked), its largest file (a
  listing such as per_frame.json or the manifest) and the manifest's size, the DVC cache objects `dvc add
  <output>` added (and the cache's total, the time of that add and of a `dvc status` after it), and the MLflow records the
  stage added (runs, params, metrics, tags rows in the tracking store; files in its artifact store).
Train: one epoch (`train.epochs=1`) at the sizes of `--train-sizes` (default: the two smallest); its
"seconds" are the training loop's own (data + forward + backward + optimizer, the trainer's timers).
Evaluate needs an optimized model: `--optimized DIR` (backend.json), else one built once by the optimize
stage (`--optimize-precision`, default fp32) from `--model DIR` (model.pt), else from the model the first
one-epoch train of this run wrote; kept in `<workdir>/shared/`.
Targets (issue 50), checked between the largest size and the one before it / the smallest:
  s/frame at the largest within 15 % of the one before; peak memory at the largest <= 1.5x the smallest, per
  stage; bytes, files, largest file, manifest, DVC objects and MLflow records per frame: linear or better
  (the largest's per-frame figure <= 1.1x the smallest's).
In pieces (the machine's lock is held <= 8 min): `--workdir W --sizes 4000 --stages synth --json a.json`,
then `--stages prepare ...` with the same W, then `--merge a.json b.json ... [--json all.json]`: one table.

Run: `factory bench scale [--sizes 250,1000,4000] [--quick] [--json out.json] [--svg docs/scale.svg]`
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("synth", "prepare", "train", "evaluate")
OUT_KEY = {"synth": "synth", "prepare": "prepared", "train": "model", "evaluate": "eval"}  # params.yaml paths
SPF_TOLERANCE, PEAK_LIMIT, LINEAR_TOLERANCE = 1.15, 1.5, 1.10
GROWTH_COLUMNS = ("bytes", "files", "largest_file_bytes", "manifest_bytes", "dvc_objects", "mlflow_records")


def stage_env(project: Path) -> dict[str, str]:
    """The environment of a stage process in `project`: its own MLflow store, Dask scratch, Prefect home and
    DVC site cache; the compiled-kernel and export caches stay the main project's (built once, not timed)."""
    from pfactory.runtime.project import configure_environment

    configure_environment(ROOT)  # the shared caches' defaults (kernels, Triton, ONNX export)
    env = dict(os.environ)
    state = project / "artifacts" / ".state"
    env.update({
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'artifacts' / 'mlflow' / 'mlflow.db'}",
        "DASK_TEMPORARY_DIRECTORY": str(state / "dask"), "PREFECT_HOME": str(state / "prefect"),
        "DVC_SITE_CACHE_DIR": str(state / "dvc-site"), "PYTHONPATH": str(ROOT),
    })  # fmt: skip
    for k in ("PFACTORY_PARENT_RUN_ID", "PFACTORY_TIMINGS_DIR", "PFACTORY_OUTCOME_DIR"):
        env.pop(k, None)
    return env


def make_project(path: Path) -> Path:
    """`path` as a project of its own: params.yaml (the main one's; its paths resolve under `path`) and DVC."""
    if not (path / "params.yaml").is_file():
        path.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "params.yaml", path / "params.yaml")
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=path, check=True,
                       env=stage_env(path))  # fmt: skip
    (path / "logs").mkdir(exist_ok=True)
    return path


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and all its descendants now (0 when it is gone)."""
    import psutil

    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a child that ended between the listing and now
            total += p.memory_info().rss
    return total


def run_measured(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run `cmd` in `cwd`, stdout+stderr to `log`; returns {"seconds", "peak_rss", "maxrss", "code"}: the
    process tree's peak resident bytes (sampled every 0.1 s) and the largest process's (wait4's ru_maxrss)."""
    with open(log, "wb") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        peak = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.1)
        seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": seconds, "peak_rss": peak, "maxrss": usage.ru_maxrss * 1024, "code": proc.returncode}


def last_json(log: Path) -> dict[str, Any]:
    """The metrics a stage printed last (`tasks._stage.run_stage`: an indented JSON object on stdout)."""
    lines = log.read_text(errors="replace").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == "{":
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    return {}


def walk(folder: Path) -> dict[str, int]:
    """Bytes, files and the largest file's bytes under `folder` (its `.pfactory-output` marker included)."""
    sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return {"bytes": sum(sizes), "files": len(sizes), "largest_file_bytes": max(sizes, default=0)}


def mlflow_counts(project: Path) -> dict[str, int]:
    """Rows of the project's sqlite MLflow store (runs, params, metrics incl. every step, tags) and the files
    of its artifact store; zeros before the first run."""
    db = project / "artifacts" / "mlflow" / "mlflow.db"
    out = {"mlflow_runs": 0, "mlflow_params": 0, "mlflow_metrics": 0, "mlflow_tags": 0}
    if db.is_file():
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for key, table in (
                ("runs", "runs"),
                ("params", "params"),
                ("metrics", "metrics"),
                ("tags", "tags"),
            ):
                out[f"mlflow_{key}"] = con.execute(f"select count(*) from {table}").fetchone()[0]
        finally:
            con.close()
    out["mlflow_artifacts"] = walk(project / "artifacts" / "mlflow" / "artifacts")["files"]
    return out


def dvc_track(project: Path, out_rel: str, env: dict[str, str]) -> dict[str, Any]:
    """`dvc add` the stage's output, then `dvc status`: both timed; the cache's object count after."""
    dvc = [sys.executable, "-m", "dvc"]
    t0 = time.perf_counter()
    subprocess.run([*dvc, "add", "-q", out_rel], cwd=project, env=env, check=True, capture_output=True)
    add_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([*dvc, "status", "-q"], cwd=project, env=env, capture_output=True)
    status_s = time.perf_counter() - t0
    objects = dvc_objects(project)
    return {"dvc_cache_total": objects, "dvc_add_s": round(add_s, 2), "dvc_status_s": round(status_s, 2)}


def dvc_objects(project: Path) -> int:
    """Files in the project's DVC cache (one per distinct file content, one per directory listing)."""
    return sum(1 for p in (project / ".dvc" / "cache").rglob("*") if p.is_file())


def stage_args(stage: str, size: int, shared: Path) -> list[str]:
    """The stage's arguments besides its paths (params.yaml's, under the project)."""
    if stage == "synth":
        return ["-S", f"synth.frames={size}"]
    if stage == "train":
        return ["-S", "train.epochs=1", "-S", "train.val_every_epochs=0"]
    if stage == "evaluate":
        ref = ["--reference", str(shared / "model")] if (shared / "model" / "model.pt").is_file() else []
        return ["--model", str(shared / "optimized"), *ref, "--no-summary"]
    return []


def measure_stage(project: Path, size: int, stage: str, shared: Path) -> dict[str, Any]:
    """Run one stage in `project` (synth at `size` frames) and return its row (module docstring)."""
    env = stage_env(project)
    cmd = [sys.executable, "-m", f"tasks.{stage}", *stage_args(stage, size, shared)]
    before, cached = mlflow_counts(project), dvc_objects(project)
    load0 = os.getloadavg()[0]
    r = run_measured(cmd, project, env, project / "logs" / f"{stage}.log")
    load1 = os.getloadavg()[0]
    if r["code"] != 0:
        tail = (project / "logs" / f"{stage}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"bench scale: {stage} at {size} frames exited {r['code']}:\n{tail}")
    metrics = last_json(project / "logs" / f"{stage}.log")
    out_rel = f"artifacts/{OUT_KEY[stage]}" if stage != "synth" else "artifacts/data/raw/synth"
    files = walk(project / out_rel)
    manifest = project / out_rel / "manifest.json"
    frames, seconds = stage_frames(project, stage, size, metrics), r["seconds"]
    if stage == "train":  # the epoch itself: the trainer's step timers (start-up and model saving apart)
        t = metrics.get("timings_s", {})
        seconds = sum(t.get(k, 0.0) for k in ("data", "forward", "backward", "optimizer"))
    after = mlflow_counts(project)
    added = {k: after[k] - before[k] for k in after}
    row = {
        "size": size, "stage": stage, "frames": frames, "seconds": round(seconds, 3),
        "process_s": round(r["seconds"], 3), "s_per_frame": round(seconds / max(frames, 1), 5),
        "peak_rss_mb": round(r["peak_rss"] / 2**20, 1), "maxrss_mb": round(r["maxrss"] / 2**20, 1), **files,
        "manifest_bytes": manifest.stat().st_size if manifest.is_file() else 0,
        **(dvc := dvc_track(project, out_rel, env)), "dvc_objects": dvc["dvc_cache_total"] - cached, **added,
        "mlflow_records": sum(added[k] for k in ("mlflow_runs", "mlflow_params", "mlflow_metrics", "mlflow_tags")),
        "load": f"{load0:.2f}->{load1:.2f}",
    }  # fmt: skip
    print(f"  {size:>6} {stage:<9} {frames:>6} frames {seconds:8.1f} s  {row['s_per_frame']:.4f} s/frame  "
          f"peak {row['peak_rss_mb']:.0f} MB  {row['files']} files  load {row['load']}", flush=True)  # fmt: skip
    return row


def stage_frames(project: Path, stage: str, size: int, metrics: dict[str, Any]) -> int:
    """The frames `stage` handled: synth/prepare the dataset's, train its train split, evaluate what it scored."""
    if stage == "evaluate":
        return int(metrics.get("frames") or 0)
    if stage == "train":
        manifest = json.loads((project / "artifacts" / "prepared" / "manifest.json").read_text())
        return int(manifest["counts"]["train"])
    return size


def ensure_optimized(args: argparse.Namespace, shared: Path, project: Path, trained: Path | None) -> None:
    """`shared/optimized` (and `shared/model`, the reference) ready for evaluate (module docstring); the
    optimize stage runs in `project` (its prepared data: calibration and parity frames)."""
    if (shared / "optimized" / "backend.json").is_file():
        return
    if args.optimized:
        shutil.copytree(args.optimized, shared / "optimized")
        return
    model = args.model if args.model and (args.model / "model.pt").is_file() else trained
    if model is None:
        raise SystemExit(
            f"bench scale: evaluate needs a model: --optimized DIR, --model DIR (model.pt; {args.model} has "
            "none) or a size in --train-sizes before it"
        )
    if not (shared / "model").is_dir():
        shutil.copytree(model, shared / "model")
    cmd = [sys.executable, "-m", "tasks.optimize", "--model", str(shared / "model"), "--out",
           str(shared / "optimized"), "--precision", args.optimize_precision, "--backend", "onnxruntime",
           "-S", "optimize.latency.iterations=3", "-S", "optimize.int8.sensitivity.enabled=false"]  # fmt: skip
    r = run_measured(cmd, project, stage_env(project), project / "logs" / "optimize.log")
    if r["code"] != 0:
        tail = (project / "logs" / "optimize.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"bench scale: optimize exited {r['code']}:\n{tail}")
    print(f"  optimized ({args.optimize_precision}) from {model} in {r['seconds']:.1f} s", flush=True)


def run_sizes(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Every size of `args.sizes`, one after the other, the stages of `args.stages` in DAG order."""
    shared = workdir / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes:
        project = make_project(workdir / f"n{size}")
        for stage in args.stages:
            if stage == "train" and size not in args.train_sizes:
                continue
            if stage == "evaluate":
                model = project / "artifacts" / "model"
                ensure_optimized(args, shared, project, model if (model / "model.pt").is_file() else None)
            rows.append(measure_stage(project, size, stage, shared))
    return rows


def _per_frame(row: dict[str, Any], key: str) -> float:
    return row[key] / max(row["frames"], 1)


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per stage, between the sizes measured (module docstring): one verdict each,
    {"stage", "target", "value", "limit", "passed"}; a stage measured at fewer than two sizes has none."""
    verdicts = []
    for stage in STAGES:
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["size"])
        if len(mine) < 2:
            continue
        first, prev, last = mine[0], mine[-2], mine[-1]
        span = f"{last['size']} vs {prev['size']}"
        spf = last["s_per_frame"] / prev["s_per_frame"] if prev["s_per_frame"] else math.inf
        verdicts.append({"stage": stage, "target": f"s/frame {span}", "value": spf, "limit": SPF_TOLERANCE})
        if stage != "train":  # train's memory follows the batch, not the dataset: reported, not judged
            peak = last["peak_rss_mb"] / first["peak_rss_mb"] if first["peak_rss_mb"] else math.inf
            verdicts.append({"stage": stage, "target": f"peak memory {last['size']} vs {first['size']}",
                             "value": peak, "limit": PEAK_LIMIT})  # fmt: skip
        for key in GROWTH_COLUMNS:
            a, b = _per_frame(first, key), _per_frame(last, key)
            if a == 0 and b == 0:
                continue
            verdicts.append({"stage": stage, "target": f"{key}/frame {last['size']} vs {first['size']}",
                             "value": b / a if a else math.inf, "limit": LINEAR_TOLERANCE})  # fmt: skip
    for v in verdicts:
        v["value"] = round(v["value"], 3)
        v["passed"] = v["value"] <= v["limit"]
    return verdicts


def markdown(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> str:
    """The paste-ready table (one row per size and stage) and the targets' verdicts."""
    cols = ("size", "stage", "frames", "seconds", "s_per_frame", "peak_rss_mb", "maxrss_mb", "bytes", "files",
            "largest_file_bytes", "manifest_bytes", "dvc_objects", "dvc_cache_total", "dvc_add_s", "dvc_status_s", "mlflow_runs",
            "mlflow_params", "mlflow_metrics", "mlflow_artifacts", "load")  # fmt: skip
    head = ("raw frames", "stage", "frames", "s", "s/frame", "peak RSS MB (tree)", "max RSS MB (1 proc)",
            "bytes", "files", "largest file B", "manifest B", "DVC objects added", "DVC cache", "dvc add s", "dvc status s",
            "MLflow runs", "params", "metrics", "artifacts", "load")  # fmt: skip
    order = sorted(rows, key=lambda r: (r["size"], STAGES.index(r["stage"])))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in order]
    lines += ["", "| stage | target | value | limit | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {v['stage']} | {v['target']} | {v['value']:.3f} | {v['limit']} | "
              f"{'PASS' if v['passed'] else 'FAIL'} |" for v in verdicts]  # fmt: skip
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def svg_figure(rows: list[dict[str, Any]], title: str) -> str:
    """Two grouped-bar charts (the run report's `pfactory.report.svg`), seconds per frame and peak memory per
    stage, one bar per size, stacked in one SVG document."""
    from pfactory.report.svg import grouped_bars

    sizes = sorted({r["size"] for r in rows})
    colors = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756")
    groups = [(f"{s:,} frames", colors[i % len(colors)]) for i, s in enumerate(sizes)]
    charts = []
    for key, what, fmt in (("s_per_frame", "seconds per frame", "{:.3f} s"),
                           ("peak_rss_mb", "peak memory, process tree", "{:.0f} MB")):  # fmt: skip
        table = []
        for stage in STAGES:
            got = {r["size"]: r[key] for r in rows if r["stage"] == stage}
            if got:
                table.append((stage, [got.get(s, 0.0) for s in sizes]))
        charts.append(grouped_bars(table, groups, f"{title}: {what}", width=620, fmt=fmt))
    body, y = [], 0.0
    for chart in charts:
        height = float(chart.split('height="', 1)[1].split('"', 1)[0])
        body.append(chart.replace("<svg ", f'<svg x="0" y="{y:.0f}" ', 1))
        y += height + 12
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 620 {y:.0f}" width="620" height="{y:.0f}">'
            + "".join(body) + "</svg>\n")  # fmt: skip


def meta() -> dict[str, Any]:
    """Where and when: commit, machine, load."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "commit": commit.stdout.strip() + ("+dirty" if dirty else ""),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
        f"Python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_start": round(os.getloadavg()[0], 2),
    }


def _sizes(text: str) -> list[int]:
    if text.strip().lower() in ("", "none"):
        return []
    try:
        sizes = sorted({int(s) for s in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of frame counts: {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"frame counts must be >= 1: {text!r}")
    return sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="factory bench scale", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sizes", type=_sizes, default=[250, 1000, 4000], help="raw frame counts (default 250,1000,4000)"
    )
    ap.add_argument(
        "--train-sizes",
        type=_sizes,
        default=None,
        help="one-epoch train at these (default: the two smallest; none)",
    )
    ap.add_argument("--stages", default=",".join(STAGES), help=f"a subset of {','.join(STAGES)}")
    ap.add_argument(
        "--model", type=Path, default=ROOT / "artifacts" / "model", help="trained model (model.pt)"
    )
    ap.add_argument(
        "--optimized", type=Path, default=None, help="optimized model (backend.json): no optimize run"
    )
    ap.add_argument("--optimize-precision", default="fp32", choices=("fp32", "fp16", "int8"))
    ap.add_argument(
        "--workdir", type=Path, default=None, help="keep the projects here (default: a temp dir, removed)"
    )
    ap.add_argument("--quick", action="store_true", help="sizes 20,40 (the test)")
    ap.add_argument("--json", type=Path, help="write rows, verdicts and meta here")
    ap.add_argument("--svg", type=Path, help="write the figure (seconds per frame, peak memory) here")
    ap.add_argument("--merge", type=Path, nargs="+", help="no runs: merge these --json files into one table")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = [20, 40]
    if args.train_sizes is None:
        args.train_sizes = args.sizes[:2]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"--stages: unknown {unknown}; known: {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in stages]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.merge:
        docs = [json.loads(p.read_text()) for p in args.merge]
        rows, info = [r for d in docs for r in d["rows"]], [m for d in docs for m in d["meta"]]
    else:
        info = [meta()]
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-scale-"))
        print(f"bench scale: sizes {args.sizes}, stages {args.stages}, in {workdir} ({info[0]['commit']}, "
              f"load {info[0]['load_start']})", flush=True)  # fmt: skip
        try:
            rows = run_sizes(args, workdir.resolve())
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
        info[0]["load_end"] = round(os.getloadavg()[0], 2)
    verdicts = check_targets(rows)
    print("\n" + markdown(rows, verdicts))
    print(
        "\n"
        + "; ".join(f"{m['commit']} {m['date']} load {m['load_start']}->{m.get('load_end')}" for m in info)
    )
    if args.json:
        args.json.write_text(json.dumps({"meta": info, "rows": rows, "verdicts": verdicts}, indent=2) + "\n")
    if args.svg:
        args.svg.write_text(svg_figure(rows, "factory bench scale"))
    return 0 if all(v["passed"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
