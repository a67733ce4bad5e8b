"""The one entry of every stage: `python -m tasks.<stage>` (what `dvc.yaml` runs) and `factory <stage>`
(the Typer command passes its options through as arguments).

Parses `[-S section.key=value ...] [--params FILE]` (plus the stage's own arguments, whose defaults
are the `paths` of params.yaml), loads and validates params (exit 2 with a message naming the key on
a bad value), configures the offline environment, runs the stage and prints its metrics as JSON.
Exit codes, for every stage (what `factory run` and its retries read, docs/OPERATIONS.md):
    0   done
    1   the stage ran and failed: a gate, bad data, a bug (deterministic: a retry fails the same way)
    2   bad usage, parameters or inputs, nothing ran
    75  a transient failure (EX_TEMPFAIL): a lost connection or Dask worker, a locked database — whatever
        `is_transient` finds in the exception's chain, even for a type the stage's table maps to 1
Each stage lists which of its errors mean 1 or 2 in its `failures` table.

When `PFACTORY_TIMINGS_DIR` is set (the pipeline flow sets it), the stage also writes
`<dir>/<stage>.json`: `{"stage", "body_s", "process_s"}` = seconds inside the stage body and since the
process started, so the flow can split a run's wall time into stage work and orchestration overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

TIMINGS_ENV = "PFACTORY_TIMINGS_DIR"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TRANSIENT = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"

# Exceptions that say "the world hiccupped", not "this input or code is wrong": (top-level module, class
# name) anywhere in an exception's MRO. Names, not imports: the stage may not have these packages loaded.
_TRANSIENT_TYPES = {
    ("builtins", "ConnectionError"),  # refused / reset / aborted / broken pipe
    ("builtins", "TimeoutError"),
    ("distributed", "KilledWorker"),  # a Dask worker died under a task (OOM killer, a lost node)
    ("distributed", "CommClosedError"),
    ("requests", "ConnectionError"),  # MLflow's REST client (a tracking server restarting)
    ("requests", "Timeout"),
    ("urllib3", "MaxRetryError"),
    ("urllib3", "NewConnectionError"),
    ("httpx", "ConnectError"),
    ("httpx", "TimeoutException"),
}
_TRANSIENT_MESSAGES = ("database is locked",)  # sqlite under concurrent writers (sqlalchemy OperationalError)


def is_transient(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception in its `__cause__` / `__context__` chain, is a transient failure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for cls in type(exc).__mro__:
            if (cls.__module__.split(".")[0], cls.__name__) in _TRANSIENT_TYPES:
                return True
        if any(m in str(exc) for m in _TRANSIENT_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _exit_transient(stage: str, exc: BaseException) -> None:
    """The traceback for the log, then the one-line reason last (what `factory run` shows), exit 75."""
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    print(f"{stage}: transient failure ({type(exc).__name__}: {exc}); worth a retry", file=sys.stderr)
    sys.exit(EXIT_TRANSIENT)


def record_stage_time(stage: str, body_s: float) -> None:
    """Write `<$PFACTORY_TIMINGS_DIR>/<stage>.json` (no-op when the variable is unset)."""
    folder = os.environ.get(TIMINGS_ENV)
    if not folder:
        return
    import psutil

    from pfactory.fsutil import atomic_write_json

    process_s = time.time() - psutil.Process().create_time()
    atomic_write_json(
        Path(folder) / f"{stage}.json",
        {"stage": stage, "body_s": round(body_s, 3), "process_s": round(process_s, 3)},
    )


def stage_main(
    stage: str,
    argv: list[str] | None,
    body: Callable[..., dict | None],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    failures: Mapping[type[BaseException], int] | None = None,
) -> None:
    """Parse arguments, load params, run `body(params)` (or `body(params, args)` when `add_arguments`
    adds stage-specific options) and print the metrics it returns (nothing when it returns None).

    `failures`: exception type -> exit code; such an error prints `<stage>: <message>` on stderr and
    exits with its code (the first matching type, in order). A transient error (`is_transient`) exits 75
    instead, unless the table calls it a usage error (2); any other exception propagates (exit 1)."""
    from pfactory.config import ParamsError, anchored, load_params
    from pfactory.tracking import configure_environment

    parser = argparse.ArgumentParser(prog=f"python -m tasks.{stage}")
    parser.add_argument("-S", "--set-param", action="append", default=[], help="section.key=value override")
    parser.add_argument("--params", default="params.yaml")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    configure_environment()
    try:  # paths in params.yaml are relative to its folder (the project root), wherever this runs
        params = anchored(load_params(args.params, args.set_param), Path(args.params).parent)
    except ParamsError as e:
        print(e, file=sys.stderr)
        sys.exit(EXIT_USAGE)
    t0 = time.perf_counter()
    try:
        metrics = body(params, args) if add_arguments is not None else body(params)
    except Exception as e:
        from pfactory.failures import explain

        code = next((c for kind, c in (failures or {}).items() if isinstance(e, kind)), None)
        known = explain(e)  # one line for what a user can act on (pfactory/failures.py)
        if known is not None and known[1] == EXIT_TRANSIENT:  # e.g. a tracking server that does not answer
            print(f"{stage}: {known[0]}", file=sys.stderr)
            sys.exit(EXIT_TRANSIENT)
        if code != EXIT_USAGE and is_transient(e):
            _exit_transient(stage, e)
        if code is None:
            if known is None:
                raise
            print(f"{stage}: {known[0]}", file=sys.stderr)
            sys.exit(known[1])
        print(f"{stage}: {e}", file=sys.stderr)
        sys.exit(code)
    record_stage_time(stage, time.perf_counter() - t0)
    if metrics is not None:
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
