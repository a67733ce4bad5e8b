"""MLflow model-registry operations: register a candidate, read/move the alias under a lock, the audit trail.

Registered form (docs/PROMOTE.md, "What a version is"): the candidate is logged as an MLflow model of its
run (`mlmodel.log_detector`: MLflow's ONNX flavor with a signature, an input example and pinned requirements,
plus the candidate's files under `optimized/` and `eval/kpis.json` in the same model directory), and the
version is created from it with `MlflowClient.create_model_version(name, source="models:/<model id>",
run_id, model_id)`: `mlflow.pyfunc.load_model("models:/<name>@champion")` loads it and `mlflow models serve`
serves it. `mlflow.artifacts.download_artifacts("models:/<name>/<version>")` gives the whole directory
(`optimized/`, `eval/kpis.json`), which is what rollback and champion re-evaluation use; versions registered
before this layout (source `runs:/<run>/candidate`: plain run artifacts `candidate/optimized/...`,
`candidate/eval/kpis.json`) download to the same two paths.

Audit trail: one registered-model tag per alias move, `audit.<6-digit id>` = one readable line
(`promote v2 -> v3 | 2026-12-01T10:00:00+00:00 | alice@host | run 0a1b... | all 4 gates passed vs champion
v2`, `format_audit` / `parse_audit`), plus `audit.head` = the last id; the registered model's description
is a markdown table of the trail (what the registry page shows); versions carry `promotion.*` tags; the full
records (gates, data) are in the release folder's `audit.jsonl`. Durable (in the registry DB), queryable
(`client.get_registered_model(name).tags`, `audit_trail()`), and written under the registry lock. Tags
written as JSON records by earlier versions are still read.

The registry lock (`registry_lock`): with a team -- a registry on an http(s) server and a Prefect server
configured (`PREFECT_API_URL`, `pfactory.team.slots.enabled`) -- the lock is held by the team's Prefect
server: one slot of the global concurrency limit `promote-<model>` (size 1), taken as a 60 s lease that
Prefect renews while the holder lives and repossesses once it stops (`pfactory.team.slots.hold_limit`), so
promotions from any clone on any machine are serialized. Otherwise an exclusive `fcntl.lockf` on
`<db>.registry.lock` beside a local sqlite store, else on `artifacts/.state/registry-locks/<hash of the
URI>.lock` in the project: it serializes every process that shares that file system (MLflow's REST API has
no compare-and-set on aliases) -- docs/PROMOTE.md, "Racing promotions".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pfactory.promote.errors import LockTimeout, RegistryError, UnknownRef

AUDIT_PREFIX = "audit."
AUDIT_HEAD = "audit.head"
STATUS_TAG = "promotion.status"


def client() -> Any:
    """An `MlflowClient` on the project's tracking URI (set explicitly: FEASIBILITY.md, mlflow row)."""
    import mlflow
    from mlflow import MlflowClient

    from pfactory.runtime.project import configure_environment

    configure_environment()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = os.environ["MLFLOW_TRACKING_URI"]
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=registry_uri())


def registry_uri() -> str:
    """The registry URI `client()` uses (MLFLOW_REGISTRY_URI, else the tracking URI)."""
    from pfactory.runtime.project import configure_environment

    configure_environment()
    return os.environ.get("MLFLOW_REGISTRY_URI") or os.environ["MLFLOW_TRACKING_URI"]


