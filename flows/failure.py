"""What `factory run` prints when it fails: one screen (at most `MAX_LINES` lines) and a meaningful exit code.

In:  a `StageFailed` (a stage's `dvc repro` exited non-zero: its output, log, exit status, attempts), a
     `ServiceFailed` (the local Prefect API or the MLflow store would not start), or any other exception.
Out: a `Failure` — title, reason (the few meaningful lines of the stage's output, not a traceback), the log
     paths as the user can open them from their current directory, what to try, the exit code — and
     `failure_lines(failure, width)`, the screen itself, wrapped to the terminal width.

Exit codes of `factory run` (docs/OPERATIONS.md, "When a run fails"):
    0   the run finished (a refused promotion is a result, not a failure)
    1   a stage failed deterministically (a gate, bad data, a bug): retrying would fail the same way
    2   bad usage or parameters: refused before anything ran, or a stage refused its inputs
    3   a local service did not start or is unreachable (Prefect API, MLflow tracking store)
    75  a transient failure (a lost worker or connection, a killed process) that outlived its retries
    130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from tasks._stage import EXIT_TRANSIENT, EXIT_USAGE

EXIT_STAGE_FAILED = 1
EXIT_SERVICE = 3
MAX_LINES = 15  # the whole output of a failed run (progress lines before the screen included)
MIN_LINES = 7  # the failure screen itself, however much was printed before it
LOG_NOTE = "   "  # separates a log path from its note ("(Prefect's: prefect.log beside it)")
MAX_REASON_LINES = 4
MAX_REASON_CHARS = 400  # per reason line; the full text is in the log

# A stage killed by one of these was stopped from outside (the OOM killer, a preemption): worth a retry.
TRANSIENT_SIGNALS = (signal.SIGKILL, signal.SIGTERM)

# DVC's own lines around a stage's output (`dvc repro` 3.x): not the stage's reason.
_DVC_CHATTER = re.compile(
    r"^(\$ dvc |Running stage '|> |Stage '.*' (didn't change|is cached)|Verifying data sources|"
    r"(Updating|Generating) lock file|To track the changes with git|\s*git add |To enable auto staging|"
    r"\s*dvc config core\.autostage|Use `dvc push`|ERROR: failed to reproduce '.*': failed to run: )"
)
# Library log records and warnings interleaved with the stage's output (Dask, MLflow, Python warnings).
_NOISE = re.compile(
    r"^(\d{4}[-/]\d\d[-/]\d\d[ T][\d:.,]+ (- \S+ - )?(DEBUG|INFO|WARNING)\b|"
    r"\S+:\d+: \w*Warning: |\s+warnings\.warn\(|\w+: step \d+/\d+ )"
)
_EXITED = re.compile(r"failed to run: .*, exited with (-?\d+)\s*$", re.M)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# A path-like token: at least one "/", not part of a URL ("sqlite:///...", "http://...").
_PATH_TOKEN = re.compile(r"(?<![\w./:~-])(/?(?:[\w.+-]+/)+[\w.+-]+)")


def stage_exit_status(dvc_output: str) -> int | None:
    """The stage command's exit status from DVC's "failed to run: ..., exited with N" (None: DVC itself
    failed before or around the command). A negative N is the signal that killed it."""
    found = _EXITED.findall(dvc_output)
    return int(found[-1]) if found else None


def is_transient_exit(status: int | None, dvc_output: str = "") -> bool:
    """Whether a stage outcome is worth a retry: exit 75 (`tasks._stage.is_transient` said so),
    killed by SIGKILL / SIGTERM, or DVC unable to take its lock (another process held it)."""
    if status == EXIT_TRANSIENT:
        return True
    if status is not None and status < 0:
        return -status in TRANSIENT_SIGNALS
    return status is None and "Unable to acquire lock" in dvc_output


def last_attempt(output: str) -> str:
    """The output of the last `$ dvc ...` attempt in a stage log (retries append to the same log)."""
    marks = [m.start() for m in re.finditer(r"^\$ dvc ", output, re.M)]
    return output[marks[-1] :] if marks else output


def stage_reason(output: str, root: Path | None = None) -> list[str]:
    """The few lines that say why a stage failed, from its (last attempt's) output.

    A Python traceback gives its final exception text plus `at FILE:LINE in FUNC` of the innermost
    frame in the project's code (`root`: the run workspace; site-packages frames are skipped). Otherwise
    the last block the stage printed: a line and the indented lines under it (a parity failure's gates).
    DVC's chatter, library log records and progress lines are dropped; at most `MAX_REASON_LINES` lines.
    """
    lines = [ln.rstrip() for ln in last_attempt(output).splitlines()]
    status = stage_exit_status(output)
    kept = [ln for ln in lines if ln.strip() and not _DVC_CHATTER.match(ln) and not _NOISE.match(ln)]
    if not kept:
        return (
            [f"exit {status}, no message (see the log)"]
            if status is not None
            else ["no message (see the log)"]
        )
    where = None
    tb = max(
        (i for i, ln in enumerate(kept) if ln.startswith("Traceback (most recent call last)")), default=None
    )
    if tb is not None:
        frames = [i for i in range(tb, len(kept)) if _FRAME.match(kept[i])]
        end_of_frames = frames[-1] + 1 if frames else tb + 1
        while end_of_frames < len(kept) and kept[end_of_frames].startswith("    "):
            end_of_frames += 1  # the frame's source line and its ^^^^ markers
        block = kept[end_of_frames:] or [kept[-1]]
        for i in reversed(frames):
            m = _FRAME.match(kept[i])
            f = m["file"]
            if "site-packages" in f or "dist-packages" in f or f.startswith("<"):
                continue
            rel = f
            if root is not None:
                with contextlib.suppress(ValueError):
                    rel = str(Path(f).resolve().relative_to(Path(root).resolve()))
            where = f"at {rel}:{m['line']} in {m['func']}"
            break
    else:
        start = len(kept) - 1
        while start > 0 and kept[start].startswith((" ", "\t")):
            start -= 1
        block = kept[start:]
    if len(block) > MAX_REASON_LINES:
        more = len(block) - (MAX_REASON_LINES - 1)
        block = [*block[: MAX_REASON_LINES - 1], f"  ... ({more} more lines in the log)"]
    out = [ln if len(ln) <= MAX_REASON_CHARS else ln[: MAX_REASON_CHARS - 1] + "…" for ln in block]
    if where:
        out.append(where)
    return out


def openable(path: str | Path, cwd: str | Path | None = None) -> str:
    """`path` as the user can open it from `cwd` (default: the current directory): relative when it is
    under `cwd`, else absolute."""
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


def _stage_hints(stage: str, status: int | None, reason: str, attempts: int, ws: str) -> list[str]:
    hints: list[str] = []
    if status is not None and status < 0:
        sig = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        hints.append(
            f"the stage was killed by {sig}: usually the kernel's out-of-memory killer (see `dmesg`); free "
            "memory or lower the stage's batch size / workers"
        )
    elif status == EXIT_TRANSIENT:
        hints.append(
            "a transient failure (a lost worker or connection): check the machine and any server named above"
        )
    elif status == EXIT_USAGE:
        hints.append(
            "the stage refused a parameter or input named above: `factory params` shows the resolved values"
        )
    if "frames refused" in reason:
        hints.append("each refused frame and why is in rejected.jsonl (above); check the raw data "
                     "(`factory data check DIR`) or relax prepare.min_points / prepare.max_reject_fraction")  # fmt: skip
    if "parity vs PyTorch failed" in reason:
        hints.append("the per-gate figures are in the report named above (docs/OPTIMIZE.md, Parity); "
                     "-S optimize.precision=fp32 ships the FP32 artifact instead")  # fmt: skip
    hints.append(
        f"fix it and `factory run` again (finished stages are restored from DVC's run-cache), or replay "
        f"this stage alone: cd {ws} && dvc repro {stage}"
    )
    return hints


def stage_failure(
    stage: str,
    output: str,
    log: Path,
    workspace: Path,
    index: int,
    total: int,
    attempts: int,
    prefect_log: Path | None = None,
    cwd: str | Path | None = None,
) -> Failure:
    """The screen for a failed stage (`output`: its `dvc repro` output, all attempts)."""
    status = stage_exit_status(output)
    transient = is_transient_exit(status, last_attempt(output))
    reason = stage_reason(output, workspace)
    # Paths in the message open from the user's directory; the `at FILE:LINE` location stays as it is:
    # the project's own source file (the workspace holds a copy of it).
    reason = [ln if ln.startswith("at ") else rewrite_paths(ln, workspace, cwd) for ln in reason]
    how = f"exit {status}" if status is None or status >= 0 else f"killed by signal {-status}"
    if attempts > 1:
        retried = f"failed {attempts} times (transient, retried)"
    elif transient:
        retried = "transient, no retry left"
    else:
        retried = "not retried (a deterministic error)"
    shown = openable(log, cwd)
    if prefect_log is not None:
        beside = Path(prefect_log).parent == Path(log).parent
        shown += (
            f"{LOG_NOTE}(Prefect's: {Path(prefect_log).name if beside else openable(prefect_log, cwd)}"
            + (" beside it)" if beside else ")")
        )
    logs = [("log", shown)]
    if transient:
        code = EXIT_TRANSIENT
    elif status == EXIT_USAGE:
        code = EXIT_USAGE
    else:
        code = EXIT_STAGE_FAILED
    return Failure(
        title=f"factory run failed at stage {stage} ({index} of {total}): {how}, {retried}",
        reason=reason,
        logs=logs,
        hints=_stage_hints(stage, status, "\n".join(reason), attempts, openable(workspace, cwd)),
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


# Connection errors of the HTTP clients Prefect (httpx) and MLflow (requests, urllib3) talk to their servers with.
_CONNECTION_ERRORS = {
    *(("httpx", n) for n in ("ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError")),
    *(("requests", n) for n in ("ConnectionError", "ConnectTimeout")),
    *(("urllib3", n) for n in ("MaxRetryError", "NewConnectionError")),
}


def _lost_server(e: BaseException) -> tuple[str, str] | None:
    """(which, URL) of the server that went away while the flow ran, when `e` (or its chain) is a connection
    error to a configured Prefect server (`PREFECT_API_URL`) or MLflow tracking server (an http(s)
    `MLFLOW_TRACKING_URI`): the stages' own work is done or failed on its own; the flow's records are not."""
    from pfactory.tracking import redact_uri

    mlflow_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        mro = [(c.__module__.split(".")[0], c.__name__) for c in type(exc).__mro__]
        text = str(exc)
        if os.environ.get("PREFECT_API_URL") and any(m in _CONNECTION_ERRORS for m in mro if m[0] == "httpx"):
            return "Prefect server", os.environ["PREFECT_API_URL"]
        if mlflow_uri.startswith(("http://", "https://")) and (
            any(m in _CONNECTION_ERRORS for m in mro if m[0] != "httpx")
            or (("mlflow", "MlflowException") in mro and "Max retries exceeded" in text)
        ):
            return "MLflow tracking server", redact_uri(mlflow_uri)
        exc = exc.__cause__ or exc.__context__
    return None


def flow_failure(e: BaseException, log: Path | None, cwd: str | Path | None = None) -> Failure:
    """Anything else that escaped the flow (outside the stages): its last line, the traceback in the log."""
    from tasks._stage import is_transient

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
