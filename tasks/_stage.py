"""The one entry of every stage: `python -m tasks.<stage>` (what `dvc.yaml` runs, `stage_main`) and
`factory <stage>` (`factory/stage_cli.py` parses the same declared options and calls `run_stage`).

Parses `[-S section.key=value ...] [--params FILE]` plus the stage's own options (`tasks._command`: declared
once for both entries; paths default to the `paths` of params.yaml), loads and validates params (exit 2
with a message naming the key on a bad value), configures the offline environment, runs the stage and prints
its metrics as JSON.
Exit codes, for every stage (what `factory run` and its retries read, docs/OPERATIONS.md): 0 done;
1 the stage ran and failed (a gate, bad data, a bug: a retry fails the same way); 2 bad usage, parameters
or inputs, nothing ran; 75 a transient failure (EX_TEMPFAIL): a lost connection or Dask worker, a locked
database -- whatever `pfactory.runtime.failures.is_transient` finds in the exception's chain. Each error class says
its own code (`pfactory.runtime.failures.UserError.exit_code`); the stage's verdict is also written as a small JSON
(`pfactory.runtime.failures.Outcome`, when `PFACTORY_OUTCOME_DIR` is set) that the flow reads, not the console.

When `PFACTORY_TIMINGS_DIR` is set (the pipeline flow sets it), the stage also writes
`<dir>/<stage>.json`: `{"stage", "body_s", "process_s"}` = seconds inside the stage body and since the
process started, so the flow can split a run's wall time into stage work and orchestration overhead.
A finished stage process skips the interpreter's teardown after its atexit handlers (runtime.quick_exit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

from tasks._command import Command

TIMINGS_ENV = "PFACTORY_TIMINGS_DIR"


def _explained(stage: str, exc: Exception) -> bool:
    """Record the verdict on `exc` (`pfactory.runtime.failures.stage_outcome`); an error a user can act on prints one
    line `<stage>: <reason>` on stderr and exits with its code; a transient failure that is not one of ours
    prints its traceback first (for the log), exit 75. False: a bug, the caller re-raises it (exit 1)."""
    import traceback

    from pfactory.runtime.failures import explain, stage_outcome, write_outcome

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

    from pfactory.storage.fsutil import atomic_write_json

    process_s = time.time() - psutil.Process().create_time()
    atomic_write_json(
        Path(folder) / f"{stage}.json",
        {"stage": stage, "body_s": round(body_s, 3), "process_s": round(process_s, 3)},
    )


class _Parser(argparse.ArgumentParser):
    """argparse whose complaint about a bad argument is also the stage's outcome (exit 2, `UsageError`)."""

    stage = ""

    def error(self, message: str) -> NoReturn:
        from pfactory.runtime import failures as fl

        fl.write_outcome(fl.stage_outcome(self.stage, fl.UsageError(message)))
        super().error(message)


def parser(command: Command) -> argparse.ArgumentParser:
    """The argparse parser of `python -m tasks.<stage>`: `-S`, `--params` and the options `command` declares."""
    p = _Parser(prog=f"python -m tasks.{command.stage}", description=command.help.split("\n\n")[0])
    p.stage = command.stage
    p.add_argument("-S", "--set-param", action="append", default=[], help="section.key=value override")
    p.add_argument("--params", type=Path, default=None, help="the params file (default: the project's)")
    for o in command.options:
        kind = {"choices": o.choices} if o.choices else {}
        if o.positional:
            p.add_argument(o.name, nargs="?", default=o.default, help=o.help, **kind)
        elif o.kind is bool:
            action = argparse.BooleanOptionalAction if o.default else "store_true"
            p.add_argument(*o.flags, dest=o.name, action=action, default=o.default, help=o.help)
        else:
            p.add_argument(*o.flags, dest=o.name, type=o.kind, default=o.default, help=o.help, **kind)
    return p


def stage_main(command: Command, argv: list[str] | None) -> None:
    """`python -m tasks.<stage>`: parse `argv` (`parser(command)`), then `run_stage`; as the process's own entry
    (its main module holds `command`), a stage that finished skips the teardown (module docstring)."""
    from pfactory.runtime.quick_exit import for_program

    values = vars(parser(command).parse_args(argv))
    quick = for_program(command)  # first: its handler runs after those of whatever the stage imports
    run_stage(command, values.pop("params"), values.pop("set_param"), **values)
    if quick is not None:
        quick.finished()


def run_stage(command: Command, params_file: Path | None, overrides: list[str] | None, **options: Any) -> None:
    """Load params, run `command.body(params, options)` and print the metrics it returns (nothing for None):
    what both `python -m tasks.<stage>` and `factory <stage>` do once their arguments are parsed.
    Params: `command.sections()` (name -> model, a view for another stage's section), besides `paths`;
    nothing else of params.yaml is read or imported. `params_file`: None = the
    project's params.yaml (`pfactory.runtime.project.params_path`). `options`: the declared options' values.

    An error a user can act on (`pfactory.runtime.failures.UserError`, a full disk, ...) prints `<stage>: <reason>`
    on stderr and exits with its code; a transient one exits 75 unless it is a usage error (2); any other
    exception propagates (exit 1). Every verdict is also written as the stage's outcome JSON."""
    from pfactory.config.params_file import ParamsError, anchored, load_sections
    from pfactory.runtime import failures as fl
    from pfactory.runtime.project import configure_environment, params_path

    stage = command.stage
    fl.start_outcome(stage)
    path = params_path(params_file)
    try:
        configure_environment()
        try:  # paths in params.yaml are relative to its folder (the project root), wherever this runs
            params = anchored(load_sections(path, overrides or [], dict(command.sections())), path.parent)
        except ParamsError as e:
            fl.write_outcome(fl.stage_outcome(stage, e))
            print(e, file=sys.stderr)
            sys.exit(e.exit_code)
        t0 = time.perf_counter()
        metrics = command.body(params, SimpleNamespace(**options))
    except Exception as e:
        if not _explained(stage, e):
            raise
    record_stage_time(stage, time.perf_counter() - t0)
    if metrics is not None:
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    fl.write_outcome(fl.Outcome(stage, fl.EXIT_OK, log=os.environ.get(fl.STAGE_LOG_ENV)))
