"""The pipeline flow: synth -> prepare -> train -> optimize -> evaluate -> promote, through DVC.

Prefect sequences the stages and adds retries, parameters, a run name and a UI; DVC runs each stage
(`dvc repro <stage>` in the run's workspace, `flows.workspace`), so `dvc.lock` and the DVC cache stay
true and a stage whose code, deps and params were already computed (by this or any earlier run) is
restored from DVC's run-cache instead of recomputed. The flow holds no ML logic: it reads what the
stages wrote (kpis.json, latency.json, promotion.json) to fill the MLflow parent run.

One MLflow parent run per pipeline run (tag `pipeline=true`), every stage run nested under it through
`PFACTORY_PARENT_RUN_ID`. The parent run carries (what `factory compare` reads):
    params   the resolved params, flattened (`train.lr`, `synth.frames`, ...)
    metrics  the headline KPIs (`artifacts.headline_scalars`): eval/mAP, eval/NDS, eval/<Class>/{mean_ap,
             ate, ase, aoe}, eval/<bucket>/mAP, eval/delta/mAP, eval/reference/mAP (the evaluate stage's run
             has the per-threshold / per-range detail), latency/p50_ms, latency/p99_ms (batch 1, primary
             artifact), time/<stage>_s (wall per stage, DVC included), time/total_s,
             time/stage_startup_s (interpreter + imports of the stage processes), orchestration/seconds
             + orchestration/fraction (wall outside the stage processes: Prefect, DVC, MLflow)
    tags     pipeline, run_id, workspace, git.commit, git.dirty, data.<out>.md5 (dvc.lock hashes of
             the raw and prepared data, model, ...), promotion.decision, package versions, device
    artifacts params.json, dvc.lock, summary.json

Resume: `factory run --resume [NAME]` (`pipeline(resume=NAME)`, `resume=""`: the newest interrupted run)
reopens that run's workspace (`flows.workspace.find_resumable`): the stages it finished are up to date in its
`dvc.lock` (DVC skips them), train continues from its checkpoint (`$PFACTORY_RESUME_DIR`), the later stages
run; the same MLflow parent run is reopened (tag `resumes`: how many times) and the run is saved as its DVC
experiment when it finishes. A retry of the stage task (a killed or SIGTERMed stage is transient) runs in the
same workspace, so it resumes too; so does a retry of the whole flow (a deployment's `retries`): a flow run
that is on its second or later try reopens the workspace its first try made (`flow_run_id` in the record).
SIGTERM to `factory run` (preemption) goes to the running stage (train checkpoints and exits 143), no retry
follows, and the flow raises `RunInterrupted` (`factory run` prints one line saying how to resume, exit 143).
With a default DVC remote the run travels (`flows.workspace`): train's checkpoints go to the remote as they are
written, an interrupted run pushes its finished stages and marks its record there interrupted, and `--resume
NAME` in a clone without that workspace makes it from the remote (`flows.workspace.fetch_remote_run`).

Run: `factory run [-S section.key=value ...] [--name NAME]`, or `pipeline(overrides=[...])` (a deployment).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from pfactory.runtime.failures import chain
from pfactory.runtime.project import configure_environment
from pfactory.storage import artifacts as af
from pfactory.storage.dag import stage_names

configure_environment()  # before Prefect is imported: PREFECT_HOME, analytics off

from prefect import flow, get_run_logger, task  # noqa: E402

from flows import parent_run, runlog  # noqa: E402
from flows.console import current as current_console  # noqa: E402
from flows.experiment import checkout_outputs, experiment_tags, save_experiment  # noqa: E402
from flows.failure import openable  # noqa: E402
from flows.workspace import (  # noqa: E402
    StageFailed,
    Workspace,
    check_cache,
    create_workspace,
    fetch_remote_run,
    locate_run,
    new_run_id,
    open_workspace,
    read_record,
)
from pfactory.team import slots  # noqa: E402

STAGES = stage_names()  # declared once, in dvc.yaml
T = TypeVar("T")
# Attempts after the first, per stage: only ever for a transient failure (`_transient_only`), so a
# deterministic stage error (a gate, bad data, a bug, bad params) fails once. evaluate and promote talk
# to a Dask cluster and the registry (servers that hiccup): one more try than the pure-compute stages.
RETRIES = {"evaluate": 2, "promote": 2}  # others: DEFAULT_RETRIES
DEFAULT_RETRIES = 1
RETRY_DELAY_S = 5
PROGRESS_FILE = "progress.jsonl"  # under <workspace>/logs/: the stages' progress events (pfactory.runtime.progress)
EXIT_INTERRUPTED = 143  # 128 + SIGTERM
_stop = threading.Event()  # SIGTERM came while stages ran: no retry, no next stage


class RunInterrupted(RuntimeError):
    """`factory run` got SIGTERM: the running stage was stopped (train checkpoints first). `command` resumes it."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, run_id: str, stage: str | None, index: int = 0, total: int = 0) -> None:
        self.run_id, self.stage, self.index, self.total = run_id, stage, index, total
        self.command = f"factory run --resume {run_id}"
        where = f" at {stage} ({index} of {total})" if stage else ""
        super().__init__(f"interrupted (SIGTERM){where}; resume: {self.command}")


