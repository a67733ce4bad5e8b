"""MLflow tracking with lineage, configured so a run stays offline and inside the project.

`configure_environment(root)` points MLflow at `sqlite:///<root>/artifacts/mlflow/mlflow.db`
(unless `MLFLOW_TRACKING_URI` is already set, e.g. to a tracking server), and keeps Prefect,
DVC and Dask scratch/telemetry inside the project and off the network.
`stage_run(stage, params)` opens one MLflow run per stage (nested under the pipeline's run
when `PFACTORY_PARENT_RUN_ID` is set) tagged with the lineage of DESIGN.md §9.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pfactory.failures import EXIT_TRANSIENT, UserError

EXPERIMENT = "perception-factory"
PARENT_ENV = "PFACTORY_PARENT_RUN_ID"
PREFECT_STARTUP_TIMEOUT_S = 180  # see configure_environment
LINEAGE_PACKAGES = (
    "torch",
    "triton",
    "nvidia-dali-cuda120",
    "onnx",
    "onnxruntime",
    "numpy",
    "pyarrow",
    "mlflow",
    "prefect",
    "dvc",
    "dask",
    "distributed",
)


def project_root(start: str | Path | None = None) -> Path:
    """The project root: the nearest folder from `start` (default: the cwd) upward that holds `dvc.yaml`,
    `params.yaml` or a `.dvc/` folder, the way git and DVC find theirs (a run workspace under
    artifacts/runs/ is a project of its own); the cwd when there is none (the embedded defaults)."""
    here = Path(start or os.getcwd()).resolve()
    for p in (here, *here.parents):
        if (p / "dvc.yaml").is_file() or (p / "params.yaml").is_file() or (p / ".dvc").is_dir():
            return p
    return here


def params_path(given: str | Path | None = None) -> Path:
    """The params file every command reads: `given` (`--params`), else the project's `params.yaml`
    (`project_root()` from the cwd). The one resolver of the CLI and the stage entries."""
    return Path(given) if given is not None else project_root() / "params.yaml"


def configure_environment(root: str | Path | None = None) -> Path:
    """Set offline, in-project defaults for MLflow, Prefect, DVC and Dask; returns the root.

    Only variables that are not already set are touched, so a user's `MLFLOW_TRACKING_URI`
    or `PREFECT_API_URL` (real servers), or their own `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`,
    wins.
    """
    root = project_root(root)
    state = root / "artifacts" / ".state"
    mlflow_dir = root / "artifacts" / "mlflow"
    mlflow_dir.mkdir(parents=True, exist_ok=True)
    defaults = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_dir / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        # A tracking server that does not answer fails a request after ~7 s (retries after 0, 2, 4 s),
        # not MLflow's ~4.5 min (7 retries, backoff 2, up to 120 s each): an unreachable server at start is
        # a fast, clear error; one that dies mid-run fails the stage promptly (its run is then reaped, see
        # `reap_orphan_runs`). A server that rate-limits for longer: raise these.
        # MLflow prints "View run ... at: <tracking URI>/#/..." for http stores: a password in the URI would
        # land on stdout (and in every stage log).
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # The ephemeral API creates and migrates its SQLite DB on a first start: 13 s on a quiet 2-core
        # box, 42 s on a 2-3x slower one at load 3, where Prefect's own default (20 s) timed out the very
        # first `factory run`. 4x the slowest start seen; only a genuinely stuck server waits this long.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(PREFECT_STARTUP_TIMEOUT_S),
        "DVC_NO_ANALYTICS": "1",
        "DVC_SITE_CACHE_DIR": str(state / "dvc-site"),  # DVC's default is under the system temp dir
        "DO_NOT_TRACK": "1",
        "DASK_TEMPORARY_DIRECTORY": str(state / "dask"),
        "TRITON_CACHE_DIR": str(state / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(state / "inductor"),
        "PFK_NATIVE_CACHE_DIR": str(state / "native"),  # the C kernels' builds (kernels/native.py)
        "PFACTORY_EXPORT_CACHE_DIR": str(state / "onnx-export"),  # traced graphs (inference/export_cache.py)
        "MPLCONFIGDIR": str(state / "matplotlib"),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Prefect does not create missing parents of PREFECT_HOME (its server DB then fails to open).
    for key in ("PREFECT_HOME", "DASK_TEMPORARY_DIRECTORY", "MPLCONFIGDIR", "DVC_SITE_CACHE_DIR"):
        if os.environ[key] == defaults[key]:
            Path(defaults[key]).mkdir(parents=True, exist_ok=True)
    return root


def redact_uri(uri: str) -> str:
    """`uri` with the password of its user info replaced by `***` (`http://me:s3cret@host` ->
    `http://me:***@host`): tracking/registry URIs are printed and logged only through this."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    if parts.password is None and "@" not in parts.netloc:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    # A user name alone may be the secret itself (a token as user info): then nothing of it is shown.
    netloc = f"{parts.username}:***@{host}" if parts.password is not None and parts.username else f"***@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def artifact_location(root: Path) -> str:
    return (root / "artifacts" / "mlflow" / "artifacts").resolve().as_uri()


