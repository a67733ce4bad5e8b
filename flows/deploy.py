"""Scheduled pipeline runs: a Prefect deployment of a flow on a cron schedule.

In: a Prefect flow (default: the pipeline, `flows/pipeline.py:pipeline`), a deployment name,
a cron string (+ time zone) and the flow's default parameters (for the pipeline:
`{"overrides": ["train.lr=1e-3", ...]}`).
Out: a deployment on the Prefect server at `PREFECT_API_URL` with that cron schedule, and
a long-running process (`flow.serve`) that executes its runs — scheduled or triggered
(`prefect deployment run 'perception-factory/nightly'`) — on this machine, one at a time.

Work pools, code from git (`factory deploy --pool NAME [--cron ...] [--run-now]`, `deploy_to_pool`): the
deployment's pull step is Prefect's `prefect.deployments.steps.git_clone` of the git remote `origin`
(`--git-remote NAME`) at the exact commit of HEAD (`git_source`: a dirty tree, a commit the remote does not have,
a URL with a password in it are refused in one line naming the remote), so a worker on a host without a checkout
(`factory worker start --pool NAME`, factory/worker.py) runs the code of that commit, with its own environment's
packages (the clone is first on PYTHONPATH). The pipeline in the clone reads and writes data through the DVC
remote the commit's `.dvc/config` names (`repro --pull`, `dvc push --run-cache`: flows/pipeline.py). `--run-now`
also creates one flow run right away (tagged `pfactory.triggered-by:<user>`, with a record in the user's own MLflow
experiment that the worker verifies: `pfactory.tracking.trigger`); a cron schedule makes the others.
`prefect.yaml` at the repo root (`prefect deploy --all`) describes the same for Prefect's own CLI.

Everything here but `is_pipeline` / `deployment_parameters` (which say how the pipeline takes its
parameters) is generic over the flow, so tests serve a small flow through the same code.

Run: `factory deploy --cron "0 3 * * *" [--name nightly] [-S key=value ...] [--print-only]` (the
pipeline), `factory deploy --pool gpu [--cron "0 3 * * *"] [--run-now]` (a work pool, code from git), or
`factory deploy --flow path/to/file.py:flow_fn --parameters '{"k": 1}' --cron "..."` (any flow). The command (`factory/cli.py:deploy_cmd`) only wires options to the functions here.

Why a server: cron schedules are turned into flow runs by the Prefect server's scheduler
service; the ephemeral local API of `factory run` has no scheduler, so nothing would ever
fire (../shared/FEASIBILITY.md, Prefect row). `serve` therefore refuses to start without
a reachable `PREFECT_API_URL`.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pfactory.runtime.project import configure_environment

configure_environment()  # before Prefect is imported: PREFECT_HOME, analytics off

DEFAULT_NAME = "nightly"
DEFAULT_TIMEZONE = "UTC"
PIPELINE_ENTRYPOINT = "flows/pipeline.py:pipeline"
CRON_ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")

SERVER_HINT = """\
Scheduled runs need a Prefect server (its scheduler turns the cron schedule into runs):
  1. in another terminal:  prefect server start --host 127.0.0.1 --port 4200
  2. here:                 export PREFECT_API_URL=http://127.0.0.1:4200/api
  3. again:                factory deploy --cron "0 3 * * *"
