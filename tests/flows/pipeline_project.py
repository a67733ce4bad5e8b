"""Helpers of the pipeline tests: a throw-away copy of the project and tiny pipeline parameters."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "synth.frames=12",
    "synth.workers=1",
    "prepare.val_fraction=0.3",
    "prepare.image_size=[104,32]",
    "train.epochs=1",
    "train.batch_size=2",
    "optimize.latency.iterations=3",
    "optimize.latency.warmup=1",
    "optimize.latency.batch_sizes=[1]",
    "optimize.int8.calibration_frames=4",
    "optimize.parity.frames=2",
    "evaluate.workers=1",
]
STAGES = ("synth", "prepare", "train", "optimize", "evaluate", "promote")
PREFECT_DB = "prefect.db"  # Prefect's SQLite database in PREFECT_HOME (its default connection URL)


def clean_env(project: Path) -> dict[str, str]:
    """A clean environment: the project's own in-project defaults (configure_environment), no inherited
    MLflow/Prefect/Dask locations, this interpreter's bin on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLFLOW_", "PREFECT_", "DASK_", "DVC_", "PFACTORY_"))
    }
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def tiny_args() -> list[str]:
    known = yaml.safe_load((REPO / "params.yaml").read_text())
    args = []
    for o in TINY:
        if o.split(".")[0] in known:  # sections that exist in this checkout
            args += ["-S", o]
    return args


def factory(
    project: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`factory <args>` with the project copy as cwd (its own pfactory/flows/tasks come first on sys.path)."""
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *args],
        cwd=project,
        env={**clean_env(project), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dvc(
    cwd: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`dvc <args>` in `cwd` with the clean environment (+ `env`)."""
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=cwd,
        env={**clean_env(cwd), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@functools.cache
def prefect_template() -> Path:
    """A migrated Prefect database, made once per test process (`prefect server database upgrade`, ~13 s on a
    quiet 2-core box, ~40 s loaded): what a project's first `factory run` would otherwise create."""
    home = Path(tempfile.mkdtemp(prefix="pf-prefect-template-"))
    atexit.register(shutil.rmtree, home, True)
    env = {**clean_env(home), "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                   env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    return home / PREFECT_DB


def make_project(root: Path, *, first_start: bool = False) -> Path:
    """Copy the project into `root`: code, dvc.yaml, params.yaml, .dvcignore, .gitignore, a fresh `.dvc/`.

    The project's Prefect database (`artifacts/.state/prefect`, where `configure_environment` puts it) is a
    copy of `prefect_template()`, as after a developer's first run; `first_start=True` leaves none, so the
    first `factory run` creates it (the newcomer's path: tests/flows/test_pipeline.py keeps one)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("pfactory", "tasks", "kernels", "flows"):
        shutil.copytree(REPO / d, root / d, ignore=ignore)
    for f in ("dvc.yaml", "params.yaml", ".dvcignore", ".gitignore"):
        shutil.copy2(REPO / f, root / f)
    (root / ".dvc").mkdir()
    (root / ".dvc" / "config").write_text("[core]\n    no_scm = true\n    analytics = false\n")
    if not first_start:
        home = root / "artifacts" / ".state" / "prefect"
        home.mkdir(parents=True)
        shutil.copy2(prefect_template(), home / PREFECT_DB)
    return root


def write_tiny_params(project: Path) -> None:
    """Write the TINY values into the project copy's params.yaml itself (comments kept, as `dvc exp run -S`
    keeps them), so commands run later on their defaults (`factory optimize`, ...) are tiny too."""
    from ruamel.yaml import YAML

    rt = YAML()  # round-trip: comments and key order survive
    path = project / "params.yaml"
    doc = rt.load(path.read_text())
    for override in TINY:
        key, value = override.split("=", 1)
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            if part not in node:
                break
            node = node[part]
        else:
            node[leaf] = yaml.safe_load(value)
    with path.open("w") as f:
        rt.dump(doc, f)
