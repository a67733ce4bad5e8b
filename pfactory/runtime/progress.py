"""Stage progress events: one JSON line per event, appended to the file `$PFACTORY_PROGRESS_FILE` names.

The stages run as separate processes under `dvc repro` (their stdout/stderr go to the stage log), so
the pipeline flow cannot see a progress bar they draw. Instead the flow sets `PFACTORY_PROGRESS_FILE`
(`<workspace>/logs/progress.jsonl`) and follows the file while a stage runs (`flows.console`). Without
the variable (a stage run by hand, `dvc repro` at the project root) `emit` does nothing.

One event (a JSON object per line, UTF-8):
    {"t": unix seconds, "stage": "train", "pid": 1234, ...fields}
Fields by stage (all optional; a reader shows what it gets):
    train     step, total, loss, samples_per_s        (one per step, at most every `MIN_INTERVAL_S`)
              phase: "validate"                        (validation between epochs)
    evaluate  kind ("optimized" | "reference"), done, total (frames)
    optimize  phase: what it is doing ("export ONNX", "parity vs PyTorch", ...)
Lines are written whole (one `write` of a line shorter than PIPE_BUF on an O_APPEND file), so a reader
sees complete lines or, at worst, a partial last line it keeps for the next read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PROGRESS_ENV = "PFACTORY_PROGRESS_FILE"
MIN_INTERVAL_S = 0.5  # per stage and kind of event: a 0.1 s train step must not write 10 lines a second

_last: dict[str, float] = {}  # stage -> time of its last counter event


def emit(stage: str, *, force: bool = False, **fields: Any) -> None:
    """Append one event for `stage` to `$PFACTORY_PROGRESS_FILE` (no-op when unset).

    Counter updates closer than `MIN_INTERVAL_S` to the previous one of the stage are dropped, unless
    `force` or the counter reached its total (`step` or `done` == `total`); `phase` events always go.
    Never raises: progress is advisory, a full disk or a removed workspace must not fail the stage.
    """
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    now = time.time()
    if "phase" not in fields:
        total = fields.get("total")
        last = total is not None and total in (fields.get("step"), fields.get("done"))
        if not (force or last) and now - _last.get(stage, 0.0) < MIN_INTERVAL_S:
            return
        _last[stage] = now
    line = json.dumps({"t": round(now, 3), "stage": stage, "pid": os.getpid(), **fields}, default=str)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


class ProgressReader:
    """Reads the events appended to one progress file since the last call (the flow's side)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """The complete new events, oldest first (a line that does not parse is skipped)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        events = []
        for raw in lines:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if isinstance(ev, dict) and "stage" in ev:
                events.append(ev)
        return events
