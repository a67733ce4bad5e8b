"""Errors a user can act on, as data; a stage's outcome as a small JSON file the flow reads.

`UserError` is the base of every error that says what is wrong with an input, a parameter, an output path
or a service. It carries its exit code, its reason (the message) and a hint (what to try) as class data,
the way pip's `DiagnosticPipError` and click's `ClickException` do: nothing downstream parses its text.
Each error class sets `exit_code` (and a `hint` where there is one to give) where it is defined.

`explain(exc)` -> `Explained(reason, code, hint)` for a `UserError`, a full disk or an OSError naming its
file; None for anything else (a bug: keep the traceback). The `factory` commands and the stage entry
(`python -m tasks.<stage>`) print that reason and exit with that code.

`stage_outcome(stage, exc)` is the verdict of a stage process, written by `tasks._stage` to
`$PFACTORY_OUTCOME_DIR/<stage>.json` (the run workspace's `logs/outcomes/`, set by `flows.workspace`):
`{"stage", "code", "error", "reason", "hint", "where", "log", "transient"}`. It is written once with
`code: null` when the stage starts and replaced by the verdict when it ends, so a file still saying null
after the process ended means the process was killed from outside (SIGKILL: the OOM killer, a
preemption); `<stage>.fault` beside it holds Python's `faulthandler` dump of a crash (SIGSEGV, SIGABRT).

Exit codes (docs/OPERATIONS.md): 0 done; 1 the command ran and found a problem (bad data, a diverged run,
a full disk, a bug: a retry fails the same way); 2 bad usage, parameters or inputs (nothing ran); 75 a
transient failure (EX_TEMPFAIL): a lost connection or Dask worker, a locked database, a tracking server
that does not answer -- worth a retry; 77 a team's MLflow server refused the user (401 / 403, or a
permission the factory checked first: pfactory/team), or its Prefect server answered 401 (no or a
wrong PREFECT_API_AUTH_STRING); nothing was changed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TRANSIENT = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
EXIT_NOPERM = 77  # sysexits.h EX_NOPERM: a team's server refused the user (MLflow 401 / 403, Prefect 401)
OUTCOME_ENV = "PFACTORY_OUTCOME_DIR"
STAGE_LOG_ENV = "PFACTORY_STAGE_LOG"  # the stage's log file as the flow writes it (recorded in the outcome)


class UserError(Exception):
    """An error a user can act on: its message names the file / key / service and what was expected.

    Class data (override in a subclass): `exit_code` (1 ran and failed, 2 bad usage or input, 75 transient)
    and `hint`, one line of what to try (empty: the exit code's generic hint)."""

    exit_code: int = EXIT_FAILED
    hint: str = ""

    @property
    def reason(self) -> str:
        """What is wrong: the message (a first line, possibly indented detail lines under it)."""
        return str(self)


class UsageError(UserError, ValueError):
    """Bad command-line arguments of a stage (argparse's complaint)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class Explained:
    """The one-line form of an error a user can act on."""

    reason: str
    code: int
    hint: str = ""


def chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then its `__cause__` / `__context__` chain (the one walker of exception chains; cycle-safe)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _transient_types() -> tuple[type[BaseException], ...]:
    """Exceptions that say "the world hiccupped", not "this input or code is wrong". A library's classes
    are imported only when the library is loaded: an exception of one implies its module is."""
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError]  # refused / reset / broken pipe
    if "distributed" in sys.modules:  # a Dask worker died under a task (OOM killer, a lost node)
        from distributed import KilledWorker
        from distributed.comm.core import CommClosedError

        kinds += [KilledWorker, CommClosedError]
    if "requests" in sys.modules:  # MLflow's REST client (a tracking server restarting)
        import requests

        kinds += [requests.ConnectionError, requests.Timeout]
    if "urllib3" in sys.modules:
        from urllib3.exceptions import MaxRetryError, NewConnectionError

        kinds += [MaxRetryError, NewConnectionError]
    if "httpx" in sys.modules:  # Prefect's client
        import httpx

        kinds += [httpx.ConnectError, httpx.TimeoutException]
    return tuple(kinds)


_TRANSIENT_MESSAGES = ("database is locked",)  # sqlite under concurrent writers (sqlalchemy OperationalError)


def is_transient(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception in its chain, is a transient failure (a retry may succeed)."""
    kinds = _transient_types()
    return any(isinstance(e, kinds) or any(m in str(e) for m in _TRANSIENT_MESSAGES) for e in chain(exc))


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = (
    "No space left on device",
    "Disk quota exceeded",
    "[errno 28]",
    "[Errno 28]",
    "database or disk is full",  # sqlite (the MLflow store)
)


def is_disk_full(exc: BaseException) -> bool:
    """An OSError ENOSPC/EDQUOT (or a library's error saying so) anywhere in `exc`'s chain."""
    for e in chain(exc):
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
    path = next((e.filename for e in chain(exc) if isinstance(e, OSError) and e.filename), None)
    if path is None and any("database or disk is full" in str(e) for e in chain(exc)):
        path = _tracking_store()  # sqlite says "full" without a file name: the MLflow store's file
    where = f"writing {path}" if path else f"while writing (the file system of {Path.cwd()})"
    return (
        f"disk full {where} ({_free(path)} free there): the output was not published and nothing already "
        "there was replaced; free some space or point the output elsewhere"
    )


def explain(exc: BaseException) -> Explained | None:
    """The reason, exit code and hint of an error the user can act on, else None (module docstring)."""
    if isinstance(exc, UserError):
        return Explained(exc.reason, exc.exit_code, exc.hint)
    if (refused := mlflow_refusal(exc) or prefect_refusal(exc)) is not None:  # a 401 / 403 not checked first
        return refused
    if is_disk_full(exc):
        return Explained(disk_full_message(exc), EXIT_FAILED)
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        kind = {
            errno.ENOENT: "missing",
            errno.EISDIR: "is a directory, expected a file",
            errno.ENOTDIR: "is not a directory",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
            errno.EROFS: "read-only file system",
        }.get(exc.errno or 0, exc.strerror)
        return Explained(f"{exc.filename}: {kind}", EXIT_FAILED)
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError) and str(exc):
        return Explained(str(exc), EXIT_USAGE)  # our own messages (read_config, ...): they name the path
    return None