def lock_path(uri: str, root: Path | None = None) -> Path:
    """Where the lock of registry `uri` lives (module docstring)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        return db.with_name(db.name + ".registry.lock")
    from pfactory.runtime.project import project_root

    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return project_root(root) / "artifacts" / ".state" / "registry-locks" / f"{digest}.lock"


SERVER_LOCK_PREFIX = "promote-"  # + the registered model's name: the team's promotion lock on Prefect


def server_lock_name(uri: str, model: str | None) -> str | None:
    """`promote-<model>`, the Prefect global concurrency limit that locks `model`'s registry when `uri` is
    a team's server (http(s)) and a Prefect server is configured; None: the file lock (module docstring).
    A sqlite or file store answers without importing Prefect."""
    if model is None or not uri.startswith(("http://", "https://")):
        return None
    from pfactory.team import slots

    return SERVER_LOCK_PREFIX + model if slots.enabled() else None


@contextlib.contextmanager
def registry_lock(
    uri: str, timeout_s: float, poll_s: float = 0.05, model: str | None = None
) -> Iterator[Path | str]:
    """Hold the exclusive lock of registry `uri` (module docstring): the server's `promote-<model>` with a team
    (yields its name), else the file lock (yields its path); `LockTimeout` after `timeout_s` seconds."""
    name = server_lock_name(uri, model)
    if name is not None:
        from pfactory.team import slots

        held = contextlib.ExitStack()
        try:
            held.enter_context(slots.hold_limit(name, 1, timeout_s))
        except TimeoutError:
            raise LockTimeout(
                f"{os.environ.get('PREFECT_API_URL')}: the promotion lock {name!r} (a Prefect global concurrency "
                f"limit of 1) is held by another promotion for more than {timeout_s:g} s (promote.lock_timeout_s)"
            ) from None
        with held:  # the lease is released when the block ends, however it ends
            yield name
        return
    path = lock_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    holder = path.read_text().strip() if path.stat().st_size else "unknown"
                    raise LockTimeout(
                        f"{path}: the registry lock is held by another promotion ({holder}) for more than "
                        f"{timeout_s:g} s (promote.lock_timeout_s)"
                    ) from None
                time.sleep(poll_s)
        # Who holds it, for the timeout message of a waiting process (informational only).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {actor()} since {now_iso()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases a lockf lock


def actor() -> str:
    """`user@host` (the audit record's "by"): the user the team's MLflow server authenticated, else the OS
    account of this process (`pfactory.tracking.identity.user_name`)."""
    from pfactory.tracking.identity import user_name

    return f"{user_name()}@{socket.gethostname()}"


def now_iso() -> str:
    """The current UTC time, ISO 8601 with seconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _is(e: Exception, *codes: str) -> bool:
    return getattr(e, "error_code", None) in codes


def ensure_registered_model(c: Any, name: str, description: str | None = None) -> None:
    """Create registered model `name` unless it exists (a concurrent creator is fine)."""
    from mlflow.exceptions import MlflowException

    try:
        c.create_registered_model(name, description=description)
    except MlflowException as e:
        if not _is(e, "RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise


def log_candidate(
    c: Any, run_id: str, optimized: Path, kpis_file: Path, data: Path | None = None
) -> tuple[str, str]:
    """Log the candidate as an MLflow model of run `run_id` (`mlmodel.log_detector`: the ONNX flavor, a
    signature, an input example from the first val frame of `data`, pinned requirements, and the candidate's
    files under `optimized/` + `eval/`); returns (version source URI `models:/<model id>`, model id)."""
    from pfactory.promote import mlmodel

    example = mlmodel.example_feed(data) if data is not None else None
    return mlmodel.log_detector(run_id, optimized, kpis_file, example)


def find_version(c: Any, name: str, run_id: str, manifest_sha256: str) -> int | None:
    """The version of `name` already registered from `run_id` with these artifacts (a retried stage)."""
    from mlflow.exceptions import MlflowException

    try:
        versions = c.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException as e:
        if _is(e, "RESOURCE_DOES_NOT_EXIST"):
            return None
        raise
    for v in versions:
        if v.tags.get("backend.manifest_sha256") == manifest_sha256:
            return int(v.version)
    return None


def register_version(
    c: Any, name: str, source: str, run_id: str, tags: Mapping[str, str], description: str,
    model_id: str | None = None,
) -> int:  # fmt: skip
    """A new version of `name` from `source` (created with the model if needed); returns its number.
    `model_id`: the LoggedModel the version is (MLflow 3: the version page links to it)."""
    ensure_registered_model(c, name, "3D object detector (perception-factory); promoted through gates")
    mv = c.create_model_version(
        name, source, run_id=run_id, tags=dict(tags), description=description, model_id=model_id
    )
    return int(mv.version)


def get_version(c: Any, name: str, version: int) -> Any:
    """The `ModelVersion`, or `RegistryError` naming what does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version(name, str(version))
    except MlflowException as e:
        if _is(e, "RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise UnknownRef(f"registered model {name!r} has no version {version}") from None
        raise


def champion(c: Any, name: str, alias: str) -> int | None:
    """The version `alias` points to, None when the model or the alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        rm = c.get_registered_model(name)
    except MlflowException as e:
        if _is(e, "RESOURCE_DOES_NOT_EXIST"):
            return None
        raise
    v = (rm.aliases or {}).get(alias)
    return int(v) if v is not None else None


def set_version_tags(c: Any, name: str, version: int, tags: Mapping[str, Any]) -> None:
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v))


_AUDIT_LINE = re.compile(r"^(?P<action>[\w-]+) (?P<from>v\d+|none) -> (?P<to>v\d+|none)$")


def _v(text: str) -> int | None:
    return None if text == "none" else int(text.removeprefix("v"))


