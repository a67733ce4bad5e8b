"""Dask for the stages that scale out (prepare, evaluate): the cluster, the work-unit loop, kill-safe results.

One module, used by `pfactory.prepare.scaleout` (prepare) and `pfactory.evaluate.distributed` (evaluate):

- `dask_client(address, workers, threads, setting)`: where the scheduler comes from (`resolve_scheduler`):
  the stage's params (`address`, when set) win; else Dask's own configuration, `scheduler-address` (filled by
  Dask from `DASK_SCHEDULER_ADDRESS` and its YAML files, as `dask worker` and `Client()` read it); else a
  `LocalCluster`. "local:N" or no address at all opens a `LocalCluster` (worker processes with a nanny each,
  `host=127.0.0.1`, no dashboard, scratch under `DASK_TEMPORARY_DIRECTORY`) that is closed on exit; any other
  value connects to that scheduler (`tcp://host:8786`; a dask-kubernetes or dask-jobqueue cluster's address)
  and leaves it running. The choice and its source are said once on stderr and returned as the cluster's
  description (`tcp://h:8786 from Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)`), which the
  stages record (an MLflow tag `<stage>.cluster`; evaluate's timings.json): never in a hashed output.
- `run_tasks(client, tasks, on_result, error, what)`: submits `Task`s (one per work unit, never one per
  frame: Dask costs ~0.2-1 ms per task), hands each result to `on_result` in *completion* order, and submits
  the follow-up tasks `on_result` returns (prepare's shard writes start as soon as their units are in).
  Callers make their output independent of that order.
- Kill safety: a worker that dies mid-task is restarted by its nanny and the scheduler reruns its unfinished
  tasks elsewhere; callers make every task a pure function of its inputs that writes its files atomically, so a
  rerun writes the same bytes. A task that kills its workers 3 times (`KilledWorker`), a lost scheduler, or
  any exception inside a task cancels the rest and raises `error` naming the task.

Task keys are `<prefix>-<run tag>-<index:05d>`: unique per run (a shared scheduler may still hold an older
run's keys) and ending in the unit's index, so a key names its unit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

SCHEDULER_CONFIG = "scheduler-address"  # Dask's own key: `Client()`, `dask worker` read it too
SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"  # how Dask fills it from the environment


def resolve_scheduler(address: str | None, setting: str = "dask_address") -> tuple[str | None, str]:
    """Where a stage's scheduler comes from: `(address, source)`.

    `address` is the stage's (its params' `setting`, or `--dask`): when set it wins, "local:N" included
    (a LocalCluster even when Dask's config names a scheduler); source `params <setting>`. Else Dask's
    configuration key `scheduler-address` (`dask.config`: the `DASK_SCHEDULER_ADDRESS` variable, read when
    Dask is imported, or Dask's YAML files, or `dask.config.set`); source
    `Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)` when the variable holds it, else
    `Dask config scheduler-address`. Else `(None, "local cluster (<stage>.workers)")`: a LocalCluster.
    """
    if address:
        return address, f"params {setting}"
    import dask

    configured = dask.config.get(SCHEDULER_CONFIG, None)
    if configured:
        configured = str(configured)
        via = f" ({SCHEDULER_ENV})" if os.environ.get(SCHEDULER_ENV, "").strip() == configured else ""
        return configured, f"Dask config {SCHEDULER_CONFIG}{via}"
    stage = setting.rpartition(".")[0]
    return None, f"local cluster ({stage}.workers)" if stage else "local cluster"


def _record(setting: str, description: str) -> None:
    """Say where the cluster came from: one stderr line, and the tag `<stage>.cluster` of the active MLflow
    run when the stage is tracked (the stage run `pfactory.tracking.runs.stage_run` opened; none: no tag)."""
    stage = setting.rpartition(".")[0] or "dask"
    print(f"{stage}: Dask cluster {description}", file=sys.stderr, flush=True)
    mlflow = sys.modules.get("mlflow")  # imported by a tracked stage only: never imported here
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.set_tag(f"{stage}.cluster", description)


@contextlib.contextmanager
def dask_client(
    address: str | None,
    workers: int,
    threads_per_worker: int,
    setting: str = "dask_address",
    worker_env: dict[str, str | None] | None = None,
) -> Iterator[tuple[Any, str]]:
    """`(Client, description)` for the scheduler `resolve_scheduler(address, setting)` picks: none /
    "local:N" -> a LocalCluster of `workers` / N worker processes (closed on exit); anything else -> a
    connection to that scheduler (left running). `description` is `<address or local:N> from <source>`
    (said once on stderr; also the active MLflow run's tag `<stage>.cluster`).

    `setting` names the parameter `address` came from; the error when no scheduler answers
    (`ConnectionError`, one line, after Dask's `distributed.comm.timeouts.connect`, 30 s by default) names
    it, or Dask's `scheduler-address` / `DASK_SCHEDULER_ADDRESS` when the address came from there.
    `worker_env`: variables a LocalCluster's worker processes start with on top of Dask's
    `distributed.nanny.pre-spawn-environ`; None removes one (prepare removes Dask's MALLOC_TRIM_THRESHOLD_:
    docs/DATA.md). A remote cluster's workers keep their own environment.
    """
    from distributed import Client, LocalCluster

    address, source = resolve_scheduler(address, setting)
    if address is None or address.startswith("local:"):
        import dask

        n = workers if address is None else int(address.removeprefix("local:"))
        _record(setting, f"local:{n} from {source}")
        scratch = os.environ.get("DASK_TEMPORARY_DIRECTORY")  # configure_environment: inside the project
        env = {**dask.config.get("distributed.nanny.pre-spawn-environ"), **(worker_env or {})}
        with contextlib.ExitStack() as stack:
            stack.enter_context(dask.config.set({"distributed.nanny.pre-spawn-environ": env}))
            for k in [k for k, v in env.items() if v is None and k in os.environ]:
                # The nanny copies its variables into this process's environment before spawning a worker
                # (so an earlier cluster may have left one here): drop it while this cluster lives.
                stack.callback(os.environ.__setitem__, k, os.environ.pop(k))
            cluster = LocalCluster(
                n_workers=n,
                threads_per_worker=threads_per_worker,
                processes=True,  # one GIL (and one DALI / ORT / PyTorch pool) per worker
                host="127.0.0.1",
                dashboard_address=None,
                local_directory=scratch,
                # Task errors reach the driver as exceptions; what the workers log at close (heartbeats
                # racing the scheduler's shutdown: CommClosedError tracebacks) is noise.
                silence_logs=logging.CRITICAL,
            )
            try:
                with Client(cluster) as client:
                    yield client, f"local:{n} from {source}"
            finally:
                cluster.close()
    else:
        import dask

        description = f"{address} from {source}"
        _record(setting, description)
        try:
            client = Client(address, timeout=dask.config.get("distributed.comm.timeouts.connect"))
        except OSError as e:
            why = " ".join(str(e).split())  # one line
            if source.startswith("params"):
                raise ConnectionError(f"{setting} {address!r}: no Dask scheduler answered ({why})") from e
            raise ConnectionError(
                f"{source} {address!r}: no Dask scheduler answered ({why}); start it, or unset {SCHEDULER_ENV} "
                f"(or remove {SCHEDULER_CONFIG} from Dask's YAML config) for a local cluster"
            ) from e
        with client:
            yield client, description


def cluster_slots(client: Any) -> int:
    """Worker threads of the cluster (sum of nthreads)."""
    return sum(client.nthreads().values()) or 1


# ------------------------------------------------------------------------------------------------
# Worker side


def worker_threads() -> int:
    """Dask threads of the worker running this task (1 outside a worker: direct calls, tests)."""
    try:
        from distributed import get_worker

        return int(get_worker().state.nthreads)
    except (ImportError, ValueError, AttributeError):
        return 1


def worker_address() -> str:
    """Address of the worker running this task ("" outside a worker)."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError, AttributeError):
        return ""


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (bytes; Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------
# Driver side


@dataclass
class Task:
    """One unit of work: `fn(*args)` on some worker, keyed `<prefix>-<run tag>-<index:05d>`."""

    prefix: str
    index: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass
class LoopStats:
    """Driver-side figures of one `run_tasks` call."""

    wall_s: float
    tasks: int
    slots: int  # worker threads of the cluster when the loop started
    compute_s: float  # sum over tasks of the worker-measured time (`compute_of`)
    by_prefix: dict[str, int] = field(default_factory=dict)  # tasks per key prefix

    @property
    def overhead_per_task_s(self) -> float:
        """Scheduling overhead per task: (wall x slots - compute) / tasks, i.e. task wall minus compute,
        averaged: submission, transfer of results, idle slots while others finish."""
        return max(0.0, (self.wall_s * self.slots - self.compute_s) / max(self.tasks, 1))


def task_key(prefix: str, tag: str, index: int) -> str:
    return f"{prefix}-{tag}-{index:05d}"


def run_tasks(
    client: Any,
    tasks: Iterable[Task],
    on_result: Callable[[Task, Any], Iterable[Task] | None],
    error: type[Exception],
    what: str,
    compute_of: Callable[[Any], float] = lambda _: 0.0,
) -> LoopStats:
    """Submit `tasks`; call `on_result(task, result)` for each as it completes and submit what it returns.

    Returns when every task (follow-ups included) is done. An exception of type `error` raised inside a task
    reaches the caller as is (its message names the unit); anything else (`KilledWorker`: a task killed its
    workers 3 times; a lost scheduler; another exception) becomes `error("<what>: task <key> failed: ...")`.
    Either way the outstanding tasks are cancelled first.
    """
    from distributed import as_completed

    slots = cluster_slots(client)
    tag = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    by_key: dict[str, Task] = {}
    counts: dict[str, int] = {}
    futures: list[Any] = []

    def submit(batch: Iterable[Task]) -> list[Any]:
        out = []
        for t in batch:
            key = task_key(t.prefix, tag, t.index)
            by_key[key] = t
            counts[t.prefix] = counts.get(t.prefix, 0) + 1
            out.append(client.submit(t.fn, *t.args, key=key, pure=False))
        futures.extend(out)
        return out

    compute = 0.0
    pending = as_completed(submit(tasks))
    try:
        for fut in pending:
            try:
                res = fut.result()
            except error:
                raise
            except Exception as e:
                raise error(f"{what}: task {fut.key} failed: {type(e).__name__}: {e}") from e
            compute += compute_of(res)
            for f in submit(on_result(by_key[fut.key], res) or ()):
                pending.add(f)
    except BaseException:
        client.cancel(futures)
        raise
    return LoopStats(time.perf_counter() - t0, len(by_key), slots, compute, counts)