(or point PREFECT_API_URL at an existing Prefect server / Prefect Cloud workspace)"""


class DeployError(ValueError):
    """A deployment setting that is wrong or a server that is missing (the message says which)."""


def validate_cron(cron: str, field: str = "cron") -> str:
    """`cron` stripped if it is a 5-field cron string or an @alias; else DeployError naming `field`.

    The fields are minute, hour, day-of-month, month, day-of-week, as Prefect's scheduler
    (croniter) reads them. Random/hashed (`R`, `H`) and 6-field (seconds) forms are refused.
    """
    from prefect._vendor.croniter import croniter

    text = (cron or "").strip()
    expect = (
        "expected 5 fields 'minute hour day-of-month month day-of-week' "
        f"(e.g. '0 3 * * *' = 03:00 every day) or one of {', '.join(CRON_ALIASES)}"
    )
    if text.startswith("@"):
        if text.lower() not in CRON_ALIASES:
            raise DeployError(f"{field}: {cron!r} is not a known cron alias; {expect}")
        return text
    parts = text.split()
    if len(parts) != 5:
        raise DeployError(f"{field}: {cron!r} has {len(parts)} fields; {expect}")
    if any(p.casefold() in ("r", "h") for p in parts):
        raise DeployError(f"{field}: {cron!r} uses a random/hashed field (R/H), which Prefect refuses")
    try:
        croniter(text)
    except (ValueError, KeyError) as e:  # CroniterBadCronError is a ValueError
        raise DeployError(f"{field}: {cron!r} is not a valid cron schedule ({e}); {expect}") from None
    return text


def validate_timezone(tz: str, field: str = "timezone") -> str:
    """An IANA time zone name (e.g. 'UTC', 'Europe/Berlin'); else DeployError naming `field`."""
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise DeployError(
            f"{field}: {tz!r} is not an IANA time zone name (e.g. 'UTC', 'Europe/Berlin')"
        ) from None
    return tz


def validate_name(name: str, field: str = "name") -> str:
    """A deployment name: non-empty, no '/' (Prefect addresses deployments as 'flow/deployment')."""
    if not name or not name.strip() or "/" in name:
        raise DeployError(f"{field}: {name!r} must be a non-empty name without '/' (e.g. 'nightly')")
    return name.strip()


@dataclass(frozen=True)
class DeploymentSpec:
    """What a deployment is made of; `full_name` is how Prefect addresses it ('flow/deployment')."""

    flow_name: str
    name: str
    cron: str | None  # None: no schedule (a work-pool deployment run by --run-now / `prefect deployment run`)
    timezone: str = DEFAULT_TIMEZONE
    parameters: dict[str, Any] = field(default_factory=dict)
    entrypoint: str | None = None

    @property
    def full_name(self) -> str:
        return f"{self.flow_name}/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"full_name": self.full_name}


def make_spec(
    flow: Any,
    *,
    name: str = DEFAULT_NAME,
    cron: str | None,
    timezone: str = DEFAULT_TIMEZONE,
    parameters: dict[str, Any] | None = None,
    entrypoint: str | None = None,
) -> DeploymentSpec:
    """Validate the settings for deploying `flow` (a Prefect `Flow`); returns the spec (`cron` None: unscheduled).

    Parameter names must be parameters of the flow (DeployError naming the unknown one).
    """
    params = dict(parameters or {})
    known = set(flow.parameters.properties)
    unknown = sorted(set(params) - known)
    if unknown:
        raise DeployError(
            f"parameters: {', '.join(unknown)} not a parameter of flow {flow.name!r} "
            f"(it takes: {', '.join(sorted(known)) or 'none'})"
        )
    return DeploymentSpec(
        flow_name=flow.name,
        name=validate_name(name),
        cron=validate_cron(cron) if cron is not None else None,
        timezone=validate_timezone(timezone),
        parameters=params,
        entrypoint=entrypoint,
    )


def pipeline_parameters(overrides: list[str] | None = None) -> dict[str, Any]:
    """Default parameters of the pipeline deployment: the `-S` overrides each run applies."""
    return {"overrides": list(overrides or [])}


def parse_parameters(text: str | None) -> dict[str, Any]:
    """`--parameters` text -> the flow parameters it names ({} for None or blank text).

    In: a JSON object, e.g. '{"root": "/data", "checkout": false}'. Out: that dict. DeployError naming
    `parameters` for text that is not JSON or not an object.
    """
    if text is None or not text.strip():
        return {}
    try:
        parameters = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeployError(f"parameters: not valid JSON ({e})") from None
    if not isinstance(parameters, dict):
        raise DeployError(
            f"parameters: expected a JSON object of flow parameters (e.g. '{{\"name\": \"x\"}}'), "
            f"got {type(parameters).__name__}"
        )
    return parameters


def is_pipeline(flow: Any) -> bool:
    """Whether `flow` is the pipeline (`flows/pipeline.py:pipeline`) however it was addressed: Prefect
    addresses a flow by its name, so a copy of the checkout or a module path (`flows.pipeline:pipeline`)
    is the pipeline too."""
    from flows.pipeline import pipeline

    return flow.name == pipeline.name


def deployment_parameters(
    flow: Any, *, overrides: list[str] | None = None, parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The deployment's default parameters from the two ways `factory deploy` takes them.

    The pipeline: `overrides` (`-S key=value`) become its `overrides` parameter, and `parameters`
    (`--parameters`) may set its other parameters (`stages`, `checkout`, ...) but not `overrides`.
    Any other flow: `parameters` only (it has no params.yaml to override). A combination that makes no
    sense is a DeployError naming the option. Unknown parameter names are `make_spec`'s to refuse.
    """
    params = dict(parameters or {})
    if is_pipeline(flow):
        if "overrides" in params:
            raise DeployError(
                "parameters: the pipeline's overrides are given with -S key=value (repeatable), "
                "not as 'overrides' in --parameters"
            )
        return pipeline_parameters(overrides) | params
    if overrides:
        raise DeployError(
            f"-S/--set-param: only for the pipeline (it overrides params.yaml); give flow {flow.name!r} "
            "its parameters as --parameters JSON"
        )
    return params


