"""`factory worker start --pool NAME [--dir DIR]`: a Prefect process worker on a host that holds no checkout.

In:  a work pool name, a worker directory DIR (default `~/.pfactory-worker/<pool>`), and the team's variables
     in the environment (never on argv): PREFECT_API_URL, PREFECT_API_AUTH_STRING (a team's Prefect),
     MLFLOW_TRACKING_URI with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (the team's MLflow), the DVC
     remote's credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ... for S3), PFACTORY_TRAIN_SLOT_LIMIT.
Out: the process becomes the real `prefect worker start --pool NAME --type process --name NAME` (exec: signals
     reach Prefect's worker, which stops cleanly on SIGTERM/Ctrl-C), with DIR as its cwd, after the process work
     pool is created through Prefect's client API when the server has none of that name.

What a flow run does on this worker: the deployment's pull step (`prefect.deployments.steps.git_clone`, made by
`factory deploy --pool`, flows/deploy.py) clones the project at the deployment's commit into a fresh per-run
folder under `DIR/tmp/` (Prefect's process worker makes one per run in the temp dir; TMPDIR points it here) and
runs the flow there with that folder first on PYTHONPATH: the code is the commit's, the dependencies are this
environment's (a worker runs in an environment that has the project's dependencies installed: `pip install -e
.[dev]` of any checkout, or the same requirements; Prefect's automatic `uv run` installs are turned off). The
pipeline reads and writes data through the DVC remote the cloned repository configures (`repro --pull`, `dvc push
--run-cache` after the run), logs to the team's MLflow and takes training slots from the team's Prefect. The
per-run folder is removed when the run ends; nothing persists in DIR but Prefect's home (`DIR/.prefect`).

DIR must not be inside a git checkout of the project (the point is a host without one): refused in one line,
exit 2, like a missing PREFECT_API_URL / MLFLOW_TRACKING_URI or a DIR others can read.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from pfactory.runtime.failures import EXIT_USAGE, UserError

WORKER_TYPES = ("process",)  # flow runs use this environment's interpreter and packages
DIR_ENV = "PFACTORY_WORKER_DIR"  # set in the worker's (and so every flow run's) environment
REQUIRED_ENV = {
    "PREFECT_API_URL": "the team's Prefect server (the lines `factory team up` prints)",
    "MLFLOW_TRACKING_URI": "the team's MLflow server: runs on a worker log there, not into a clone that is removed",
}
PROJECT_MARKERS = ("dvc.yaml", "flows/pipeline.py")  # a git top level holding either is a checkout of the project


class WorkerError(UserError, ValueError):
    """A worker setting that is wrong (the message, one line, names the option or variable); exit 2."""

    exit_code = EXIT_USAGE


def default_dir(pool: str) -> Path:
    """`~/.pfactory-worker/<pool>`: the worker directory when `--dir` is not given."""
    return Path.home() / ".pfactory-worker" / pool


def checkout_around(path: Path) -> Path | None:
    """The top level of the git work tree of the project that holds `path` (or its nearest existing parent),
    else None. A work tree counts when its top level holds one of PROJECT_MARKERS."""
    here = Path(path).absolute()
    while not here.exists():
        here = here.parent
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--show-toplevel"],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    top = Path(out.stdout.strip())
    return top if any((top / m).exists() for m in PROJECT_MARKERS) else None


def prepare_dir(path: Path) -> Path:
    """The worker directory, absolute: created 0700 (parents too) with `tmp/` in it, or an existing one that
    only its owner can open. WorkerError (one line) when it is inside a checkout of the project, not a
    directory, or open to the group/others."""
    path = Path(path).expanduser().absolute()
    top = checkout_around(path)
    if top is not None:
        raise WorkerError(
            f"--dir {path}: inside the git checkout {top}; a worker needs a directory that holds no checkout "
            "(flow runs clone the deployment's commit)"
        )
    if path.exists() and not path.is_dir():
        raise WorkerError(f"--dir {path}: not a directory")
    if path.is_dir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise WorkerError(f"--dir {path}: mode {mode:o}; expected owner-only (chmod 700 {path})")
    else:
        old = os.umask(0o077)
        try:
            path.mkdir(parents=True, mode=0o700)
        finally:
            os.umask(old)
    for sub in ("tmp", ".prefect"):
        (path / sub).mkdir(mode=0o700, exist_ok=True)
    return path.resolve()


def worker_env(base: Mapping[str, str], dir: Path) -> dict[str, str]:
    """The environment of `prefect worker start` (and so of its flow runs): `base` (the caller's, with the
    team's variables and credentials) plus where things go: TMPDIR=`DIR/tmp` (per-run clones), PREFECT_HOME=
    `DIR/.prefect` unless set, PFACTORY_WORKER_DIR=DIR, this interpreter's bin first on PATH (the stages'
    `python`), automatic dependency installs off; without PFACTORY_ROOT (the code is the clone's).
    WorkerError naming a REQUIRED_ENV variable that is missing."""
    for key, what in REQUIRED_ENV.items():
        if not base.get(key):
            raise WorkerError(f"{key} is not set: export it ({what})")
    env = {k: v for k, v in base.items() if k != "PFACTORY_ROOT"}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["TMPDIR"] = str(dir / "tmp")
    env.setdefault("PREFECT_HOME", str(dir / ".prefect"))
    env[DIR_ENV] = str(dir)
    env["PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES"] = "false"
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def ensure_pool(pool: str, type: str = "process") -> bool:
    """Create the work pool `pool` of `type` on the server at PREFECT_API_URL (Prefect's client API, the
    worker type's default job template) when it has none by that name; True when created. A pool of another
    type is a WorkerError naming it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=pool, type=type, base_job_template=ProcessWorker.get_default_base_job_template()
                    )
                )
                return True
            except ObjectAlreadyExists:  # another worker made it just now
                existing = client.read_work_pool(pool)
        if existing.type != type:
            raise WorkerError(f"--pool {pool}: a work pool of type {existing.type!r} exists; expected {type!r}")
        return False


