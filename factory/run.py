"""`factory run` end to end: services up, the flow, the summary or one failure screen, the exit code.

1. the libraries' console logging goes to a log file (`flows.runlog`): the terminal gets only
   what is written for the user;
2. the local Prefect API and MLflow store start explicitly (`flows.startup`): a first start says what
   it is doing, a failure says what to try (exit 3);
3. the flow runs (`flows.pipeline.pipeline`) with live progress (`flows.console`);
4. a finished run prints its summary (`factory.summary`) on stdout; a failed one prints one screen on
   stderr (`flows.failure`) and returns its exit code (0 / 1 / 2 / 3 / 75, documented there); one stopped by
   SIGTERM (`flows.pipeline.RunInterrupted`: the running stage was stopped, train checkpointed first) prints
   one line saying how to resume it and returns 143.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

STATE_LOGS = Path("artifacts") / ".state" / "logs"  # a run's log when it ends before its workspace exists


def run_command(
    overrides: list[str],
    name: str | None = None,
    stages: list[str] | None = None,
    json_out: bool = False,
    started: float | None = None,
    checkout: bool = True,
    resume: str | None = None,
) -> int:
    """Run the pipeline as `factory run` does; returns the exit code. `started`: the command's start
    (`time.perf_counter()`), for the summary's command-level orchestration share. `checkout`: bring the run's
    outputs to the project's paths on success (`flows.experiment.checkout_outputs`). `resume`: continue that
    interrupted run ("" the newest; `flows.pipeline.pipeline`)."""
    from pfactory.runtime.project import configure_environment

    t0 = started if started is not None else time.perf_counter()
    root = configure_environment()
    from flows.startup import boot_prefect_early

    boot_prefect_early()  # Prefect's API process boots on the other core while this one imports (flows.startup)
    # Import what configures logging (Prefect's console handler, MLflow's) before capturing it.
    import mlflow  # noqa: F401

    from flows import runlog
    from flows.console import RunConsole, use
    from flows.failure import (
        MAX_LINES,
        Failure,
        ServiceFailed,
        failure_lines,
        flow_failure,
        service_failure,
        stage_failure,
    )
    from flows.pipeline import RunInterrupted, pipeline
    from flows.startup import start_services
    from flows.workspace import CacheNotWritable, ResumeError, StageFailed, check_cache, locate_run

    console = RunConsole()
    use(console)
    failure = None
    result: dict[str, Any] | None = None
    try:
        with runlog.capture() as log:
            try:
                check_cache(root)  # a read-only shared cache: said before services start or anything runs
                if resume is not None:  # a run to continue (here, or on the DVC remote), found before services start
                    locate_run(root, resume or None)
                startup = start_services(console, root)
                flow = pipeline.with_options(flow_run_name=name) if name else pipeline
                result = flow(overrides=overrides, name=name, stages=stages, checkout=checkout, resume=resume)
                result["startup"] = startup
            except RunInterrupted as e:
                console.failure([("bold red", f"✗ factory run {e}")])  # one line: how to resume
                return e.exit_code
            except ResumeError as e:
                console.failure([("bold red", f"✗ factory run {e}")])
                return 2
            except StageFailed as e:
                failure = stage_failure(e, e.log.parent.parent, prefect_log=log.path)
            except CacheNotWritable as e:
                failure = Failure(
                    title="factory run cannot store outputs in the DVC cache (nothing ran)",
                    reason=[str(e)],
                    logs=[],
                    hints=[
                        "a team's shared cache: the cache's group needs write (chgrp -R GROUP DIR; chmod -R g+w "
                        "DIR) and `dvc config cache.shared group` in every clone",
                        "or point this clone at a writable cache: dvc cache dir --local PATH",
                    ],
                    exit_code=2,
                )
            except ServiceFailed as e:
                logging.getLogger("pfactory.run").error("service failed", exc_info=e)
                failure = service_failure(e, log.spill(root / STATE_LOGS))
            except Exception as e:
                logging.getLogger("pfactory.run").error("the flow failed", exc_info=e)
                failure = flow_failure(e, log.spill(root / STATE_LOGS))
    finally:
        use(None)
    if failure is not None:
        budget = MAX_LINES - console.printed  # the whole run's output stays within one screen
        console.failure(failure_lines(failure, console.width, max_lines=budget))
        return failure.exit_code
    assert result is not None
    if json_out:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        from rich.console import Console

        from factory.summary import print_summary

        print_summary(result, wall_s=time.perf_counter() - t0, console=Console())
    return 0
