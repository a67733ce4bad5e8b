"""One line for the errors a user can act on, instead of a traceback.

`explain(exc)` returns `(message, exit code)` for an error that says what is wrong with an input, a
parameter, an output path or the machine (a full disk), and None for anything else (a bug: keep the
traceback). The `factory` commands and the stage entry (`python -m tasks.<stage>`) print that line and
exit with that code. Exit codes: 1 the command ran and found a problem (bad data, a diverged run, a
full disk), 2 bad usage, parameters or inputs (nothing ran), 75 a service that does not answer (retry),
77 a team's MLflow server refused the user (401 / 403, or a permission checked first: pfactory/team).

Classes are matched by module and name through the MRO, so nothing heavy (torch, pyarrow) is imported
to classify an error.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# (module, class name) -> exit code. Each of these carries a message naming the file/key and the expectation.
USER_ERRORS: dict[tuple[str, str], int] = {
    ("pfactory.fsutil", "OutputRefused"): 2,
    ("pfactory.config", "ParamsError"): 2,
    ("pfactory.model.io", "CheckpointError"): 2,
    ("pfactory.data.errors", "SchemaError"): 2,
    ("pfactory.sensors.errors", "DatasetError"): 1,
    ("pfactory.train.trainer", "TrainingDiverged"): 1,
    # A tracking server that does not answer: transient (75, EX_TEMPFAIL), worth a retry once it is back.
    ("pfactory.tracking", "TrackingUnavailable"): 75,
    # A team's MLflow server refused the user (pfactory/team): 77, EX_NOPERM; nothing was changed.
    ("pfactory.team.errors", "PermissionRefused"): 77,
    ("pfactory.team.errors", "NotAuthenticated"): 77,
    ("pfactory.team.errors", "TeamError"): 2,
}
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = (
    "No space left on device",
    "Disk quota exceeded",
    "[errno 28]",
    "[Errno 28]",
    "database or disk is full",  # sqlite (the MLflow store)
)


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def is_disk_full(exc: BaseException) -> bool:
    """An OSError ENOSPC/EDQUOT (or a library's error saying so) anywhere in `exc`'s chain."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        library = isinstance(e, OSError | RuntimeError) or type(e).__name__ in (
            "OperationalError",
            "MlflowException",
        )
        if library and any(t in str(e) for t in _DISK_FULL_TEXT):
            return True
    return False


def _free(path: str | os.PathLike[str] | None) -> str:
    p = Path(path) if path else Path.cwd()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "?"
    return f"{free / 2**20:.1f} MiB"


def _tracking_store() -> str | None:
    """The file of a `sqlite:///...` MLFLOW_TRACKING_URI, else None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme, sep, rest = uri.partition(":///")
    return rest if sep and scheme.startswith("sqlite") and rest else None


def disk_full_message(exc: BaseException) -> str:
    """`disk full writing <path> (<free> free there): nothing was replaced; free space or write elsewhere`."""
    path = None
    for e in _chain(exc):
        if isinstance(e, OSError) and e.filename:
            path = e.filename
            break
    if path is None and any("database or disk is full" in str(e) for e in _chain(exc)):
        path = _tracking_store()  # sqlite says "full" without a file name: the MLflow store's file
    where = f"writing {path}" if path else f"while writing (the file system of {Path.cwd()})"
    return (
        f"disk full {where} ({_free(path)} free there): the output was not published and nothing already "
        "there was replaced; free some space or point the output elsewhere"
    )


def explain(exc: BaseException) -> tuple[str, int] | None:
    """`(one-line message, exit code)` for an error the user can act on, else None (module docstring)."""
    for cls in type(exc).__mro__:
        code = USER_ERRORS.get((cls.__module__, cls.__name__))
        if code is not None:
            return str(exc), code
    from pfactory.team.errors import explain_mlflow

    if (auth := explain_mlflow(exc)) is not None:  # an MLflow 401 / 403 the factory did not check first
        return auth
    if is_disk_full(exc):
        return disk_full_message(exc), 1
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        kind = {
            errno.ENOENT: "missing",
            errno.EISDIR: "is a directory, expected a file",
            errno.ENOTDIR: "is not a directory",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
            errno.EROFS: "read-only file system",
        }.get(exc.errno or 0, exc.strerror)
        return f"{exc.filename}: {kind}", 1
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError) and str(exc):
        return str(exc), 2  # our own messages (read_config, ...): they name the path
    return None