def api_url() -> str | None:
    """The configured `PREFECT_API_URL` (env or Prefect profile), or None (ephemeral mode)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def check_server(url: str | None, timeout_s: float = 5.0) -> str:
    """`url` if a Prefect API answers `GET <url>/health`; else DeployError with SERVER_HINT."""
    if not url:
        raise DeployError(f"PREFECT_API_URL is not set.\n{SERVER_HINT}")
    health = url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as r:
            if r.status == 200:
                return url
            problem = f"HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        problem = str(getattr(e, "reason", e))
    raise DeployError(f"PREFECT_API_URL={url}: {health} does not answer ({problem}).\n{SERVER_HINT}")


def serve(flow: Any, spec: DeploymentSpec, limit: int | None = 1) -> None:
    """Create/update the deployment on the server and execute its runs until interrupted.

    Blocks (a long-running process; Ctrl-C or SIGTERM stops it and pauses the schedule, so
    no runs pile up while nothing serves them). `limit`: runs executed at the same time by
    this process (1: pipeline runs on one machine never overlap). Needs a reachable
    `PREFECT_API_URL` (DeployError with how to start a server otherwise).
    """
    from prefect.schedules import Cron

    if spec.cron is None:
        raise DeployError("cron: required to serve from here (or deploy to a work pool: --pool NAME)")
    check_server(api_url())
    flow.serve(
        name=spec.name,
        schedules=[Cron(spec.cron, timezone=spec.timezone)],
        parameters=spec.parameters,
        limit=limit,
        pause_on_shutdown=True,
    )


def load_flow(entrypoint: str) -> Any:
    """The flow at `path/to/file.py:flow_fn` (or `module.path:flow_fn`); DeployError if absent."""
    from prefect.flows import load_flow_from_entrypoint

    if ":" not in entrypoint:
        raise DeployError(f"flow: {entrypoint!r} must look like 'path/to/file.py:flow_function'")
    try:
        return load_flow_from_entrypoint(entrypoint)
    except (FileNotFoundError, ImportError, AttributeError, SyntaxError) as e:
        raise DeployError(f"flow: cannot load {entrypoint!r}: {e}") from None


@dataclass(frozen=True)
class GitSource:
    """Where a worker gets the code: the git remote's URL and the exact commit (HEAD of the project)."""

    remote: str
    url: str
    commit: str


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def git_source(root: Path, remote: str = "origin") -> GitSource:
    """The commit a work-pool deployment runs: HEAD of the git repository at `root` (its top level), which
    must be clean (no tracked change, no untracked file in the code dirs, flows/, dvc.yaml, params.yaml) and on `remote` (a remote-tracking
    branch of it contains HEAD: `git push` first). DeployError (one line, naming the remote) otherwise, and
    for a remote URL that carries a password (it would be stored in the deployment). A URL that is a local
    path is made absolute (workers on this host, tests)."""
    from urllib.parse import urlsplit

    from flows.workspace import CODE_DIRS

    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise DeployError(f"--pool: {root} is not a git repository; workers get the code from a git remote")
    if Path(top.stdout.strip()).resolve() != root:
        raise DeployError(f"--pool: the project {root} must be the top level of its git repository ({top.stdout.strip()})")
    head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").stdout.strip()
    if not head:
        raise DeployError(f"--pool: {root} has no commit yet; commit and push the project first")
    got = _git(root, "remote", "get-url", remote)
    if got.returncode != 0:
        raise DeployError(f"--git-remote {remote}: no such git remote in {root} (git remote add {remote} URL)")
    url = got.stdout.strip()
    parts = urlsplit(url)
    if parts.password:
        raise DeployError(
            f"--git-remote {remote}: its URL carries a password, which would be stored in the deployment; "
            "give the workers a credential helper or an SSH key instead"
        )
    if not parts.scheme and ":" not in url.split("/", 1)[0] and (root / url).exists():
        url = str((root / url).resolve())  # a local path relative to the repository
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    code = (*CODE_DIRS, "flows", "dvc.yaml", "params.yaml")  # what a run imports or reads, untracked or not
    dirty += _git(root, "ls-files", "--others", "--exclude-standard", "--", *code).stdout.splitlines()
    if dirty:
        first = dirty[0].strip()
        raise DeployError(
            f"--pool: the working tree has uncommitted changes ({first}{', ...' if len(dirty) > 1 else ''}); "
            f"workers run commits: commit and git push {remote} first"
        )
    on_remote = _git(root, "for-each-ref", "--contains", head, "--format=%(refname)", f"refs/remotes/{remote}/")
    if not on_remote.stdout.strip():
        raise DeployError(
            f"--git-remote {remote}: commit {head[:12]} is not on it (git push {remote} HEAD first; "
            "git fetch if it was pushed from elsewhere)"
        )
    return GitSource(remote=remote, url=url, commit=head)


