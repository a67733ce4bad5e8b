"""What `factory run` prints when it fails: one screen (at most `MAX_LINES` lines) and a meaningful exit code.

In:  a `StageFailed` (a stage's `dvc repro` exited non-zero: the outcome the stage process wrote -- exit code,
     error type, reason, hint, as data (`pfactory.runtime.failures.Outcome`) --, its log, attempts), a
     `ServiceFailed` (the local Prefect API or the MLflow store would not start), or any other exception.
Out: a `Failure` — title, reason (the error's own message, not a traceback), the log paths as the user can
     open them from their current directory, what to try (the error class' hint), the exit code — and
     `failure_lines(failure, width)`, the screen itself, wrapped to the terminal width. Nothing here parses the
     text DVC prints (a DVC release that words its console differently changes nothing on this screen); only
     when the stage never started is DVC's own last line shown, as it is.

Exit codes of `factory run` (docs/OPERATIONS.md, "When a run fails"):
    0   the run finished (a refused promotion is a result, not a failure)
    1   a stage failed deterministically (a gate, bad data, a bug): retrying would fail the same way
    2   bad usage or parameters: refused before anything ran, or a stage refused its inputs
    3   a local service did not start or is unreachable (Prefect API, MLflow tracking store)
    75  a transient failure (a lost worker or connection, a killed process) that outlived its retries
    130 interrupted (Ctrl-C)
    143 stopped by SIGTERM (preemption): the running stage stopped (train checkpointed first); one line says
        `factory run --resume RUN_ID`
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from flows.workspace import EXIT_INTERRUPTED, StageFailed
from pfactory.runtime.failures import (
    EXIT_FAILED,
    EXIT_NOPERM,
    EXIT_TRANSIENT,
    EXIT_USAGE,
    chain,
    explain,
    is_transient,
)

EXIT_STAGE_FAILED = EXIT_FAILED
EXIT_SERVICE = 3
MAX_LINES = 15  # the whole output of a failed run (progress lines before the screen included)
MIN_LINES = 7  # the failure screen itself, however much was printed before it
LOG_NOTE = "   "  # separates a log path from its note ("(Prefect's: prefect.log beside it)")
MAX_REASON_LINES = 4
MAX_REASON_CHARS = 400  # per reason line; the full text is in the log

# A path-like token: at least one "/", not part of a URL ("sqlite:///...", "http://...").
_PATH_TOKEN = re.compile(r"(?<![\w./:~-])(/?(?:[\w.+-]+/)+[\w.+-]+)")


def stage_reason(e: StageFailed) -> list[str]:
    """The few lines that say why a stage failed: its outcome's reason (the error's own message) and, for a
    bug, `at FILE:LINE in FUNC` of the innermost project frame; a killed stage says so; when the stage never
    started (DVC failed around it), DVC's last line, shown as it is. At most `MAX_REASON_LINES` lines."""
    o = e.outcome
    if o is None:
        last = [ln.rstrip() for ln in e.output.splitlines() if ln.strip() and not ln.startswith("$ dvc ")]
        return [last[-1][:MAX_REASON_CHARS] if last else "no message (see the log)"]
    if e.killed:
        return ["the stage process was killed before it could report (SIGKILL or SIGTERM)"]
    block = [ln.rstrip() for ln in o.reason if ln.strip()] or [f"exit {o.code}, no message (see the log)"]
    if len(block) > MAX_REASON_LINES:
        more = len(block) - (MAX_REASON_LINES - 1)
        block = [*block[: MAX_REASON_LINES - 1], f"  ... ({more} more lines in the log)"]
    out = [ln if len(ln) <= MAX_REASON_CHARS else ln[: MAX_REASON_CHARS - 1] + "…" for ln in block]
    return [*out, o.where] if o.where else out


def openable(path: str | Path, cwd: str | Path | None = None) -> str:
    """`path` as the user can open it from `cwd` (default: the current directory): relative when it is
    under `cwd`, else absolute ("" stays "": no path)."""
    if not str(path):
        return ""
    p = Path(path).absolute()
    here = Path(cwd or os.getcwd()).absolute()
    try:
        return str(p.relative_to(here))
    except ValueError:
        return str(p)


def rewrite_paths(text: str, base: Path, cwd: str | Path | None = None) -> str:
    """Paths in a stage's message made openable from `cwd`: a relative path that exists under `base`
    (the run workspace, the stage's own cwd) and an absolute one are shown the way `openable` does."""

    def fix(m: re.Match[str]) -> str:
        token = m.group(1)
        p = Path(token)
        if not p.is_absolute():
            p = Path(base) / p
        return openable(p, cwd) if p.exists() else token

    return _PATH_TOKEN.sub(fix, text)


@dataclass
class Failure:
    """One failure screen: what failed, why, where the logs are, what to try, the exit code."""

    title: str
    reason: list[str]
    logs: list[tuple[str, str]] = field(default_factory=list)  # (label, openable path)
    hints: list[str] = field(default_factory=list)
    exit_code: int = EXIT_STAGE_FAILED