@contextlib.contextmanager
def _forward_sigterm(ws: Workspace) -> Iterator[None]:
    """While the stages run: SIGTERM is passed on to the running stage's processes (`Workspace.interrupt`)
    and remembered (`_stop`), instead of Prefect's handler tearing the flow down around a stage that is still
    writing its checkpoint. Main thread only (where signals are delivered)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: Any) -> None:
        _stop.set()
        ws.interrupt(signal.SIGTERM)

    _stop.clear()
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's `retry_condition_fn`: retry a stage only when its failure was transient (a lost worker
    or connection, exit 75, a killed process: `StageFailed.transient`), never a deterministic error."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:
            return False
    return isinstance(exc, StageFailed) and exc.transient and not _stop.is_set()


def _stage_task(stage: str) -> Any:
    retries = RETRIES.get(stage, DEFAULT_RETRIES)

    # persist_result=False: Prefect would otherwise pickle results and exceptions into PREFECT_HOME/storage
    # (inside artifacts/) and unpickle them on a cache hit -- nothing is ever unpickled from an artifact dir.
    @task(
        name=stage,
        retries=retries,
        retry_delay_seconds=RETRY_DELAY_S,
        retry_condition_fn=_transient_only,
        persist_result=False,
    )
    def run_stage(ws: Workspace, index: int, total: int) -> dict[str, Any]:
        try:
            result = ws.repro(stage, index, total)
        except StageFailed as e:
            if e.transient and ws.attempts[stage] <= retries and not _stop.is_set():
                again = "resuming" if e.interrupted else "retrying"
                current_console().note(
                    f"{stage}: transient failure ({'killed' if e.killed else f'exit {e.status}'}); {again} in "
                    f"{RETRY_DELAY_S} s (attempt {ws.attempts[stage] + 1} of {retries + 1})",
                    style="yellow",
                )
            raise
        get_run_logger().info("%s: %s in %.1f s", stage, result["how"], result["seconds"])
        return result

    return run_stage


STAGE_TASKS = {stage: _stage_task(stage) for stage in STAGES}


def declared_stages(root: Path) -> list[str]:
    """STAGES in order, those that the project's dvc.yaml declares."""
    declared = stage_names(root)
    return [s for s in STAGES if s in declared]


def primary_latency(optimized: Path) -> dict[str, float]:
    """p50/p99 (ms) at batch 1 of the primary artifact (backend.json's `primary`) from latency.json; empty
    when optimize has not written them (the same reading as the promote gate's, without its errors)."""
    from pfactory.promote.errors import EvidenceError
    from pfactory.promote.evidence import latency_summary

    manifest = af.backend_manifest(optimized)
    latency = af.latency(optimized)
    if not manifest or not latency:
        return {}
    primary = manifest["primary"]
    runner = f"{primary['backend']}/{primary['precision']}"
    try:
        stats = latency_summary(latency, runner, 1, str(optimized / af.LATENCY))
    except EvidenceError:
        return {}
    out = {"latency/p50_ms": stats["p50_ms"], "latency/p99_ms": stats["p99_ms"]}
    served = [a for a in manifest.get("artifacts", []) if a.get("backend") == primary["backend"]
              and a.get("precision") == primary["precision"] and a.get("bytes")]  # fmt: skip
    if served:  # the deployed file's size: architectures compare on it too (`factory compare`)
        out["artifact/primary_mb"] = round(served[0]["bytes"] / 2**20, 3)
    return out