def check_pool(pool: str) -> None:
    """DeployError (one line) when the server at PREFECT_API_URL has no work pool `pool`."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise DeployError(
                f"--pool {pool}: no such work pool on {api_url()}; start a worker for it "
                f"(factory worker start --pool {pool}) or create it (prefect work-pool create {pool} --type process)"
            ) from None


def pull_steps(source: GitSource) -> list[dict[str, Any]]:
    """The deployment's pull steps: Prefect's git_clone of `source` at its commit (what workers run)."""
    from prefect.runner.storage import GitRepository

    return [GitRepository(url=source.url, commit_sha=source.commit).to_pull_step()]


def triggered_by_tag() -> str:
    """`pfactory.triggered-by:<user>`: who created a run (the authenticated MLflow user, else the OS user)."""
    from pfactory.tracking.identity import user_name
    from pfactory.tracking.trigger import CLAIM_PREFIX

    return f"{CLAIM_PREFIX}{user_name()}"


def deploy_to_pool(spec: DeploymentSpec, source: GitSource, pool: str, run_now: bool = False) -> dict[str, Any]:
    """Create/update the deployment `spec` on the work pool `pool`, its code `source` (git_clone at the commit),
    its schedule `spec.cron` (none when None); with `run_now`, also create one flow run of it now.

    Returns `{"deployment_id", "full_name", "pool", "commit", "remote", "pull_steps", "flow_run_id"}`
    (`flow_run_id` None without `run_now`). Needs a reachable PREFECT_API_URL and the pool (DeployError).
    `Flow.from_source` clones the commit into a temporary folder here to read the flow's parameters from it, so a
    commit without the entrypoint fails here, not on a worker."""
    from prefect.deployments import run_deployment
    from prefect.flows import Flow
    from prefect.runner.storage import GitRepository
    from prefect.schedules import Cron

    check_server(api_url())
    check_pool(pool)
    if not spec.entrypoint:
        raise DeployError("flow: a work-pool deployment needs an entrypoint path/to/file.py:flow_fn")
    try:
        flow = Flow.from_source(
            source=GitRepository(url=source.url, commit_sha=source.commit), entrypoint=spec.entrypoint
        )
    except Exception as e:  # git clone refused, entrypoint missing at that commit
        raise DeployError(
            f"--git-remote {source.remote}: cannot load {spec.entrypoint} at {source.commit[:12]} from "
            f"{source.url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    schedules = [Cron(spec.cron, timezone=spec.timezone)] if spec.cron else []
    deployment_id = flow.deploy(
        name=spec.name, work_pool_name=pool, build=False, push=False, schedules=schedules,
        parameters=spec.parameters, version=source.commit[:12], print_next_steps=False, ignore_warnings=True,
    )  # fmt: skip
    run_id = None
    if run_now:  # who triggers: a claim on the Prefect run, backed by a record in their own MLflow experiment
        from pfactory.tracking.trigger import RECORD_PREFIX, bind_trigger, record_trigger

        record = record_trigger(str(deployment_id))
        tags = [triggered_by_tag(), *([RECORD_PREFIX + record] if record else [])]
        run = run_deployment(deployment_id, timeout=0, tags=tags, as_subflow=False)
        run_id = str(run.id)
        if record:
            bind_trigger(record, run_id)
    return {
        "deployment_id": str(deployment_id),
        "full_name": spec.full_name,
        "pool": pool,
        "commit": source.commit,
        "remote": source.url,
        "pull_steps": pull_steps(source),
        "flow_run_id": run_id,
    }
