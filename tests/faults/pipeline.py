"""Whole-pipeline helpers of the fault suite: a throw-away project, `factory run` watched stage by stage,
SIGKILL of the whole run at a point inside a stage, and what a finished run must leave behind.

A run is started in its own session (process group), so a kill takes down everything it started: the flow,
DVC, the stage process, Dask workers, Prefect's local server -- a machine losing power, seen from the
project directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.flows.pipeline_project import STAGES, clean_env, make_project, tiny_args

__all__ = [
    "STAGES",
    "Run",
    "digest",
    "find_pickles",
    "finish",
    "half_written",
    "make_project",
    "mlflow_runs",
    "start_run",
]


@dataclass
class Run:
    """A started `factory run`: its process and what the watcher saw (stage -> [start, end] seconds)."""

    proc: subprocess.Popen
    t0: float
    log: Path
    seen: dict[str, list[float]] = field(default_factory=dict)
    killed: tuple[str, float] | None = None


# One Prefect home for every run of the session (Prefect creates and migrates its database on a first start:
# ~30 s here), shared as on a developer's machine -- also by runs that get SIGKILLed mid-write.
# (`PFACTORY_FAULTS_PREFECT_HOME`, set by tests/faults/conftest.py)


def start_run(project: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Run:
    log = project / f"run-{name}.log"
    home = os.environ.get("PFACTORY_FAULTS_PREFECT_HOME")
    env = {**({"PREFECT_HOME": home} if home else {}), **(env or {})}
    f = open(log, "w")  # noqa: SIM115 - the child keeps writing after this returns
    proc = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *tiny_args(), *extra, "--name", name, "--json"],
        cwd=project, env={**clean_env(project), **(env or {})}, stdout=subprocess.PIPE, stderr=f, text=True,
        start_new_session=True,
    )  # fmt: skip
    return Run(proc, time.perf_counter(), log)


def stage_process(run: Run) -> tuple[str, psutil.Process] | None:
    """The `python -m tasks.<stage>` process running under `run` now, if any."""
    try:
        children = psutil.Process(run.proc.pid).children(recursive=True)
    except psutil.Error:
        return None
    for c in children:
        with contextlib.suppress(psutil.Error):
            cmd = c.cmdline()
            if "-m" in cmd:
                mod = cmd[cmd.index("-m") + 1] if cmd.index("-m") + 1 < len(cmd) else ""
                if mod.startswith("tasks.") and mod.split(".", 1)[1] in STAGES:
                    return mod.split(".", 1)[1], c
    return None


def wait_for_stage(run: Run, stage: str, then_s: float = 0.0, timeout: float = 600) -> bool:
    """Wait until `stage`'s process runs under `run` (then `then_s` more seconds); False if the run ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        found = stage_process(run)
        if found and found[0] == stage:
            time.sleep(then_s)
            return True
        time.sleep(0.05)
    return False


