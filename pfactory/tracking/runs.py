"""MLflow tracking with lineage: one run per stage, nested under the pipeline's run.

`stage_run(stage, params)` opens one MLflow run per stage (nested under the pipeline's run when
`PFACTORY_PARENT_RUN_ID` is set, in that run's experiment) tagged with the lineage of DESIGN.md §9
(`pfactory.runtime.lineage`) and the process that owns it; `reap_orphan_runs` ends the runs of processes that
are gone; `check_tracking_server` refuses an unreachable or refusing server in one line. The environment
(where the store is) comes from `pfactory.runtime.project.configure_environment`.

Which experiment (`own_experiment`): `perception-factory`, except on a tracking server that authenticates
users (a team's: `pfactory.tracking.identity.current`), where each user's runs go to their own experiment
`perception-factory/<user>`, made by the admin with the user (`pfactory.team.users.add_user`: MANAGE for
that user alone) or, for a user added without it, by that user on first use. MLflow authorizes runs by their
experiment, and its basic-auth app grants the creator of an experiment MANAGE on it while everyone else
keeps the server's default (READ): so only its user (and the admin) may edit a run, its metrics or its tags.
Readers across users search `experiment_ids`: the experiment and every `<name>/<user>`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pfactory.runtime.failures import EXIT_TRANSIENT, UserError
from pfactory.runtime.lineage import lineage_tags
from pfactory.runtime.project import configure_environment

EXPERIMENT = "perception-factory"
PARENT_ENV = "PFACTORY_PARENT_RUN_ID"


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


class TrackingUnavailable(UserError, ConnectionError):
    """The MLflow tracking server does not answer: the message names it (password redacted), what to try."""

    exit_code = EXIT_TRANSIENT  # worth a retry once the server is back


_CHECKED: set[str] = set()


def check_tracking_server(uri: str | None = None, timeout_s: float = 5.0) -> None:
    """For an http(s) tracking URI, one request to the server's `/health` (no retries): TrackingUnavailable
    when nothing answers, in seconds -- instead of MLflow's client retrying every later call. Any HTTP
    answer (even 401/404: a server behind auth, or without /health) counts as reachable; a team's server that
    refuses the credentials is `pfactory.tracking.identity.NotAuthenticated` (exit 77). Once per process."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")) or uri in _CHECKED:
        return
    import requests

    from pfactory.tracking.identity import current, tls_verify

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


def user_experiment(user: str) -> str:
    """The experiment of `user`'s runs on a team's server: `perception-factory/<user>`."""
    return f"{EXPERIMENT}/{user}"


def own_experiment(uri: str | None = None) -> str:
    """The experiment this process's runs go to on tracking URI `uri` (default: mlflow's current one):
    `user_experiment(<the authenticated user>)` when the server authenticates users (a team's), else
    `EXPERIMENT`. `NotAuthenticated` when the server refuses the credentials."""
    import mlflow

    from pfactory.tracking.identity import current

    ident = current(uri or mlflow.get_tracking_uri())
    return EXPERIMENT if ident is None else user_experiment(ident.username)


def experiment_ids(client: Any, name: str = EXPERIMENT) -> list[str]:
    """The ids of experiment `name` and of every per-user experiment `name/<user>` (`user_experiment`) that
    `client` may read (MLflow hides the others from a search), the shared one first; [] when none exists.
    What a reader across users (`factory compare`, a report by run name) searches."""
    exp = client.get_experiment_by_name(name)
    ids = [exp.experiment_id] if exp is not None else []
    if "'" in name:  # not expressible in MLflow's filter syntax; such a name has no per-user experiments
        return ids
    token = None
    while True:
        page = client.search_experiments(
            filter_string=f"name LIKE '{name}/%'", max_results=1000, page_token=token
        )
        # LIKE's wildcards (`_`, `%`) may also sit in `name`: keep exactly the `name/` prefix
        ids += [e.experiment_id for e in page if e.name.startswith(name + "/") and e.experiment_id not in ids]
        token = page.token
        if not token:
            return ids


def _refuse_foreign(exp: Any, uri: str) -> None:
    """On a team's server, PermissionRefused unless the authenticated user holds MANAGE on `exp`, their own
    experiment: one that another user created first (and so manages) is not written into."""
    from pfactory.tracking.identity import PermissionRefused, current, permission

    ident = current(uri)
    if ident is None:
        return
    has = permission(ident, exp.experiment_id, "experiment")
    if has != "MANAGE":
        raise PermissionRefused(
            f"experiment {exp.name!r}: user {ident.username!r} has {has} on it, not MANAGE (another user created "
            "it first, so its runs would be theirs to edit); nothing was logged. An admin deletes it "
            f"permanently or renames it; your next run creates it again",
            user=ident.username, needed="MANAGE", has=has,
        )  # fmt: skip


def experiment_id(root: Path, name: str | None = None) -> str:
    """The id of experiment `name` (default `own_experiment()`), created (tagged a machine-learning
    experiment; artifacts under `root`, or on a team's server the server's own store) when missing; an
    existing one without the experiment-type tag gets it. Safe when two processes create it at the same
    moment: the loser of the race reads the winner's experiment. A tracking server that does not answer is
    a TrackingUnavailable in seconds (`check_tracking_server`); a user's own experiment on a team's server
    that another user created is a PermissionRefused (exit 77)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    check_tracking_server()
    uri = mlflow.get_tracking_uri()
    own = name is None
    name = name or own_experiment(uri)
    # A user's experiment on a team's server keeps its artifacts on the server (its proxied store), where the
    # other users read them, never in this clone.
    per_user = own and name != EXPERIMENT
    with sqlite_store_lock():
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            try:
                where = {} if per_user else {"artifact_location": artifact_location(root)}
                return mlflow.create_experiment(name, tags=EXPERIMENT_KIND, **where)
            except MlflowException:
                exp = mlflow.get_experiment_by_name(name)
                if exp is None:
                    raise
        if per_user:
            _refuse_foreign(exp, uri)
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
    MLflow server authenticated (it stores "unknown" itself), else the OS account (`pfactory.tracking.identity`)."""
    import socket

    import psutil

    from pfactory.tracking.identity import user_name

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

    Nested under `PFACTORY_PARENT_RUN_ID` (in its experiment) when the pipeline flow set it, else in
    `experiment_id(root)`'s experiment (`own_experiment`). Yields the
    `mlflow.ActiveRun`; the run ends FAILED if the body raises.
    """
    import mlflow

    root = configure_environment(root)
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    parent = os.environ.get(PARENT_ENV) or None
    if parent is None:
        exp_id = experiment_id(root)
    else:  # a stage of a pipeline run: in its parent's experiment
        check_tracking_server()
        with sqlite_store_lock():  # this process's first opening of the store
            exp_id = mlflow.MlflowClient().get_run(parent).info.experiment_id
    reap_orphan_runs(exp_id)
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