# ----------------------------------------------------------------------------------------------------------
# A stage's outcome


@dataclass
class Outcome:
    """A stage process's verdict (module docstring). `code` None: started, no verdict (yet)."""

    stage: str
    code: int | None
    error: str | None = None  # the exception's type name
    reason: list[str] = field(default_factory=list)  # the message's lines
    hint: str = ""
    where: str | None = None  # `at FILE:LINE in FUNC`: the innermost project frame of a bug
    log: str | None = None
    transient: bool = False

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Outcome:
        return cls(**{k: doc.get(k) for k in cls.__dataclass_fields__ if k in doc})


def _where(exc: BaseException, root: Path) -> str | None:
    """`at FILE:LINE in FUNC` of the innermost traceback frame in the project (`root`), not a library's."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        f = Path(frame.filename)
        if "site-packages" in f.parts or "dist-packages" in f.parts or frame.filename.startswith("<"):
            continue
        try:
            rel = f.resolve().relative_to(root.resolve())
        except ValueError:
            continue
        return f"at {rel}:{frame.lineno} in {frame.name}"
    return None


def stage_outcome(stage: str, exc: BaseException | None, root: Path | None = None) -> Outcome:
    """The verdict of a stage that raised `exc` (None: it finished). A usage error (2) stays one; else a
    transient failure anywhere in the chain is 75; else an error a user can act on has its own code; else a
    bug: 1, its `Type: message` and where it happened (`root`: the project, default the cwd)."""
    log = os.environ.get(STAGE_LOG_ENV)
    if exc is None:
        return Outcome(stage, EXIT_OK, log=log)
    known = explain(exc)
    error = type(exc).__name__
    if (known is None or known.code != EXIT_USAGE) and is_transient(exc):
        reason = known.reason if known is not None else f"{error}: {exc}"
        return Outcome(stage, EXIT_TRANSIENT, error, reason.splitlines(), known.hint if known else "",
                       log=log, transient=True)  # fmt: skip
    if known is not None:
        return Outcome(stage, known.code, error, known.reason.splitlines(), known.hint, log=log)
    reason = [f"{error}: {ln}" if i == 0 else ln for i, ln in enumerate(str(exc).splitlines() or [""])]
    return Outcome(stage, EXIT_FAILED, error, reason, where=_where(exc, root or Path.cwd()), log=log)


def outcome_path(folder: str | Path, stage: str) -> Path:
    return Path(folder) / f"{stage}.json"


def write_outcome(outcome: Outcome) -> None:
    """`$PFACTORY_OUTCOME_DIR/<stage>.json`, atomically (temp + rename); no-op when the variable is unset."""
    folder = os.environ.get(OUTCOME_ENV)
    if not folder:
        return
    path = outcome_path(folder, outcome.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(outcome), indent=1, sort_keys=True))
    os.replace(tmp, path)


_FAULT_FILE: list[TextIO] = []  # kept open for the process' lifetime (faulthandler writes to its fd)


def start_outcome(stage: str) -> None:
    """Record that `stage` started (`code: null`) and route a crash's faulthandler dump to `<stage>.fault`."""
    folder = os.environ.get(OUTCOME_ENV)
    if not folder:
        return
    import faulthandler

    write_outcome(Outcome(stage, None, log=os.environ.get(STAGE_LOG_ENV)))
    fault = Path(folder) / f"{stage}.fault"
    _FAULT_FILE.append(open(fault, "w"))  # noqa: SIM115 -- must outlive this call
    faulthandler.enable(_FAULT_FILE[-1])