def watch(run: Run, kill_at: tuple[str, float] | None = None, timeout: float = 900) -> None:
    """Follow `run` until it exits, noting each stage process's start/end; with `kill_at = (stage, s)`,
    SIGKILL the whole run `s` seconds after that stage's process started."""
    current: str | None = None
    deadline = time.perf_counter() + timeout
    while run.proc.poll() is None:
        now = time.perf_counter() - run.t0
        found = stage_process(run)
        name = found[0] if found else None
        if name != current:
            if current is not None:
                run.seen[current][1] = now
            if name is not None:
                run.seen[name] = [now, now]
            current = name
        if kill_at and name == kill_at[0] and now - run.seen[name][0] >= kill_at[1]:
            kill_tree(run.proc.pid)
            run.killed = (name, now - run.seen[name][0])
            break
        if time.perf_counter() > deadline:
            kill_tree(run.proc.pid)
            raise TimeoutError(f"factory run still running after {timeout} s: {run.log}")
        time.sleep(0.02)
    if current is not None and current in run.seen and run.seen[current][1] == run.seen[current][0]:
        run.seen[current][1] = time.perf_counter() - run.t0
    run.proc.wait()
    _reap_group(run.proc.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every descendant (also those in a session of their own)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for c in descendants:
        with contextlib.suppress(psutil.Error):
            c.kill()


def _reap_group(pgid: int) -> None:
    """Kill whatever of the run's process group is still alive (orphaned workers) and wait for it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline:
        alive = [p for p in psutil.process_iter(["pid"]) if _pgid(p) == pgid]
        if not alive:
            return
        time.sleep(0.1)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def finish(run: Run) -> dict[str, Any]:
    """The JSON result of a finished run (assert exit 0 first)."""
    out = run.proc.stdout.read() if run.proc.stdout else ""
    if run.proc.returncode != 0:
        raise AssertionError(
            f"factory run exited {run.proc.returncode}:\n{out[-2000:]}\n{run.log.read_text()[-4000:]}"
        )
    return json.loads(out[out.index("{") :])


# Outputs whose bytes are a function of code, data and params only (JSON files and kpis.json compared without
# their timings; latency.json and the release's audit/run ids are not deterministic by design).
DETERMINISTIC = (
    "artifacts/prepared",
    "artifacts/model/model.pt",
    "artifacts/model/model_config.json",
    "artifacts/optimized/model.onnx",
    "artifacts/optimized/onnxruntime",
    "artifacts/eval/report/kitti",
)
_NOT_DETERMINISTIC_KPIS = ("latency", "timings", "throughput_fps", "seconds", "time")


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not any(w in k for w in _NOT_DETERMINISTIC_KPIS)}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def digest(workspace: Path) -> dict[str, str]:
    """sha256 of every deterministic output of a run workspace, and of its KPIs without timings."""
    out: dict[str, str] = {}
    for rel in DETERMINISTIC:
        p = workspace / rel
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else []
        for f in files:
            data = f.read_bytes()
            if f.suffix == ".json":  # a JSON output may carry timings (calibration.json: its latency run)
                data = json.dumps(_strip(json.loads(data)), sort_keys=True).encode()
            out[f.relative_to(workspace).as_posix()] = hashlib.sha256(data).hexdigest()
    kpis = workspace / "artifacts/eval/kpis.json"
    if kpis.is_file():
        out["kpis (no timings)"] = hashlib.sha256(
            json.dumps(_strip(json.loads(kpis.read_text())), sort_keys=True).encode()
        ).hexdigest()
    return out


def half_written(workspace: Path) -> list[str]:
    """Outputs of a (killed) workspace that exist but are not complete: a later stage must never see one.

    Complete means: a prepared dir's manifest lists shards that exist with their sha256; a model.pt loads
    as a state dict; an optimized dir's backend.json lists files that exist with their sha256; kpis.json
    and release.json parse. Temporary siblings (`.name.*`) are not outputs and are ignored.
    """
    from pfactory.storage.fsutil import sha256_file

    bad: list[str] = []
    a = workspace / "artifacts"
    prepared = a / "prepared"
    if prepared.exists():
        try:
            m = json.loads((prepared / "manifest.json").read_text())
            for split in m["splits"].values():
                for s in split["shards"]:
                    if sha256_file(prepared / s["file"]) != s["sha256"]:
                        bad.append(f"prepared/{s['file']}: sha256 differs from the manifest")
        except (OSError, ValueError, KeyError) as e:
            bad.append(f"prepared: {type(e).__name__}: {e}")
    for name in ("model.pt", "checkpoint.pt"):
        f = a / "model" / name
        if f.exists():
            try:
                from pfactory.detectors.io import load_state

                load_state(f)
            except Exception as e:  # any failure to load: half-written
                bad.append(f"model/{name}: {e}")
    opt = a / "optimized"
    if opt.exists():
        try:
            m = json.loads((opt / "backend.json").read_text())
            for rel, sha in m.get("files", {}).items():
                if sha256_file(opt / rel) != sha:
                    bad.append(f"optimized/{rel}: sha256 differs from backend.json")
        except (OSError, ValueError, KeyError) as e:
            bad.append(f"optimized: {type(e).__name__}: {e}")
    for rel in ("eval/kpis.json", "release/release.json"):
        f = a / rel
        if f.parent.exists():
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as e:
                bad.append(f"{rel}: {type(e).__name__}: {e}")
    return bad


PICKLE_HEADS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"gAJ", b"gAN", b"gAS", b"gAW")


def find_pickles(root: Path) -> list[str]:
    """Files under `root` that are pickles (raw, or base64 as Prefect stores them): something could one day
    unpickle them. PyTorch files are zip archives (loaded with weights_only) and do not match."""
    found = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                head = f.read(3)
            if any(head.startswith(h) for h in PICKLE_HEADS):
                found.append(str(p.relative_to(root)))
    return found


def mlflow_runs(project: Path) -> list[Any]:
    """Every MLflow run of the project's store (all experiments)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'artifacts' / 'mlflow' / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, max_results=5000) if exps else []


def copy_cache(src: Path, dst: Path, keep_stages: list[str]) -> None:
    """Copy a project's DVC cache into `dst` keeping only the run-cache entries of `keep_stages`: a run in
    `dst` then restores those stages and computes the rest (a kill trial starts at the stage it kills)."""
    import yaml

    shutil.copytree(src / ".dvc" / "cache", dst / ".dvc" / "cache", dirs_exist_ok=True)
    runs = dst / ".dvc" / "cache" / "runs"
    if not runs.is_dir():
        return
    for entry in runs.rglob("*"):
        if not entry.is_file():
            continue
        try:
            doc = yaml.safe_load(entry.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        cmd = str((doc or {}).get("cmd", ""))
        if not any(cmd.endswith(f"tasks.{s}") for s in keep_stages):
            entry.unlink()
    # An emptied entry directory would make DVC look up a run it cannot find: remove those too.
    for d in sorted((d for d in runs.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
