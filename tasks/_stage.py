"""The one entry of every stage: `python -m tasks.<stage>` (what `dvc.yaml` runs) and `factory <stage>`
(the Typer command passes its options through as arguments).

Parses `[-S section.key=value ...] [--params FILE]` (plus the stage's own arguments, whose defaults
are the `paths` of params.yaml), loads and validates params (exit 2 with a message naming the key on
a bad value), configures the offline environment, runs the stage and prints its metrics as JSON.
Exit codes, for every stage (what `factory run` and its retries read, docs/OPERATIONS.md): 0 done;
1 the stage ran and failed (a gate, bad data, a bug: a retry fails the same way); 2 bad usage, parameters
or inputs, nothing ran; 75 a transient failure (EX_TEMPFAIL): a lost connection or Dask worker, a locked
database -- whatever `pfactory.failures.is_transient` finds in the exception's chain. Each error class says
its own code (`pfactory.failures.UserError.exit_code`); the stage's verdict is also written as a small JSON
(`pfactory.failures.Outcome`, when `PFACTORY_OUTCOME_DIR` is set) that the flow reads, not the console.

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
from typing import NoReturn

TIMINGS_ENV = "PFACTORY_TIMINGS_DIR"


def _explained(stage: str, exc: Exception) -> bool:
    """Record the verdict on `exc` (`pfactory.failures.stage_outcome`); an error a user can act on prints one
    line `<stage>: <reason>` on stderr and exits with its code; a transient failure that is not one of ours
    prints its traceback first (for the log), exit 75. False: a bug, the caller re-raises it (exit 1)."""
    import traceback

    from pfactory.failures import explain, stage_outcome, write_outcome

    outcome = stage_outcome(stage, exc)
    write_outcome(outcome)
    known = explain(exc)
    if outcome.transient and (known is None or known.code != outcome.code):
        traceback.print_exception(exc, file=sys.stderr)
        print(f"{stage}: transient failure ({type(exc).__name__}: {exc}); worth a retry", file=sys.stderr)
    elif known is None:
        return False
    else:
        print(f"{stage}: {known.reason}", file=sys.stderr)
    sys.exit(outcome.code)


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
    sections: Mapping[str, type] | None = None,
) -> None:
    """Parse arguments, load params, run `body(params)` (or `body(params, args)` when `add_arguments`
    adds stage-specific options) and print the metrics it returns (nothing when it returns None).
    `sections`: the params sections the stage reads (name -> model), besides `paths` and the values it shares
    (`pfactory.params_file.SHARED`); nothing else of params.yaml is read or imported.

    An error a user can act on (`pfactory.failures.UserError`, a full disk, ...) prints `<stage>: <reason>`
    on stderr and exits with its code; a transient one exits 75 unless it is a usage error (2); any other
    exception propagates (exit 1). Every verdict is also written as the stage's outcome JSON."""
    from pfactory import failures as fl
    from pfactory.params_file import ParamsError, anchored, load_sections
    from pfactory.tracking import configure_environment

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:  # argparse's complaint is the stage's reason (exit 2)
            fl.write_outcome(fl.stage_outcome(stage, fl.UsageError(message)))
            super().error(message)

    fl.start_outcome(stage)
    parser = Parser(prog=f"python -m tasks.{stage}")
    parser.add_argument("-S", "--set-param", action="append", default=[], help="section.key=value override")
    parser.add_argument("--params", default="params.yaml")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        configure_environment()
        try:  # paths in params.yaml are relative to its folder (the project root), wherever this runs
            params = anchored(load_sections(args.params, args.set_param, dict(sections or {})), Path(args.params).parent)
        except ParamsError as e:
            fl.write_outcome(fl.stage_outcome(stage, e))
            print(e, file=sys.stderr)
            sys.exit(e.exit_code)
        t0 = time.perf_counter()
        metrics = body(params, args) if add_arguments is not None else body(params)
    except Exception as e:
        if not _explained(stage, e):
            raise
    record_stage_time(stage, time.perf_counter() - t0)
    if metrics is not None:
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    fl.write_outcome(fl.Outcome(stage, fl.EXIT_OK, log=os.environ.get(fl.STAGE_LOG_ENV)))
