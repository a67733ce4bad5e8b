"""Dask test helpers shared by the prepare and evaluate scale-out tests: a LocalCluster, and a worker
SIGKILLed while it executes a matching task (the kill-safety tests of `pfactory.cluster` users)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
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