def collect_metrics(ws: Workspace) -> tuple[dict[str, float], dict[str, Any]]:
    """Parent-run metrics from the stages' files (module docstring), and the summary blocks."""
    p = ws.params.paths
    metrics: dict[str, float] = {}
    summary: dict[str, Any] = {}
    kpis = af.kpis(ws.abs(p.eval))
    if kpis is not None:
        # The headline only (tens of numbers, what the runs table can show); the evaluate stage's run
        # keeps every per-threshold / per-range figure.
        metrics.update(af.headline_scalars(kpis, prefix="eval/"))
        summary["kpis"] = {
            "mAP": kpis.get("mAP"),
            "NDS": kpis.get("NDS"),
            "classes": {c: v.get("mean_ap") for c, v in kpis.get("classes", {}).items()},
            "delta_mAP_vs_pytorch": (kpis.get("delta") or {}).get("mAP"),
        }
    metrics.update(primary_latency(ws.abs(p.optimized)))
    parity = af.parity(ws.abs(p.optimized))
    if parity is not None:
        summary["parity_passed"] = parity.get("passed")
    promotion = af.promotion(ws.abs(p.artifacts))
    if promotion is not None:
        summary["promotion"] = promotion
    return metrics, summary


def stage_timings(ws: Workspace) -> dict[str, dict[str, float]]:
    """Per stage that ran in this run: `{"body_s", "process_s"}` (`PFACTORY_TIMINGS_DIR` files)."""
    out: dict[str, dict[str, float]] = {}
    for f in sorted((ws.path / "logs" / "timings").glob("*.json")):
        t = json.loads(f.read_text())
        out[t["stage"]] = {"body_s": float(t["body_s"]), "process_s": float(t["process_s"])}
    return out


@contextlib.contextmanager
def _stage_failure_first() -> Iterator[None]:
    """A failed stage is the run's failure. What fails after it while the flow records the failure on the
    parent MLflow run (logging dvc.lock, ending the run FAILED) -- typically the same fault, a tracking
    server gone mid-run -- is logged, never raised in its place: otherwise the failure screen shows a
    raw MlflowException "in the flow, outside the stages" instead of the stage, its log and its reason.
    (The parent run then stays RUNNING on the server until the next start reaps it: its process is gone.)"""
    try:
        yield
    except Exception as e:
        cause = next((c for c in chain(e.__context__) if isinstance(c, StageFailed)), None)
        if isinstance(e, (StageFailed, RunInterrupted)) or cause is None:
            raise
        get_run_logger().warning("the parent run could not record the failure of %s: %r", cause.stage, e)
        raise cause from None