def _stage_hints(e: StageFailed, ws: str) -> list[str]:
    hints: list[str] = []
    if e.interrupted:  # the workspace keeps the finished stages and train's checkpoint
        hints.append(f"resume it where it stopped: factory run --resume {Path(ws).name}")
    if e.killed:
        hints.append(
            "the stage was killed (SIGKILL or SIGTERM): usually the kernel's out-of-memory killer (see `dmesg`); "
            "free memory or lower the stage's batch size / workers"
        )
    elif e.status == EXIT_TRANSIENT:
        hints.append(
            "a transient failure (a lost worker or connection): check the machine and any server named above"
        )
    elif e.status == EXIT_USAGE:
        hints.append(
            "the stage refused a parameter or input named above: `factory params` shows the resolved values"
        )
    if e.outcome is not None and e.outcome.hint:
        hints.append(e.outcome.hint)  # the error's own hint (its class says what to try)
    hints.append(
        f"fix it and `factory run` again (finished stages are restored from DVC's run-cache), or replay "
        f"this stage alone: cd {ws} && dvc repro {e.stage}"
    )
    return hints


def stage_failure(
    e: StageFailed,
    workspace: Path,
    prefect_log: Path | None = None,
    cwd: str | Path | None = None,
) -> Failure:
    """The screen for a failed stage, from its outcome (`e.outcome`, the JSON the stage wrote), never from
    the text DVC printed around it."""
    reason = stage_reason(e)
    # Paths in the message open from the user's directory; the `at FILE:LINE` location stays as it is:
    # the project's own source file (the workspace holds a copy of it).
    reason = [ln if ln.startswith("at ") else rewrite_paths(ln, workspace, cwd) for ln in reason]
    how = "killed" if e.killed else f"exit {e.status}" if e.status is not None else "DVC failed around it"
    if e.attempts > 1:
        retried = f"failed {e.attempts} times (transient, retried)"
    elif e.transient:
        retried = "transient, no retry left"
    else:
        retried = "not retried (a deterministic error)"
    shown = openable(e.log, cwd)
    if prefect_log is not None:
        beside = Path(prefect_log).parent == Path(e.log).parent
        shown += (
            f"{LOG_NOTE}(Prefect's: {Path(prefect_log).name if beside else openable(prefect_log, cwd)}"
            + (" beside it)" if beside else ")")
        )
    if e.status == EXIT_INTERRUPTED:  # preempted (SIGTERM) after checkpointing: 143, as the stage said
        code = EXIT_INTERRUPTED
    elif e.transient:
        code = EXIT_TRANSIENT
    elif e.status in (EXIT_USAGE, EXIT_NOPERM):  # bad usage (2); a team server refused the user (77)
        code = e.status
    else:
        code = EXIT_STAGE_FAILED
    return Failure(
        title=f"factory run failed at stage {e.stage} ({e.index} of {e.total}): {how}, {retried}",
        reason=reason,
        logs=[("log", shown)],
        hints=_stage_hints(e, openable(workspace, cwd)),
        exit_code=code,
    )


class ServiceFailed(RuntimeError):
    """A local service the run needs did not start or is unreachable (`flows.startup`)."""

    def __init__(self, service: str, reason: list[str], hints: list[str]) -> None:
        super().__init__(f"{service}: " + " ".join(reason))
        self.service = service
        self.reason = reason
        self.hints = hints


def service_failure(e: ServiceFailed, log: Path | None, cwd: str | Path | None = None) -> Failure:
    return Failure(
        title=f"factory run could not start: {e.service}",
        reason=e.reason,
        logs=[("log", openable(log, cwd))] if log is not None else [],
        hints=e.hints,
        exit_code=EXIT_SERVICE,
    )


