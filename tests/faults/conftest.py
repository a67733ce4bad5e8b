"""Fixtures of the fault suite: clean datasets to plant faults in, the `factory` entry point run in-process,
the ledger every fault test records into, and the size switch.

Size: CI runs every case of the bad-input corpus and the hostile-parameter/path/security probes in full (they
take seconds), and the heavy matrices (SIGKILL per stage, concurrent runs, infrastructure) at small size:
one trial per kill point on a tiny pipeline. `PFACTORY_FAULTS_FULL=1` (what `python -m tests.faults.run
--full` sets) runs the full matrix: every kill point, 3 trials at random offsets each.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.ledger import LEDGER_ENV, Ledger, machine, now
from tests.prepare.conftest import synth_kitti, synth_nuscenes  # noqa: F401 - the clean datasets
from tests.promote.conftest import bench, registry  # noqa: F401 - the promotion bench, a fresh registry

REPO = Path(__file__).resolve().parents[2]
FULL = os.environ.get("PFACTORY_FAULTS_FULL", "") not in ("", "0", "false")
LEDGER = Ledger()
_T0 = time.time()
_LOAD0 = os.getloadavg()[0]


# The commit the session started at (the code it runs; a commit made while it runs is not it), "+changes"
# when the tree differs from it.
_COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
_DIRTY = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=REPO, capture_output=True)


def _save_ledger(exitstatus: int | str) -> None:
    path = os.environ.get(LEDGER_ENV)
    if path and LEDGER.entries:
        LEDGER.save(
            path,
            {
                "when": now(),
                "commit": (_COMMIT.stdout.strip() or "?") + ("+changes" if _DIRTY.returncode else ""),
                "machine": machine(),
                "load_start": round(_LOAD0, 2),
                "full": FULL,
                "seconds": time.time() - _T0,
                "exitstatus": exitstatus,
                "command": os.environ.get("PFACTORY_FAULTS_COMMAND", "pytest tests/faults"),
            },
        )


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    """The ledger so far after every test: a session killed at its time limit (a slice of the full matrix
    run under a deadline) still leaves the trials it finished, its exit status 'interrupted'."""
    _save_ledger("interrupted")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _save_ledger(int(exitstatus))


@pytest.fixture(scope="session")
def ledger() -> Ledger:
    return LEDGER


@pytest.fixture(scope="session")
def full() -> bool:
    return FULL


@pytest.fixture(scope="session", autouse=True)
def _offline_state(tmp_path_factory) -> Iterator[None]:
    """MLflow, Prefect, Dask state of in-process runs in a tmp dir (not the checkout's artifacts/)."""
    state = tmp_path_factory.mktemp("faults-state")
    keys = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}",
        "PREFECT_HOME": str(state / "prefect"),
        "DASK_TEMPORARY_DIRECTORY": str(state / "dask"),
        "PFACTORY_FAULTS_PREFECT_HOME": str(
            state / "prefect-runs"
        ),  # what tests/faults/pipeline.py runs share
    }
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    for k in ("PREFECT_HOME", "DASK_TEMPORARY_DIRECTORY", "PFACTORY_FAULTS_PREFECT_HOME"):
        Path(keys[k]).mkdir(parents=True, exist_ok=True)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def clean_kitti(request: pytest.FixtureRequest) -> Path:
    """10 synthetic frames in the KITTI layout (tests/prepare/conftest.py's `synth_kitti`, 208x64 images):
    000000..000009. Never written to: every test plants its fault in a `copy_dataset`."""
    return request.getfixturevalue("synth_kitti")


@pytest.fixture(scope="session")
def clean_nuscenes(request: pytest.FixtureRequest) -> Path:
    """6 synthetic samples in the nuScenes layout, 3 cameras (tests/prepare/conftest.py's `synth_nuscenes`)."""
    return request.getfixturevalue("synth_nuscenes")


def overrides(*pairs: str) -> list[str]:
    """`-S k=v` arguments for each "k=v"."""
    return [a for p in pairs for a in ("-S", p)]


# Prepare at a tiny model input (what the corpus and the error tests run): images 104x32, batches of 4.
SMALL_PREPARE = overrides("prepare.image_size=[104,32]", "prepare.batch_size=4")
# Every frame may be refused (the corpus counts refusals itself).
CORPUS_PREPARE = [*SMALL_PREPARE, *overrides("prepare.max_reject_fraction=1")]
TINY_TRAIN = overrides("train.epochs=1", "train.batch_size=2", "train.val_every_epochs=0")