def format_audit(record: Mapping[str, Any]) -> str:
    """The readable tag value of an audit record (module docstring)."""
    frm = f"v{record['from']}" if record.get("from") is not None else "none"
    to = f"v{record['to']}" if record.get("to") is not None else "none"
    run = f"run {record['run_id']}" if record.get("run_id") else "run -"
    return " | ".join([f"{record['action']} {frm} -> {to}", str(record["at"]), str(record["by"]), run,
                       str(record.get("reason") or "")])  # fmt: skip


def parse_audit(key: str, value: str) -> dict[str, Any]:
    """An audit record from its tag (`audit.<id>`): the readable line, or an earlier version's JSON."""
    if value.lstrip().startswith("{"):
        return json.loads(value)
    head, at, by, run, reason = [*value.split(" | ", 4), "", "", "", ""][:5]
    m = _AUDIT_LINE.match(head.strip())
    if m is None:
        raise RegistryError(f"registered-model tag {key}: not an audit record: {value!r}")
    run_id = run.removeprefix("run ").strip()
    return {
        "id": int(key.removeprefix(AUDIT_PREFIX)), "action": m["action"], "from": _v(m["from"]),
        "to": _v(m["to"]), "at": at, "by": by, "run_id": None if run_id in ("", "-") else run_id,
        "reason": reason,
    }  # fmt: skip


def audit_trail(c: Any, name: str) -> list[dict[str, Any]]:
    """Every audit record of `name`, oldest first ([] when the model does not exist)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = c.get_registered_model(name).tags or {}
    except MlflowException as e:
        if _is(e, "RESOURCE_DOES_NOT_EXIST"):
            return []
        raise
    records = [parse_audit(k, v) for k, v in tags.items() if k.startswith(AUDIT_PREFIX) and k != AUDIT_HEAD]
    return sorted(records, key=lambda r: r["id"])


def describe_model(c: Any, name: str, alias: str) -> None:
    """The registered model's description: the champion and the audit trail as markdown (the registry page)."""
    current = champion(c, name, alias)
    trail = audit_trail(c, name)
    lines = [
        "3D object detector (perception-factory), promoted through KPI, parity and latency gates.",
        "",
        f"**`{alias}`: version {current}**" if current is not None else f"No `{alias}` yet.",
        f'Load it: `mlflow.pyfunc.load_model("models:/{name}@{alias}")`; serve it: '
        f"`mlflow models serve -m models:/{name}@{alias} --env-manager local`.",
        "",
        "| # | when | by | move | reason |",
        "|---|---|---|---|---|",
    ]
    for r in reversed(trail[-20:]):
        frm = f"v{r['from']}" if r.get("from") is not None else "-"
        lines.append(
            f"| {r['id']} | {r['at']} | {r['by']} | {r['action']} {frm} → v{r['to']} | {r.get('reason', '')} |"
        )
    if len(trail) > 20:
        lines.append(f"| … | | | | {len(trail) - 20} older records: `factory lineage`, release/audit.jsonl |")
    c.update_registered_model(name, description="\n".join(lines))


def next_audit_id(c: Any, name: str) -> int:
    """The id the next audit record gets (call under the registry lock)."""
    from mlflow.exceptions import MlflowException

    try:
        head = c.get_registered_model(name).tags.get(AUDIT_HEAD)
    except MlflowException as e:
        if not _is(e, "RESOURCE_DOES_NOT_EXIST"):
            raise
        head = None  # a model not created yet starts at 1
    return int(head) + 1 if head else 1


def write_audit(c: Any, name: str, record: Mapping[str, Any]) -> None:
    """Store `record` as `audit.<id>` and advance `audit.head` (call under the registry lock)."""
    c.set_registered_model_tag(name, f"{AUDIT_PREFIX}{int(record['id']):06d}", format_audit(record))
    c.set_registered_model_tag(name, AUDIT_HEAD, str(record["id"]))


def delete_audit(c: Any, name: str, record: Mapping[str, Any]) -> None:
    """Withdraw `record` (the alias move it describes failed); `audit.head` goes back by one."""
    c.delete_registered_model_tag(name, f"{AUDIT_PREFIX}{int(record['id']):06d}")
    prev = int(record["id"]) - 1
    if prev > 0:
        c.set_registered_model_tag(name, AUDIT_HEAD, str(prev))
    else:
        c.delete_registered_model_tag(name, AUDIT_HEAD)


def move_alias(c: Any, name: str, alias: str, version: int | None) -> None:
    """Point `alias` at `version` (None: remove the alias)."""
    if version is None:
        c.delete_registered_model_alias(name, alias)
    else:
        c.set_registered_model_alias(name, alias, str(version))


def download_version(c: Any, name: str, version: int, dst: Path) -> Path:
    """Download version `version`'s files (`optimized/`, `eval/kpis.json`) into `dst`; returns `dst`."""
    import mlflow

    get_version(c, name, version)
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(dst)))