def git_info(root: str | Path) -> dict[str, Any]:
    """`{"commit": sha or None, "dirty": bool or None}` of the repo at `root`."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit.strip() if commit else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


def package_versions(names: tuple[str, ...] = LINEAGE_PACKAGES) -> dict[str, str]:
    # Imported here: ~30 ms (email, zipfile), and every `factory` command imports this module (project_root).
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def device_info() -> str:
    """A short description of the compute device (GPU name, or the CPU and its core count).

    Asks torch only where the process has imported it already (a training stage): a stage or the flow that
    does not use torch is not made to import it (~1.5 s) for a tag. Elsewhere the GPU is the NVIDIA driver's
    first one (`/proc/driver/nvidia/gpus/*/information`) when the installed torch is a CUDA build."""
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"
    else:
        gpu = _nvidia_gpu()
        if gpu and _cuda_torch():
            return f"cuda:{gpu}"
    return f"cpu:{platform.machine()}x{os.cpu_count()}"


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the NVIDIA driver's per-GPU folders (Linux)


def _nvidia_gpu(gpus: Path = NVIDIA_GPUS) -> str | None:
    """The model name of the NVIDIA driver's first GPU (`<gpus>/<bus id>/information`, line `Model:`), else
    None."""
    for info in sorted(gpus.glob("*/information")):
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model" and value.strip():
                    return value.strip()
    return None


def _cuda_torch() -> bool:
    """Whether the installed torch is a CUDA build (its version has no `+cpu` local part)."""
    from importlib import metadata

    try:
        return _has("torch") and "+cpu" not in metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def lineage_tags(root: Path) -> dict[str, str]:
    g = git_info(root)
    tags = {
        "git.commit": str(g["commit"]),
        "git.dirty": str(g["dirty"]),
        "device": device_info(),
        **{f"version.{k}": v for k, v in package_versions().items()},
    }
    return tags


class TrackingUnavailable(UserError, ConnectionError):
    """The MLflow tracking server does not answer: the message names it (password redacted), what to try."""

    exit_code = EXIT_TRANSIENT  # worth a retry once the server is back


_CHECKED: set[str] = set()


def check_tracking_server(uri: str | None = None, timeout_s: float = 5.0) -> None:
    """For an http(s) tracking URI, one request to the server's `/health` (no retries): TrackingUnavailable
    when nothing answers, in seconds -- instead of MLflow's client retrying every later call. Any HTTP
    answer (even 401/404: a server behind auth, or without /health) counts as reachable; a team's server that
    refuses the credentials is `pfactory.team.errors.NotAuthenticated` (exit 77). Once per process."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")) or uri in _CHECKED:
        return
    import requests

    from pfactory.team.identity import current, tls_verify

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s, verify=tls_verify())
    except requests.RequestException as e:
        reason = type(e).__name__
        if isinstance(e, requests.ConnectionError):
            reason = "connection refused or host unreachable"
        elif isinstance(e, requests.Timeout):
            reason = f"no answer within {timeout_s:g} s"
        raise TrackingUnavailable(
            f"the MLflow tracking server {redact_uri(uri)} does not answer ({reason}): start it, fix "
            "MLFLOW_TRACKING_URI, or unset MLFLOW_TRACKING_URI to track into the local sqlite store"
        ) from None
    current(uri)  # a team's server (basic auth): NotAuthenticated, one line, instead of a 401 deep in a stage
    _CHECKED.add(uri)


KPI_VIEW = "kpis"
KPI_COLUMNS = (
    *(f"metrics.`{m}`" for m in ("eval/mAP", "eval/NDS", "eval/delta/mAP", "latency/p99_ms", "time/total_s")),
    "tags.`promotion.decision`",
    "attributes.`Models`",
)
EXPERIMENT_KIND = {
    "mlflow.experimentKind": "custom_model_development",
    f"mlflow.sharedViewState.{KPI_VIEW}": json.dumps(
        {"selectedColumns": list(KPI_COLUMNS), "columnOrder": list(KPI_COLUMNS)}
    ),
}
"""The experiment's tags. `mlflow.experimentKind`: MLflow 3's experiment type "Machine learning" (runs,
metrics, models), not the GenAI view (traces). `mlflow.sharedViewState.kpis`: a runs-table view (MLflow's
"share view" state, plain JSON) with the headline KPI columns, opened by `runs_table_url` (the table's
default columns are Source/Models/Dataset, kept per browser)."""


def runs_table_url(experiment: str, base: str = "http://127.0.0.1:5000") -> str:
    """The MLflow UI link to the experiment's runs table with the KPI columns (`EXPERIMENT_KIND`): MLflow 3.17
    opens an experiment in its GenAI view unless the URL (or a browser setting) says machine learning."""
    return f"{base}/#/experiments/{experiment}/runs?workflowType=machine_learning&viewStateShareKey={KPI_VIEW}"