def copy_dataset(src: Path, dst: Path) -> Path:
    """A writable copy (real copies, no links: planting must never touch the clean original)."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def factory(*args: str) -> Result:
    """`factory ARGS` through the console-script entry (`factory.cli.main`), in this process: exit code,
    stdout, stderr. An exception escaping `main` is a crash: it is returned as exit code -1 with its
    traceback in `err`, so a test can assert there is none."""
    import traceback

    from factory.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["factory", *args]
    code = 0
    # A root handler an earlier test of this process left behind (Prefect's console handler, configured while
    # pytest captured stderr) writes to a closed stream: every library warning would add logging's own
    # "--- Logging error ---" report to `err`. A fresh `factory` process has none; set them aside meanwhile.
    root = logging.getLogger()
    stale = [h for h in root.handlers
             if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False)]  # fmt: skip
    for h in stale:
        root.removeHandler(h)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = -1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv
        for h in stale:
            root.addHandler(h)
    return Result(code, out.getvalue(), err.getvalue())


def one_line_error(r: Result) -> bool:
    """A clean failure: no traceback, a non-empty message."""
    return r.code not in (0, -1) and "Traceback" not in r.text and bool(r.err.strip() or r.out.strip())


def clean_env(**extra: str) -> dict[str, str]:
    """Environment for a `factory` subprocess (tests/flows/pipeline_project.py's: no inherited service
    addresses, this interpreter first) plus `extra`."""
    from tests.flows.pipeline_project import clean_env as project_env

    return {**project_env(REPO), **extra}


def run_measured(
    cmd: list[str], cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `cmd`: (completed process, seconds, peak resident memory of its process tree in MiB, sampled
    every 20 ms). Killed (with its children) at `timeout`, returned with returncode -9."""
    import threading

    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env if env is not None else clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                rss = ps.memory_info().rss + sum(
                    c.memory_info().rss for c in ps.children(recursive=True) if c.is_running()
                )
                peak[0] = max(peak[0], rss)
            done.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    finally:
        done.set()
        thread.join()
    return (
        subprocess.CompletedProcess(cmd, proc.returncode, out, err),
        time.perf_counter() - t0,
        peak[0] / 2**20,
    )


def factory_subprocess(
    *args: str, cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float, float]:
    """`factory ARGS` in a fresh interpreter: (process, seconds, peak RSS in MiB) (`run_measured`)."""
    return run_measured([sys.executable, "-m", "factory.cli", *args], cwd, timeout, env)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> dict:
    """An undisturbed tiny `factory run` (CI: through train; full matrix: every stage) in a fresh project:
    its project (DVC cache, run-cache, MLflow store), stage process times and deterministic digest.

    `PFACTORY_FAULTS_BASELINE=DIR` keeps it in DIR and reuses it in a later session with the same code and
    size (the full matrix run in slices: `python -m tests.faults.run --full --stage S --baseline DIR`)."""
    import json

    from tests.faults.pipeline import digest, finish, make_project, start_run, watch

    keep = os.environ.get("PFACTORY_FAULTS_BASELINE")
    import hashlib

    git = ["git", "-C", str(REPO)]
    # What the baseline run is a function of: the code copied into its project and the tiny parameters.
    code = (
        "pfactory",
        "tasks",
        "kernels",
        "flows",
        "dvc.yaml",
        "params.yaml",
        "tests/flows/pipeline_project.py",
    )
    tree = subprocess.run([*git, "ls-tree", "-r", "HEAD", "--", *code], capture_output=True).stdout
    dirty = subprocess.run([*git, "diff", "HEAD", "--", *code], capture_output=True).stdout
    key = {"code": hashlib.sha256(tree + dirty).hexdigest(), "full": FULL, "until": UNTIL}
    if keep:
        saved = Path(keep) / "baseline.json"
        if saved.is_file():
            doc = json.loads(saved.read_text())
            if doc.get("key") == key:
                return {**doc["baseline"], "project": Path(doc["baseline"]["project"])}
        shutil.rmtree(Path(keep) / "project", ignore_errors=True)
        project = make_project(Path(keep) / "project")
    else:
        project = make_project(tmp_path_factory.mktemp("baseline"))
    run = start_run(project, "baseline", *UNTIL)
    watch(run)
    result = finish(run)
    base = {
        "project": project,
        "seen": run.seen,
        "digest": digest(Path(result["workspace"])),
        "result": result,
    }
    if keep:
        doc = {"key": key, "baseline": {**base, "project": str(project)}}
        (Path(keep) / "baseline.json").write_text(json.dumps(doc, indent=1) + "\n")
    return base


UNTIL: list[str] = [] if FULL else ["--until", "train"]
