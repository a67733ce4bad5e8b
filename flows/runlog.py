"""Keeps the libraries' own console output of a `factory run` off the terminal, in a log file.

Prefect logs a failed task and a failed flow run with a full traceback each, MLflow announces its database
migrations, Python warnings print where they fire: none of that is for the person at the terminal, who
gets progress lines and, on failure, one screen (`flows.failure`). `capture()` moves every console
handler of those loggers (and `warnings`) onto one `RunLog` handler for the duration of the command:

    buffered in memory until the flow has made the run workspace, then   <workspace>/logs/prefect.log
    if the run ends before that (a server would not start)               artifacts/.state/logs/<time>.log

`attach(path)` is what the flow calls once it knows the workspace; without an active capture (a flow run by
a deployment's worker, whose operator wants Prefect's normal logging) it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

# Loggers that print to the console by themselves: Prefect's console handler sits on the root logger;
# uvicorn/fastapi (the ephemeral API) and MLflow's own loggers do not propagate.
LOGGERS = ("", "prefect._internal", "uvicorn", "fastapi", "mlflow", "alembic", "sqlalchemy.engine", "huey")
FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s"

_active: RunLog | None = None


class RunLog(logging.Handler):
    """A handler that buffers formatted records until `attach(path)`, then appends them to `path`."""

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        self.path: Path | None = None
        self._buffer: list[str] = []
        self._file: IO[str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a bad record must not become a terminal traceback either
            line = f"(unformattable record from {record.name}: {record.msg!r})"
        with self.lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
            else:
                self._buffer.append(line)

    def attach(self, path: str | Path) -> Path:
        """Write what was buffered to `path` and append every later record there."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            if self._file is not None:
                self._file.close()
            self._file = open(path, "a")  # noqa: SIM115 (held open for the run; closed in `close`)
            self._file.writelines(line + "\n" for line in self._buffer)
            self._file.flush()
            self._buffer.clear()
            self.path = path
        return path

    def spill(self, folder: str | Path) -> Path:
        """The log file: the attached one, else the buffer written to `folder/<time>.log`."""
        if self.path is None:
            self.attach(Path(folder) / f"run-{time.strftime('%Y%m%dT%H%M%S')}.log")
        assert self.path is not None
        return self.path

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


def _is_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    if stream is None:
        return False
    return stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__) or type(stream).__name__ in (
        "MlflowLoggingStream",
    )


@contextlib.contextmanager
def capture() -> Iterator[RunLog]:
    """Route the console handlers of `LOGGERS` (and Python warnings) to one `RunLog` while inside."""
    global _active
    handler = RunLog()
    saved: list[tuple[logging.Logger, list[logging.Handler]]] = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers)))
        kept = [h for h in logger.handlers if not _is_console(h)]
        if name == "" or len(kept) < len(logger.handlers):
            logger.handlers = [*kept, handler]
    logging.captureWarnings(True)
    previous, _active = _active, handler
    try:
        yield handler
    finally:
        _active = previous
        logging.captureWarnings(False)
        for logger, handlers in saved:
            logger.handlers = handlers
        handler.close()


def attach(path: str | Path) -> Path | None:
    """Send the active capture's records to `path` (the flow calls this with `<workspace>/logs/prefect.log`);
    None, and nothing happens, without an active capture."""
    return _active.attach(path) if _active is not None else None
