"""Dask test helpers shared by the prepare and evaluate scale-out tests: a LocalCluster, a worker
SIGKILLed while it executes a matching task (the kill-safety tests of `pfactory.runtime.cluster` users), and a
cluster started the conventional way (`dask scheduler` + `dask worker` processes, each in its own folder)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def local_cluster(scratch: Path, workers: int = 2) -> Iterator[tuple[Any, Any]]:
    """`(LocalCluster, Client)`: `workers` processes of 1 thread on 127.0.0.1, scratch under `scratch`."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                     dashboard_address=None, local_directory=str(scratch), silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        yield cluster, client


@contextlib.contextmanager
def killing_a_worker(client: Any, matches: Callable[[str], bool]) -> Iterator[dict[str, Any]]:
    """While the body runs, SIGKILL one worker (the first by address) as soon as it executes a task whose key
    `matches`. Yields a dict that holds, once the kill happened, `victim` (address), `pid` and `keys`."""
    pids = client.run(os.getpid)  # {worker address: pid}
    victim = sorted(pids)[0]
    killed: dict[str, Any] = {}
    stop = threading.Event()

    def executing(dask_worker) -> list[str]:
        return [str(ts.key) for ts in dask_worker.state.executing]

    def killer() -> None:
        while not stop.is_set():
            keys = [k for k in client.run(executing, workers=[victim]).get(victim, []) if matches(k)]
            if keys:
                os.kill(pids[victim], signal.SIGKILL)
                killed.update(victim=victim, pid=pids[victim], keys=keys)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def dask_cli_cluster(root: Path, workers: int = 1, timeout_s: float = 120.0) -> Iterator[str]:
    """A real `dask scheduler` and `dask worker` (`--nworkers workers --nthreads 1`, a nanny each), started
    as the docs do (`python -m dask ...`, the `dask` CLI) on 127.0.0.1 with their cwd and scratch in their own
    folders under `root` (`scheduler/`, `worker/`: no checkout there; the worker imports the project through
    `PYTHONPATH=<repo>`). They inherit this process's environment as it is now (the AWS variables of a moto
    server, say) without `DASK_SCHEDULER_ADDRESS`. Yields the scheduler's address once `workers` workers
    joined; both are stopped on exit (SIGTERM, then SIGKILL). Their logs: `root/{scheduler,worker}/log.txt`."""
    from distributed import Client

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> Path:
        cwd = root / name
        (cwd / "scratch").mkdir(parents=True, exist_ok=True)
        with open(cwd / "log.txt", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dask", *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                env={**env, "DASK_TEMPORARY_DIRECTORY": str(cwd / "scratch")},
            ))  # fmt: skip
        return cwd

    def logs() -> str:
        return " | ".join(f"{n}: {(root / n / 'log.txt').read_text()[-800:]}" for n in ("scheduler", "worker")
                          if (root / n / "log.txt").exists())  # fmt: skip

    try:
        # --dashboard-address: the scheduler's HTTP server (/health, even without the dashboard) on a free
        # loopback port, not Dask's default :8787 on every interface.
        sched = start("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                    "--dashboard-address", "127.0.0.1:0",
                                    "--scheduler-file", str(root / "scheduler" / "scheduler.json")])  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not (sched / "scheduler.json").exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dask scheduler did not start: {logs()}")
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written in one go, but be sure it is complete
        import json

        address = json.loads((sched / "scheduler.json").read_text())["address"]
        start("worker", ["worker", address, "--host", "127.0.0.1", "--nworkers", str(workers), "--nthreads", "1",
                         "--no-dashboard", "--dashboard-address", "127.0.0.1:0",
                         "--local-directory", str(root / "worker" / "scratch")])  # fmt: skip
        with Client(address, timeout=timeout_s) as client:
            try:
                client.wait_for_workers(workers, timeout=timeout_s)
            except TimeoutError as e:
                raise RuntimeError(f"dask worker did not join: {logs()}") from e
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
