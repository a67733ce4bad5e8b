"""What a training run reports: MLflow logging on the main process (resuming a killed run's MLflow
run, so one run has one curve) and the rich progress bar on a terminal."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any


class Tracker:
    """MLflow logging on the main process (a no-op elsewhere or with `track=False`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.mlflow: Any = None
        self.run_id: str | None = None
        self._stack = contextlib.ExitStack()

    def start(self, params: dict[str, Any], run_id: str | None) -> None:
        if not self.enabled:
            return
        import mlflow

        from pfactory.runtime.project import configure_environment
        from pfactory.tracking.runs import process_tags, stage_run

        self.mlflow = mlflow
        if run_id is not None:  # resume the killed run's MLflow run: one run, one curve
            configure_environment()
            mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
            try:
                self._stack.enter_context(mlflow.start_run(run_id=run_id))
                mlflow.set_tags(process_tags())  # this process owns it now (`reap_orphan_runs`)
                self.run_id = run_id
                return
            except Exception as e:  # the run may live in another tracking store
                print(
                    f"train: could not reopen MLflow run {run_id} ({e}); starting a new one", file=sys.stderr
                )
        run = self._stack.enter_context(stage_run("train", params))
        self.run_id = run.info.run_id

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.enabled and values:
            self.mlflow.log_metrics({k: float(v) for k, v in values.items()}, step=step)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if self.enabled:
            self.mlflow.log_artifact(str(path), artifact_path=folder)

    def close(self, error: BaseException | None = None) -> None:
        """End the run: FINISHED, or FAILED when `error` is given (the error keeps propagating)."""
        if error is None:
            self._stack.close()
        else:
            with contextlib.suppress(BaseException):
                self._stack.__exit__(type(error), error, error.__traceback__)


def progress_bar(enabled: bool, total: int, start: int):
    """A rich progress bar (step, loss, samples/s, ETA) on stderr; a null context when disabled."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.4f}  {task.fields[sps]:.1f} samples/s  lr {task.fields[lr]:.2e}"
        ),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    progress.add_task("train", total=total, completed=start, loss=float("nan"), sps=0.0, lr=0.0)
    return progress