def experiment_id(root: Path, name: str = EXPERIMENT) -> str:
    """The id of experiment `name`, created (artifacts under `root`, tagged a machine-learning experiment)
    when missing; an existing one without the experiment-type tag gets it. Safe when two processes create it
    at the same moment: the loser of the race reads the winner's experiment. A tracking server that does not
    answer is a TrackingUnavailable in seconds (`check_tracking_server`)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    check_tracking_server()
    with sqlite_store_lock():
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            try:
                return mlflow.create_experiment(
                    name, artifact_location=artifact_location(root), tags=EXPERIMENT_KIND
                )
            except MlflowException:
                exp = mlflow.get_experiment_by_name(name)
                if exp is None:
                    raise
        for k, v in EXPERIMENT_KIND.items():
            if (exp.tags or {}).get(k) != v:
                mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, k, v)
        return exp.experiment_id


@contextlib.contextmanager
def sqlite_store_lock(uri: str | None = None) -> Iterator[None]:
    """For a `sqlite:///` tracking store, an exclusive lock (`<db>.lock` beside it) while a process first
    opens it: the first opening creates and migrates the schema, and four `factory run` started at once on a
    fresh project ran MLflow's migrations concurrently and failed (alembic batch_alter_table errors). Other
    stores: no lock."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme, sep, rest = uri.partition(":///")
    if not sep or not scheme.startswith("sqlite") or rest in ("", ":memory:"):
        yield
        return
    import fcntl

    lock = Path(rest).with_name(Path(rest).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def process_tags() -> dict[str, str]:
    """Tags naming the process that owns a run (`reap_orphan_runs` reads them) and its user: the name a team's
    MLflow server authenticated (it stores "unknown" itself), else the OS account (`pfactory.team.identity`)."""
    import socket

    import psutil

    from pfactory.team.identity import user_name

    user = user_name()
    return {
        "pfactory.user": user,
        "mlflow.user": user,  # the runs table's "User" column
        "pfactory.host": socket.gethostname(),
        "pfactory.pid": str(os.getpid()),
        "pfactory.pid_started": f"{psutil.Process().create_time():.3f}",
    }


def reap_orphan_runs(experiment: str) -> list[str]:
    """Mark KILLED every RUNNING run of `experiment` whose process (tags of `process_tags`, this host) is
    gone: a stage or pipeline killed by a signal, or one that lost its tracking server mid-run, cannot end
    its own run, which would otherwise stay RUNNING forever. Returns the reaped run ids. Runs of live
    processes, of other hosts and without the tags are left alone."""
    import socket

    import psutil
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    host = socket.gethostname()
    runs = client.search_runs(
        [experiment], filter_string=f"attributes.status = 'RUNNING' and tags.`pfactory.host` = '{host}'",
        max_results=1000,
    )  # fmt: skip
    reaped = []
    for run in runs:
        tags = run.data.tags
        try:
            pid, started = int(tags["pfactory.pid"]), float(tags["pfactory.pid_started"])
        except (KeyError, ValueError):
            continue
        try:
            alive = abs(psutil.Process(pid).create_time() - started) < 1.0
        except psutil.Error:
            alive = False
        if alive:
            continue
        client.set_tag(run.info.run_id, "pfactory.ended_by", f"reaped: process {pid} on {host} is gone")
        client.set_terminated(run.info.run_id, status="KILLED")
        reaped.append(run.info.run_id)
    return reaped


@contextlib.contextmanager
def stage_run(
    stage: str, params: Mapping[str, Any], root: str | Path | None = None, run_name: str | None = None
) -> Iterator[Any]:
    """An MLflow run for one stage, with its params (prefixed by the stage) and lineage tags.

    Nested under `PFACTORY_PARENT_RUN_ID` when the pipeline flow set it. Yields the
    `mlflow.ActiveRun`; the run ends FAILED if the body raises.
    """
    import mlflow

    root = configure_environment(root)
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = experiment_id(root)
    reap_orphan_runs(exp_id)
    parent = os.environ.get(PARENT_ENV) or None
    tags = {"stage": stage, **lineage_tags(root), **process_tags()}
    with mlflow.start_run(
        experiment_id=exp_id,
        run_name=run_name or stage,
        parent_run_id=parent,
        nested=parent is not None,
        tags=tags,
    ) as run:
        flat = {f"{stage}.{k}": v for k, v in flatten(params).items()}
        items = list(flat.items())
        for i in range(0, len(items), 100):  # MLflow caps a log_params batch at 100
            mlflow.log_params(dict(items[i : i + 100]))
        yield run
        # The self-checked fast paths this stage used and their verdicts (`factory doctor`'s JSON, compact):
        # read from the module only if the stage loaded it, so tracking imports no kernels (prepare stays
        # free of torch).
        selfcheck = sys.modules.get("kernels.selfcheck")
        if selfcheck is not None and selfcheck.used():
            mlflow.log_param("selfcheck", selfcheck.used_json())