def _connection_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(Prefect's, MLflow's) connection errors: httpx's, and requests' / urllib3's (loaded ones only: an
    exception of a class implies its module is loaded)."""
    prefect: list[type[BaseException]] = []
    mlflow: list[type[BaseException]] = []
    if "httpx" in sys.modules:
        import httpx

        prefect += [httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.RemoteProtocolError]
    if "requests" in sys.modules:
        import requests

        mlflow += [requests.ConnectionError, requests.ConnectTimeout]
    if "urllib3" in sys.modules:
        from urllib3.exceptions import MaxRetryError, NewConnectionError

        mlflow += [MaxRetryError, NewConnectionError]
    return tuple(prefect), tuple(mlflow)


def _lost_server(e: BaseException) -> tuple[str, str] | None:
    """(which, URL) of the server that went away while the flow ran, when `e` (or its chain) is a connection
    error to a configured Prefect server (`PREFECT_API_URL`) or MLflow tracking server (an http(s)
    `MLFLOW_TRACKING_URI`): the stages' own work is done or failed on its own; the flow's records are not."""
    from pfactory.tracking.runs import redact_uri

    mlflow_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    prefect_errors, mlflow_errors = _connection_errors()
    mlflow_exc = sys.modules["mlflow.exceptions"].MlflowException if "mlflow.exceptions" in sys.modules else ()
    for exc in chain(e):
        if os.environ.get("PREFECT_API_URL") and isinstance(exc, prefect_errors):
            return "Prefect server", os.environ["PREFECT_API_URL"]
        if mlflow_uri.startswith(("http://", "https://")) and (
            isinstance(exc, mlflow_errors)
            # MLflow wraps requests' retry error into its own exception, its text the only trace of it
            or (isinstance(exc, mlflow_exc) and "Max retries exceeded" in str(exc))
        ):
            return "MLflow tracking server", redact_uri(mlflow_uri)
    return None


def flow_failure(e: BaseException, log: Path | None, cwd: str | Path | None = None) -> Failure:
    """Anything else that escaped the flow (outside the stages): its last line, the traceback in the log."""
    text = str(e).strip().splitlines()
    reason = [f"{type(e).__name__}: {text[-1] if text else ''}"]
    transient = is_transient(e)
    lost = _lost_server(e)
    if lost is not None:
        which, url = lost
        env = "PREFECT_API_URL" if which.startswith("Prefect") else "MLFLOW_TRACKING_URI"
        return Failure(
            title=f"factory run lost the {which} at {url} (a transient failure: worth another try)",
            reason=[reason[0][:MAX_REASON_CHARS]],
            logs=[("traceback", openable(log, cwd))] if log is not None else [],
            hints=[
                f"bring the {which} back (or unset {env} for a local one), then run again:",
                "the stages that finished are restored from DVC's run-cache, not recomputed",
            ],
            exit_code=EXIT_TRANSIENT,
        )
    known = explain(e)
    if known is not None:  # an error the user can act on (e.g. a team server's 401 / 403: exit 77), as data
        return Failure(
            title="factory run stopped outside the stages (nothing more ran)",
            reason=[known.reason.splitlines()[0][:MAX_REASON_CHARS]],
            logs=[("traceback", openable(log, cwd))] if log is not None else [],
            hints=[known.hint] if known.hint else [],
            exit_code=known.code,
        )
    return Failure(
        title="factory run failed in the flow, outside the stages"
        + (" (a transient failure: worth another try)" if transient else ""),
        reason=reason,
        logs=[("traceback", openable(log, cwd))] if log is not None else [],
        hints=["run again; if it repeats, report it with the log above"],
        exit_code=EXIT_TRANSIENT if transient else EXIT_STAGE_FAILED,
    )


def _rows(text: str, width: int) -> int:
    """Terminal rows of one printed line (a path longer than the width wraps in the terminal)."""
    return max(1, -(-len(text) // width))


def failure_lines(f: Failure, width: int = 100, max_lines: int = MAX_LINES) -> list[tuple[str, str]]:
    """The screen as `(style, text)` lines wrapped to `width` (paths are never split: they stay
    copyable), at most `max_lines` terminal rows: hints are dropped first, then middle reason lines,
    then the reason's wrapped rows after its first (marked " …"), when it would not fit (the log has
    everything); the title, the log paths and the exit line stay."""
    width = max(width, 40)
    max_lines = max(max_lines, MIN_LINES)

    def wrap(text: str, first: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=" " * len(first),
                             break_long_words=False, break_on_hyphens=False) or [first]  # fmt: skip

    def build(reason: list[str], hints: list[str], bare_logs: bool = False) -> list[tuple[str, str]]:
        out = [("bold red", ln) for ln in wrap(f.title, "✗ ")]
        for i, r in enumerate(reason):
            out += [("", ln) for ln in wrap(r.strip(), "reason: " if i == 0 else "        ")]
        for label, path in f.logs:
            path = path.split(LOG_NOTE)[0] if bare_logs else path  # the path without its note
            out += [("cyan", ln) for ln in wrap(path, f"{label + ':':<8}")]
        for i, h in enumerate(hints):
            out += [("", ln) for ln in wrap(h, "try:    " if i == 0 else "        ")]
        out.append(("dim", f"exit {f.exit_code} (exit codes: docs/OPERATIONS.md)"))
        return out

    def rows(lines: list[tuple[str, str]]) -> int:
        return sum(_rows(t, width) for _, t in lines)

    reason, hints = list(f.reason), list(f.hints)
    lines = build(reason, hints)
    while rows(lines) > max_lines and hints:
        hints.pop()
        lines = build(reason, hints)
    while rows(lines) > max_lines and len(reason) > 1:
        reason.pop(-2 if len(reason) > 2 else -1)
        lines = build(reason, hints)
    if rows(lines) > max_lines:
        lines = build(reason, hints, bare_logs=True)
    while (
        rows(lines) > max_lines
    ):  # the reason's last wrapped rows go next (its first stays; " …" marks the cut):
        cut = [i for i, (style, _) in enumerate(lines) if style == ""][1:]  # the log path is worth more
        if not cut:
            break
        for i in reversed(cut):
            del lines[i]
            if rows(lines) <= max_lines:
                break
        last = max(i for i, (style, _) in enumerate(lines) if style == "")  # the last reason row kept
        lines[last] = ("", lines[last][1].rstrip() + " …")
    while rows(lines) > max_lines and len(lines) > 2:
        lines.pop(-2)  # last resort: the exit line stays
    return lines
