"""The one entry of every stage: `python -m tasks.<stage>` (what `dvc.yaml` runs) and `factory <stage>`
(the Typer command passes its options through as arguments).

Parses `[-S section.key=value ...] [--params FILE]` (plus the stage's own arguments, whose defaults
are the `paths` of params.yaml), loads and validates params (exit 2 with a message naming the key on
a bad value), configures the offline environment, runs the stage and prints its metrics as JSON.
Exit codes, for every stage: 0 done; 1 the stage ran and failed (or a gate failed); 2 bad usage,
parameters or inputs: each stage lists which of its errors mean which in its `FAILURES`.

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
    exits with its code (the first matching type, in order)."""
    from pfactory.config import ParamsError, load_params
    from pfactory.tracking import configure_environment

    parser = argparse.ArgumentParser(prog=f"python -m tasks.{stage}")
    parser.add_argument("-S", "--set-param", action="append", default=[], help="section.key=value override")
    parser.add_argument("--params", default="params.yaml")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    configure_environment()
    try:
        params = load_params(args.params, args.set_param)
    except ParamsError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    t0 = time.perf_counter()
    try:
        metrics = body(params, args) if add_arguments is not None else body(params)
    except tuple(failures or ()) as e:
        code = next(c for kind, c in (failures or {}).items() if isinstance(e, kind))
        print(f"{stage}: {e}", file=sys.stderr)
        sys.exit(code)
    record_stage_time(stage, time.perf_counter() - t0)
    if metrics is not None:
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