def read_outcome(folder: str | Path, stage: str) -> Outcome | None:
    """The outcome a stage wrote in `folder` (None: it never started), a crash's dump as its reason."""
    path = outcome_path(folder, stage)
    if not path.is_file():
        return None
    outcome = Outcome.from_json(json.loads(path.read_text()))
    fault = Path(folder) / f"{stage}.fault"
    dump = fault.read_text().strip().splitlines() if fault.is_file() else []
    if outcome.code is None and dump:  # "Fatal Python error: Segmentation fault": a crash, a bug
        outcome.code, outcome.error, outcome.reason = EXIT_FAILED, "crash", dump[:1]
    return outcome


def clear_outcome(folder: str | Path, stage: str) -> None:
    """Remove a stage's outcome and fault dump before an attempt (an earlier attempt's must not be read)."""
    for p in (outcome_path(folder, stage), Path(folder) / f"{stage}.fault"):
        p.unlink(missing_ok=True)


def unauthenticated_message(uri: str, user: str | None) -> str:
    """The one line for an MLflow 401 (the URI without its user info: no password in it)."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    where = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}" if parts.netloc else uri
    who = f"user {user!r} and its password" if user else "no MLFLOW_TRACKING_USERNAME / PASSWORD set"
    return (
        f"the MLflow server {where} refused the request: 401 not authenticated ({who}); export "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of your team account (an admin creates it: "
        "factory team user add)"
    )


def mlflow_refusal(exc: BaseException) -> Explained | None:
    """Exit 77 and one line for an MLflow 401 / 403 anywhere in `exc`'s chain, by MLflow's own error code
    (`MlflowException.error_code`), else None. MLflow is imported only if it is already loaded: an
    exception of it implies it is."""
    if "mlflow" not in sys.modules:
        return None
    from mlflow.exceptions import MlflowException

    for e in chain(exc):
        code = getattr(e, "error_code", None) if isinstance(e, MlflowException) else None
        if code == "UNAUTHENTICATED":
            uri, user = os.environ.get("MLFLOW_TRACKING_URI", ""), os.environ.get("MLFLOW_TRACKING_USERNAME")
            return Explained(unauthenticated_message(uri, user), EXIT_NOPERM)
        if code == "PERMISSION_DENIED":
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")
            return Explained(
                f"the MLflow server refused user {user!r}: 403 permission denied ({e.message})",
                EXIT_NOPERM,
                "an admin grants permissions: factory team user add NAME --role maintainer|engineer",
            )
    return None


def prefect_refusal(exc: BaseException) -> Explained | None:
    """Exit 77 and one line for a Prefect server's 401 anywhere in `exc`'s chain (Prefect's own
    `PrefectHTTPStatusError`), else None. Prefect is imported only if it is already loaded."""
    if "prefect.exceptions" not in sys.modules:
        return None
    from prefect.exceptions import PrefectHTTPStatusError

    for e in chain(exc):
        if isinstance(e, PrefectHTTPStatusError) and e.response.status_code == 401:
            url = str(e.request.url).split("/api/", 1)[0] + "/api"
            sent = "PREFECT_API_AUTH_STRING" in os.environ
            why = (
                "PREFECT_API_AUTH_STRING differs from the server's" if sent else "no PREFECT_API_AUTH_STRING"
            )
            return Explained(
                f"the Prefect server {url} refused the request: 401 not authenticated ({why}); export "
                "PREFECT_API_AUTH_STRING of your team (the admin has it: the lines `factory team up` prints)",
                EXIT_NOPERM,
            )
    return None
