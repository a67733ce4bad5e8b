"""The project a command runs in, and its offline, in-project environment.

`project_root()` finds the project (the nearest folder holding dvc.yaml / params.yaml / .dvc); `params_path()`
the params file every command reads; `configure_environment(root)` points MLflow at
`sqlite:///<root>/artifacts/mlflow/mlflow.db` (unless `MLFLOW_TRACKING_URI` is already set, e.g. to a tracking
server) and keeps Prefect, DVC, Dask and the compilers' scratch and telemetry inside the project and off the
network. Every stage and command needs these; none of it imports MLflow or the team's code.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFECT_STARTUP_TIMEOUT_S = 180  # see configure_environment


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
        "PFACTORY_DIGEST_CACHE_DIR": str(state / "digests"),  # raw data's content digests (sensors/digest.py)
        "MPLCONFIGDIR": str(state / "matplotlib"),
        # NumPy's OpenBLAS starts a thread per core and keeps them spinning after each call. The stages
        # parallelise with processes (synth's pool, Dask workers, DDP) and PyTorch / ONNX Runtime bring
        # their own thread pools, so those threads only take cores from the workers: synth on 2 workers
        # spent 0.28 instead of 0.22 CPU-s per frame (benchmarks/RESULTS.md, 2026-12-05).
        "OPENBLAS_NUM_THREADS": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Prefect does not create missing parents of PREFECT_HOME (its server DB then fails to open).
    for key in ("PREFECT_HOME", "DASK_TEMPORARY_DIRECTORY", "MPLCONFIGDIR", "DVC_SITE_CACHE_DIR"):
        if os.environ[key] == defaults[key]:
            Path(defaults[key]).mkdir(parents=True, exist_ok=True)
    return root