@flow(name="perception-factory", log_prints=True, persist_result=False)
def pipeline(
    overrides: list[str] | None = None,
    name: str | None = None,
    root: str | None = None,
    stages: list[str] | None = None,
    checkout: bool = True,
    resume: str | None = None,
) -> dict[str, Any]:
    """Run the stage DAG on params.yaml + `overrides` in a fresh workspace; returns the run summary.

    `resume`: continue an interrupted run in its own workspace instead (module docstring): a run id or run
    name, "" for the newest interrupted run; its overrides and stages are the run's own (`overrides` and
    `stages` must be empty), `name` defaults to its name.
    `stages`: a prefix of STAGES to stop early (default: all). `checkout`: on success, copy the run's outputs
    to the project's own paths (`flows.experiment.checkout_outputs`), so follow-up commands find them. The
    summary has `run_id`, `workspace`, `mlflow_run_id`, per-stage results, `timings_s`, `kpis`, `promotion`,
    `orchestration`, `experiment` (the DVC experiment: name, rev, baseline; None without a git commit) and
    `checked_out` (the output paths brought to the root; None with `checkout=False`).
    """
    from flows.params import load_params
    from pfactory.storage.retention import run_lease

    t_start = time.perf_counter()
    root_path = configure_environment(root)
    reopen = _reopened(root_path, resume)
    if reopen is not None:
        if overrides:
            raise ValueError("--resume continues a run with its own params: no -S overrides with it")
        record = read_record(reopen)
        overrides, name = list(record.get("overrides") or []), name or record.get("name")
        stages = stages or record.get("stages")
        params = load_params(reopen / "params.yaml")
    else:
        params = load_params(root_path / "params.yaml", overrides or [])
    selected = list(stages or declared_stages(root_path))
    unknown = [s for s in selected if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; known: {list(STAGES)}")
    check_cache(root_path)  # a read-only shared cache: said before anything starts
    run_id = reopen.name if reopen is not None else new_run_id(name)
    # The lease tells `factory gc` (any clone sharing the cache) that this run is in progress: its workspace
    # and every object its dvc.lock names stay, whatever the policy (pfactory/storage/retention.py).
    with run_lease(root_path, run_id):
        results = _run(root_path, params, selected, run_id, overrides, name, checkout, t_start, reopen)
    if params.gc.keep_last is not None or params.gc.keep_days is not None:
        results["gc"] = _gc_after_run(root_path, params)
    return results


def _reopened(root: Path, resume: str | None) -> Path | None:
    """The workspace this flow run continues: the one `resume` names (`locate_run`: here, or fetched from the
    DVC remote), or, on a retry of the flow run (Prefect's run count > 1), the workspace its earlier try made;
    None: a new run."""
    if resume is not None:
        found = locate_run(root, resume or None)  # here, else on the DVC remote (another machine's run)
        return found if isinstance(found, Path) else fetch_remote_run(root, found)
    from prefect.runtime import flow_run

    if flow_run.get_run_count() <= 1 or not flow_run.get_id():
        return None
    runs = root / "artifacts" / "runs"
    mine = [
        p
        for p in sorted(runs.glob("*"), reverse=True)
        if read_record(p).get("flow_run_id") == flow_run.get_id()
    ]
    return mine[0] if mine else None


def _triggered_by() -> dict[str, str]:
    """The parent run's tags saying who triggered this flow run (`factory deploy --run-now` on a worker): the
    claimed user and whether the MLflow server backs the claim (`pfactory.tracking.trigger.verify_trigger`);
    the MLflow user of the run stays the worker's account (`pfactory.user`). {} when nothing is claimed."""
    from prefect.runtime import flow_run

    from pfactory.tracking.trigger import claims, verify_trigger

    try:
        tags, flow_run_id = flow_run.get_tags() or [], flow_run.get_id()
    except Exception:  # no flow run context
        return {}
    user, record = claims(tags)
    return verify_trigger(user, record, str(flow_run_id)) if flow_run_id else {}


@contextlib.contextmanager
def _parent_run(
    exp_id: str, run_id: str, name: str | None, ws: Workspace, reopen: str | None
) -> Iterator[Any]:
    """The run's MLflow parent run: `reopen` (a resumed run's own, when this tracking store has it) or a new
    one (tagged `resumes_mlflow_run` = the one it could not reopen, linking the two)."""
    import mlflow

    tags = {"pipeline": "true", "run_id": run_id, "workspace": str(ws.path), **_triggered_by()}
    if reopen is not None:
        try:
            ctx = mlflow.start_run(run_id=reopen)
        except Exception as e:  # another tracking store, a deleted run
            get_run_logger().warning("could not reopen MLflow run %s (%r); starting a linked one", reopen, e)
            tags["resumes_mlflow_run"] = reopen
        else:
            with ctx as run:
                yield run
            return
    with mlflow.start_run(experiment_id=exp_id, run_name=name or run_id, tags=tags) as run:
        yield run


def _gc_after_run(root: Path, params: Any) -> dict[str, Any]:
    """`-S gc.keep_last=N` / `gc.keep_days=D`: the retention policy applied after a successful run (what
    `factory gc --keep-last N --keep-days D --yes` does). A gc that fails is reported; the run stays a success."""
    from pfactory.promote import registry as reg
    from pfactory.storage.retention import collect, plan, registry_lineage

    try:
        p = plan(root, params.gc.keep_last, params.gc.keep_days, lambda: registry_lineage(reg.client()))
        done = collect(root, p)
    except Exception as e:  # the registry unreachable, a full disk...: nothing half-done is left referenced
        get_run_logger().warning("gc after the run failed: %r", e)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    current_console().note(
        f"gc: removed {len(done.runs)} runs, {done.objects} cache objects; {done.freed_bytes / 2**20:.1f} MiB freed"
    )
    return {"ok": True, **p.summary(), "freed_bytes": done.freed_bytes, "skipped": done.skipped}


def _run(
    root_path: Path, params: Any, selected: list[str], run_id: str, overrides: list[str] | None, name: str | None,
    checkout: bool, t_start: float, reopen: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The body of `pipeline` once the run holds its lease (its docstring); `reopen`: the workspace resumed."""
    from prefect.runtime import flow_run

    if reopen is not None:
        ws = open_workspace(root_path, reopen)
        record = read_record(reopen)
    else:
        ws = create_workspace(root_path, params, run_id, overrides or [])
        record = {}
    resumes = int(record.get("resumes", -1)) + 1
    ws.record(run_id=run_id, name=name, overrides=list(overrides or []), stages=selected, mode=ws.mode,
              baseline=ws.baseline, untracked=ws.untracked, params_written=ws.params_written, state="running",
              flow_run_id=flow_run.get_id(), resumes=resumes)  # fmt: skip
    try:
        results = _run_in(ws, root_path, params, selected, run_id, name, checkout, t_start, record, resumes)
    except RunInterrupted:
        ws.record(state="interrupted")
        _travel(ws, "interrupted")
        raise
    except StageFailed as e:
        ws.record(state="interrupted" if e.interrupted else "failed", failed_stage=e.stage)
        if e.interrupted:
            _travel(ws, "interrupted")
        raise
    except BaseException:
        ws.record(state="failed")
        raise
    ws.record(state="finished")
    results["remote_run"] = _travel(ws, "finished")
    return results


def _travel(ws: Workspace, state: str) -> dict[str, Any] | None:
    """With a default DVC remote, the run's copy there (module docstring): an interrupted run pushes the
    stages it finished (their outputs and run-cache: another clone restores them) and marks its record
    interrupted; a finished one marks it finished (its resume checkpoint removed). Never raises."""
    if not ws.remote:
        return None
    out: dict[str, Any] = {}
    if state == "interrupted":
        done = list(ws.lock().get("stages") or {})
        out["pushed"] = ws.push(done) if done else None
    out["record"] = ws.sync_remote(state)
    if not all(r is None or r.get("ok") for r in out.values()):
        get_run_logger().warning("run %s: its copy on the DVC remote is incomplete: %s", ws.run_id, out)
    return out


def _stage_env() -> dict[str, str | None]:
    """The environment variables `_run_in` sets for the stages, as they are before it sets them."""
    from pfactory.runtime.progress import PROGRESS_ENV
    from pfactory.tracking.runs import PARENT_ENV

    return {
        k: os.environ.get(k) for k in (PARENT_ENV, "PFACTORY_TIMINGS_DIR", PROGRESS_ENV, slots.NO_SERVER_ENV)
    }


def _set_stage_env(parent_run_id: str, timings_dir: Path, progress_file: Path) -> None:
    """What the stages read from the environment: the parent run they nest under, where they write their
    timings and progress events, and (without a Prefect server) that they need not look for one."""
    from pfactory.runtime.progress import PROGRESS_ENV
    from pfactory.tracking.runs import PARENT_ENV

    os.environ[PARENT_ENV] = parent_run_id
    os.environ["PFACTORY_TIMINGS_DIR"] = str(timings_dir)
    os.environ[PROGRESS_ENV] = str(progress_file)
    if not slots.enabled():  # the stages need not import Prefect to find that out again
        os.environ[slots.NO_SERVER_ENV] = "1"


def _restore_env(before: dict[str, str | None]) -> None:
    """Put back the environment variables `before` (`_stage_env`) names: their value, or unset."""
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _log_parent_params(ws: Workspace, root_path: Path, params: Any, run: Any, record: dict[str, Any],
                       resumes: int) -> None:  # fmt: skip
    """The parent run's tags (lineage, process, `resumes`) and, unless it is the resumed run's own run
    reopened (`record["mlflow_run_id"]`), the resolved params (flattened, and params.json)."""
    import mlflow

    from pfactory.runtime.lineage import lineage_tags
    from pfactory.tracking.runs import flatten, process_tags

    reopened = resumes and run.info.run_id == record.get("mlflow_run_id")
    ws.record(mlflow_run_id=run.info.run_id)
    mlflow.set_tags({**lineage_tags(root_path), **process_tags(), "resumes": str(resumes)})
    if not reopened:  # a reopened run has them (MLflow refuses a param logged again with another value)
        flat = flatten(params.model_dump(mode="json"))
        items = [(k, json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow caps a log_params batch at 100
            mlflow.log_params(dict(items[i : i + 100]))
        mlflow.log_dict(params.model_dump(mode="json"), "params.json")


def _run_stages(
    ws: Workspace,
    selected: list[str],
    run_id: str,
    results: dict[str, Any],
    console: Any,
    progress_file: Path,
) -> None:
    """Run the `selected` stages in order (`STAGE_TASKS`), each followed on `console` and timed on the parent
    run (`results["stages"]`, `results["timings_s"]`); `RunInterrupted` after SIGTERM. After evaluate the run
    report vs the champion is drawn while the later stages run: `results["report"]`, even when one fails."""
    import mlflow

    report = None  # the run report vs the champion, drawn while the stages after evaluate run
    try:
        n = len(selected)
        for i, stage in enumerate(selected, 1):
            console.stage_started(i, n, stage)
            try:
                with console.following(progress_file, stage), _forward_sigterm(ws):
                    results["stages"][stage] = STAGE_TASKS[stage](ws, i, n)
            except StageFailed as e:
                console.stage_failed()
                if _stop.is_set():
                    mlflow.set_tag("interrupted", f"SIGTERM in {stage}")
                    raise RunInterrupted(run_id, stage, i, n) from e
                raise
            if _stop.is_set():  # SIGTERM while the stage was finishing: stop before the next one
                raise RunInterrupted(run_id, None)
            results["timings_s"][stage] = round(ws.stage_seconds[stage], 3)
            if stage == "evaluate":  # the champion as it is before this run's promote stage
                report = parent_run.champion_report(ws)
            r = results["stages"][stage]
            console.stage_finished(i, n, stage, r["how"], r["seconds"])
            mlflow.log_metric(f"time/{stage}_s", results["timings_s"][stage])
    finally:
        if report is not None:
            results["report"] = report.result()


def _log_lock(ws: Workspace) -> None:
    """The workspace's dvc.lock (when a stage wrote it) on the parent run, and its outputs' hashes as tags."""
    import mlflow

    if (ws.path / "dvc.lock").is_file():
        mlflow.log_artifact(str(ws.path / "dvc.lock"))
        mlflow.set_tags({f"data.{k}.md5": v for k, v in ws.out_hashes().items()})


def _save_run(
    ws: Workspace,
    root_path: Path,
    selected: list[str],
    name: str | None,
    checkout: bool,
    results: dict[str, Any],
    meanwhile: Callable[[], T],
) -> T:
    """The finished run as DVC sees it: an experiment of the project (`results["experiment"]`), its outputs
    at the root's paths (`results["checked_out"]`), pushed to a DVC remote when there is one
    (`results["pushed"]`); `results["cache"]`: the DVC cache the workspace used and how it linked. Returns what
    `meanwhile()` returned, called while the experiment is saved (what does not name it)."""
    import mlflow

    partial = selected != list(declared_stages(root_path))
    # `dvc exp save` (a git commit of the workspace, ~2 s) runs beside the checkout to the project's paths
    # (they write different trees) and `meanwhile`; the experiment is waited for before the tags name it.
    with ThreadPoolExecutor(1, thread_name_prefix="exp-save") as pool:
        saving = pool.submit(save_experiment, ws, name, selected if partial else None)
        results["checked_out"] = checkout_outputs(ws) if checkout else None
        done = meanwhile()
        results["experiment"] = saving.result()
    mlflow.set_tags(experiment_tags(ws, results["experiment"]))
    if ws.remote:  # machines that share no disk: this run's outputs and run-cache to the remote
        results["pushed"] = ws.push()
        mlflow.set_tag("dvc.push", "ok" if results["pushed"]["ok"] else results["pushed"]["detail"][:250])
    results["cache"] = {"dir": ws.cache_dir, "link_types": ws.link_types, "how": ws.links_how}
    return done


def _orchestration(ws: Workspace, t_start: float) -> tuple[dict[str, Any], dict[str, float]]:
    """The run's wall time since `t_start` split into stage work, stage start-up and orchestration (Prefect +
    DVC + MLflow + workspace set-up: wall time outside the stage processes): the summary's "orchestration"
    block and the parent run's time/orchestration metrics."""
    stage_t = stage_timings(ws)
    total = time.perf_counter() - t_start
    work = sum(t["body_s"] for t in stage_t.values())
    startup = sum(t["process_s"] - t["body_s"] for t in stage_t.values())
    orchestration = max(total - work - startup, 0.0)
    block = {
        "total_s": round(total, 3),
        "stage_work_s": {k: round(t["body_s"], 3) for k, t in stage_t.items()},
        "stage_startup_s": round(startup, 3),
        "orchestration_s": round(orchestration, 3),
        "orchestration_fraction": round(orchestration / total, 4) if total > 0 else None,
    }
    metrics = {
        "time/total_s": total,
        "time/stage_startup_s": startup,
        "orchestration/seconds": orchestration,
        "orchestration/fraction": orchestration / total if total > 0 else 0.0,
    }
    return block, metrics


def _summarize(
    ws: Workspace, exp_id: str, parent_run_id: str, t_start: float, results: dict[str, Any], lineage: dict[str, dict]
) -> None:
    """The parent run's metrics (the stages' KPIs and latency, the timings), description (`lineage`: from
    `parent_run.record_lineage`), promotion decision and summary.json; `results` gets the summary blocks,
    "orchestration" and "lineage"."""
    import mlflow

    metrics, summary = collect_metrics(ws)
    results.update(summary)
    results["orchestration"], timing = _orchestration(ws, t_start)
    metrics.update(timing)
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
    parent_run.describe(mlflow.MlflowClient(), exp_id, parent_run_id, results, lineage)
    results["lineage"] = lineage
    decision = (results.get("promotion") or {}).get("decision")
    if decision:
        mlflow.set_tag("promotion.decision", decision)
    mlflow.log_dict(results, "summary.json")


def _run_in(
    ws: Workspace, root_path: Path, params: Any, selected: list[str], run_id: str, name: str | None,
    checkout: bool, t_start: float, record: dict[str, Any], resumes: int,
) -> dict[str, Any]:  # fmt: skip
    """`_run` once the workspace is there (new, or reopened when `resumes` > 0): the MLflow parent run, the
    stages, then the run saved as a DVC experiment and summarised on the parent run. Returns the summary."""
    import mlflow

    from pfactory.tracking.runs import experiment_id, reap_orphan_runs

    runlog.attach(ws.path / "logs" / "prefect.log")  # `factory run`: Prefect's own records, off the terminal
    console = current_console()
    logger = get_run_logger()
    logger.info("run %s: workspace %s", run_id, ws.path)
    console.note(f"{'resuming ' if resumes else ''}workspace {openable(ws.path)}")  # its name is the run id

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    exp_id = experiment_id(root_path)
    reap_orphan_runs(exp_id)  # runs left RUNNING by killed earlier runs (their processes are gone)
    results: dict[str, Any] = {
        "run_id": run_id,
        "workspace": str(ws.path),
        "registered_model": params.promote.model_name,
        "mlflow_experiment_id": exp_id,
        "stages": {},
        "timings_s": {},
    }
    timings_dir = ws.path / "logs" / "timings"
    timings_dir.mkdir(parents=True, exist_ok=True)
    progress_file = ws.path / "logs" / PROGRESS_FILE
    env_before = _stage_env()
    with (
        _stage_failure_first(),
        _parent_run(exp_id, run_id, name, ws, record.get("mlflow_run_id") if resumes else None) as run,
    ):
        results["mlflow_run_id"] = run.info.run_id
        _log_parent_params(ws, root_path, params, run, record, resumes)
        _set_stage_env(run.info.run_id, timings_dir, progress_file)
        try:
            _run_stages(ws, selected, run_id, results, console, progress_file)
        finally:
            _restore_env(env_before)
            _log_lock(ws)
        lineage = _save_run(
            ws, root_path, selected, name, checkout, results,
            meanwhile=lambda: parent_run.record_lineage(mlflow.MlflowClient(), exp_id, run.info.run_id, ws, results),
        )  # fmt: skip
        _summarize(ws, exp_id, run.info.run_id, t_start, results, lineage)
    return results