def worker_name(dir: Path) -> str:
    """`<host>-<dir name>`: how the worker shows in Prefect (and in its log lines)."""
    return f"{socket.gethostname()}-{dir.name}"


def worker_command(pool: str, type: str, name: str, limit: int | None = None) -> list[str]:
    """argv of the real worker (no secret on it: they stay in the environment)."""
    exe = Path(sys.executable).parent / "prefect"
    cmd = [str(exe) if exe.is_file() else "prefect", "worker", "start", "--pool", pool, "--type", type]
    cmd += ["--name", name]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def start(pool: str, dir: Path | None = None, type: str = "process", name: str | None = None,
          limit: int | None = None) -> None:  # fmt: skip
    """Check the settings, create the pool if missing, then exec `prefect worker start` in DIR (does not
    return). WorkerError for a bad setting; a Prefect 401 propagates (the CLI says it in one line, exit 77)."""
    if type not in WORKER_TYPES:
        raise WorkerError(f"--type {type}: expected one of {', '.join(WORKER_TYPES)}")
    if not pool or "/" in pool:
        raise WorkerError(f"--pool {pool!r}: expected a work pool name without '/'")
    path = prepare_dir(dir if dir is not None else default_dir(pool))
    env = worker_env(os.environ, path)
    os.environ.update({k: env[k] for k in ("PREFECT_HOME",)})  # this process's client too: nothing in ~/.prefect
    ensure_pool(pool, type)
    cmd = worker_command(pool, type, name or worker_name(path), limit)
    os.chdir(path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)


# `factory worker ...` (registered in factory/cli.py).
worker_app = typer.Typer(help="Prefect workers: run the team's deployments on this host (no checkout).",
                         no_args_is_help=True)  # fmt: skip


@worker_app.command("start")
def start_cmd(
    pool: Annotated[str, typer.Option("--pool", help="The work pool to poll (created, type process, if missing).")],
    dir: Annotated[
        Path | None,
        typer.Option("--dir", help="The worker's directory (created 0700; no checkout). Default: "
                     "~/.pfactory-worker/POOL."),
    ] = None,
    type: Annotated[str, typer.Option("--type", help="Worker type (process: runs use this environment).")] = "process",
    name: Annotated[str | None, typer.Option("--name", help="Worker name (default: HOST-DIRNAME).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Flow runs at once (default: no limit).")] = None,
) -> None:
    """Start a Prefect process worker for POOL in DIR, with the team's environment (module docstring).

    Example: factory worker start --pool gpu --dir /srv/pfactory-worker"""
    from pfactory.runtime.failures import prefect_refusal

    try:
        start(pool, dir, type, name, limit)
    except WorkerError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)
        raise typer.Exit(e.exit_code) from None
    except Exception as e:
        refused = prefect_refusal(e)
        if refused is None:
            raise
        typer.secho(refused.reason, fg=typer.colors.RED, err=True)
        raise typer.Exit(refused.code) from None
