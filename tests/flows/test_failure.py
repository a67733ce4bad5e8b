"""The failure screen of `factory run`: reason extraction from real stage-log shapes, openable paths, the
15-line budget, exit codes, and which failures count as transient (retried)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.failure import (
    EXIT_STAGE_FAILED,
    MAX_LINES,
    failure_lines,
    flow_failure,
    openable,
    rewrite_paths,
    stage_failure,
    stage_reason,
)
from flows.workspace import StageFailed
from pfactory.optimize.errors import ParityError
from pfactory.prepare.errors import RejectFractionExceeded
from pfactory.runtime.failures import EXIT_TRANSIENT, EXIT_USAGE, Outcome, is_transient, stage_outcome

REJECTED = RejectFractionExceeded(12, 12, 0.1, "artifacts/prepared/rejected.jsonl")
PARITY = ParityError(
    [
        "onnxruntime/int8: scores: max |diff| / (atol 0.25) = 1.43 > 1 (max |diff| 0.358)",
        "onnxruntime/int8: match rate 0.740 < 0.75",
    ],
    "artifacts/optimized.parity-failed.json",
)
# What DVC 3.x printed around a failed prepare (c0686b9), and the same run as another DVC might word it.
DVC_OUTPUT = """$ dvc repro prepare
Stage 'synth' didn't change, skipping
Running stage 'prepare':
> python -m tasks.prepare
prepare: 12 of 12 frames refused (100.0%), more than prepare.max_reject_fraction = 10.0%; the reasons are in artifacts/prepared/rejected.jsonl
ERROR: failed to reproduce 'prepare': failed to run: python -m tasks.prepare, exited with 1
"""
OTHER_DVC_OUTPUT = """$ dvc repro prepare
[dvc] synth: unchanged
[dvc] executing prepare: python -m tasks.prepare
prepare: 12 of 12 frames refused (100.0%), more than prepare.max_reject_fraction = 10.0%; the reasons are in artifacts/prepared/rejected.jsonl
[dvc] error: prepare ended with status 1
"""


def failed(stage: str, exc: BaseException | None, output: str = "", log: Path = Path("x.log"), **kw) -> StageFailed:
    """The StageFailed a run raises for a stage process that ended on `exc` (None: killed, no verdict)."""
    outcome = stage_outcome(stage, exc) if exc is not None else Outcome(stage, None)
    return StageFailed(stage, outcome, output, log, returncode=255, **kw)


def _raised(exc: BaseException) -> BaseException:
    """`exc` with a traceback through this file (what a stage's bug carries)."""
    try:
        raise exc
    except BaseException as e:
        return e


def test_prepare_reason_is_the_error_message_and_its_hint_comes_from_its_class():
    e = failed("prepare", REJECTED, DVC_OUTPUT)
    assert stage_reason(e) == [str(REJECTED)] and e.status == 1 and not e.transient
    f = stage_failure(e, Path("."))
    assert any("rejected.jsonl (above)" in h for h in f.hints) and f.exit_code == EXIT_STAGE_FAILED


def test_parity_reason_keeps_the_gate_lines_and_its_hint():
    e = failed("optimize", PARITY)
    reason = stage_reason(e)
    assert reason[0].startswith("parity vs PyTorch failed")
    assert reason[1].strip().startswith("onnxruntime/int8: scores: max |diff|") and len(reason) == 3
    assert any("optimize.precision=fp32" in h for h in stage_failure(e, Path(".")).hints)


def test_a_bug_is_its_exception_and_the_innermost_project_frame():
    e = failed("train", _raised(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 64x32)")))
    reason = stage_reason(e)
    assert reason[0] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x32 and 64x32)"
    assert reason[1].startswith("at tests/flows/test_failure.py:") and reason[1].endswith(" in _raised")


def test_dvc_error_without_a_stage_outcome_is_dvc_s_last_line():
    out = "$ dvc repro train\nERROR: failed to reproduce 'train': output 'artifacts/model' does not exist\n"
    e = StageFailed("train", None, out, Path("t.log"), returncode=255)
    assert e.status is None and not e.transient
    assert stage_reason(e) == [out.splitlines()[1]]


def test_dvc_failing_after_a_finished_stage_is_dvc_s_reason():
    out = "$ dvc repro train\nERROR: output 'artifacts/model/model.pt' does not exist\n"
    e = StageFailed("train", Outcome("train", 0), out, Path("t.log"), returncode=255)
    assert e.outcome is None and e.status is None and stage_reason(e) == [out.splitlines()[1]]


def test_a_dvc_output_format_change_does_not_change_the_screen(tmp_path):
    """The screen is built from the stage's outcome; what DVC prints around the stage is for the log only."""
    runs = [failed("prepare", REJECTED, out, tmp_path / "p.log", index=2, total=6)
            for out in (DVC_OUTPUT, OTHER_DVC_OUTPUT, "")]  # fmt: skip
    screens = [failure_lines(stage_failure(e, tmp_path, cwd=tmp_path), width=100) for e in runs]
    assert screens[0] == screens[1] == screens[2]
    assert "stage prepare (2 of 6): exit 1" in screens[0][0][1]


def test_paths_in_a_message_open_from_the_current_directory(tmp_path, monkeypatch):
    ws = tmp_path / "project" / "artifacts" / "runs" / "r1"
    (ws / "artifacts" / "prepared").mkdir(parents=True)
    (ws / "artifacts" / "prepared" / "rejected.jsonl").write_text("{}\n")
    msg = "the reasons are in artifacts/prepared/rejected.jsonl; see sqlite:///x/y.db and a/b/missing.txt"
    # From the project root: relative to it.
    out = rewrite_paths(msg, ws, cwd=tmp_path / "project")
    assert "artifacts/runs/r1/artifacts/prepared/rejected.jsonl;" in out
    assert "sqlite:///x/y.db" in out and "a/b/missing.txt" in out  # URLs and missing paths untouched
    # From elsewhere: absolute, and it opens.
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    out = rewrite_paths(msg, ws, cwd=elsewhere)
    shown = out.split("reasons are in ")[1].split(";")[0]
    assert Path(shown).is_absolute() and Path(shown).is_file()
    monkeypatch.chdir(tmp_path / "project")
    assert openable(ws / "logs" / "x.log") == os.path.join("artifacts", "runs", "r1", "logs", "x.log")


def test_stage_failure_screen_fits_15_lines_and_names_stage_reason_log(tmp_path):
    ws = tmp_path / "artifacts" / "runs" / "r1"
    (ws / "logs").mkdir(parents=True)
    (ws / "artifacts" / "prepared").mkdir(parents=True)
    (ws / "artifacts" / "prepared" / "rejected.jsonl").write_text("{}\n")
    log = ws / "logs" / "prepare.log"
    log.write_text(DVC_OUTPUT)
    e = failed("prepare", REJECTED, DVC_OUTPUT, log, index=2, total=6)
    f = stage_failure(e, ws, prefect_log=ws / "logs" / "prefect.log", cwd=tmp_path)
    assert f.exit_code == EXIT_STAGE_FAILED
    text = "\n".join(t for _, t in failure_lines(f, width=200))
    assert "stage prepare (2 of 6)" in text and "not retried" in text
    assert "artifacts/runs/r1/logs/prepare.log" in text
    assert "artifacts/runs/r1/artifacts/prepared/rejected.jsonl" in text
    assert "Prefect's: prefect.log beside it" in text
    for width in (40, 80, 120):  # terminal rows, a path longer than the width counted as it wraps
        lines = failure_lines(f, width=width)
        assert sum(-(-len(t) // width) for _, t in lines) <= MAX_LINES, width
        assert any("artifacts/runs/r1/logs/prepare.log" in t for _, t in lines), "a path split across lines"
    # After 9 progress lines the screen shrinks (hints first), never below its core.
    short = failure_lines(f, width=80, max_lines=MAX_LINES - 9)
    assert len(short) < len(failure_lines(f, width=80)) and short[0][1].startswith("✗")
    assert any(t.startswith("reason:") for _, t in short) and any(t.startswith("log:") for _, t in short)


def test_after_a_fresh_start_the_log_path_stays_on_the_screen(tmp_path):
    """What a newcomer saw (22a7007, 2026-12-01): 8 lines of first-start and synth progress, then a
    3-row reason at a 72-column terminal; the screen dropped the log line. Now the Prefect note and the
    reason's continuation rows go first (marked " …"): title, reason, the openable log path, exit."""
    ws = tmp_path / "artifacts" / "runs" / "20261201T173909Z-run-c3602a"
    (ws / "logs").mkdir(parents=True)
    (ws / "artifacts" / "prepared").mkdir(parents=True)
    (ws / "artifacts" / "prepared" / "rejected.jsonl").write_text("{}\n")
    log = ws / "logs" / "prepare.log"
    log.write_text("$ dvc repro prepare\n")
    e = failed("prepare", RejectFractionExceeded(250, 250, 0.1, "artifacts/prepared/rejected.jsonl"), log=log,
               index=2, total=6)  # fmt: skip
    f = stage_failure(e, ws, prefect_log=ws / "logs" / "prefect.log", cwd=tmp_path)
    lines = failure_lines(f, width=72, max_lines=MAX_LINES - 8)
    assert sum(-(-len(t) // 72) for _, t in lines) <= MAX_LINES - 8
    text = [t for _, t in lines]
    assert text[0].startswith("✗ factory run failed at stage prepare") and text[-1].startswith("exit 1")
    assert any(t.startswith("reason: 250 of 250 frames refused") for t in text)
    reason = [t for (style, t) in lines if style == ""]
    assert reason[-1].endswith(" …") and not any(t.endswith(" …") for t in reason[:-1])  # cut at the end
    assert any(t.startswith("log:") and t.endswith("artifacts/runs/20261201T173909Z-run-c3602a/logs/prepare.log")
               for t in text), text  # fmt: skip
    assert (tmp_path / next(t for t in text if t.startswith("log:")).split()[-1]).is_file()  # it opens


def test_a_long_reason_still_fits_the_screen(tmp_path):
    long = ParityError([f"gate {i}: " + "x" * 300 for i in range(30)])
    f = stage_failure(failed("optimize", long, log=tmp_path / "o.log", index=4, total=6), tmp_path)
    lines = failure_lines(f, width=80)
    assert len(lines) <= MAX_LINES
    assert lines[0][1].startswith("✗ factory run failed at stage optimize")
    assert lines[-1][1].startswith("exit 1")


@pytest.mark.parametrize(
    ("outcome", "locked", "transient", "code"),
    [
        (Outcome("x", 1), False, False, 1),
        (Outcome("x", EXIT_USAGE), False, False, EXIT_USAGE),
        (Outcome("x", EXIT_TRANSIENT, transient=True), False, True, EXIT_TRANSIENT),
        (Outcome("x", None), False, True, EXIT_TRANSIENT),  # started, no verdict: killed (the OOM killer)
        (None, True, True, EXIT_TRANSIENT),  # DVC could not take the workspace's lock: another DVC held it
        (None, False, False, 1),  # DVC failed around the stage
    ],
)
def test_which_stage_outcomes_are_transient(outcome, locked, transient, code):
    e = StageFailed("x", outcome, "", Path("x.log"), returncode=255, locked=locked)
    assert e.transient is transient and stage_failure(e, Path(".")).exit_code == code


def test_transient_exceptions_are_recognised_through_their_chain():
    assert is_transient(ConnectionRefusedError("refused"))
    assert not is_transient(ValueError("bad value"))
    try:
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("evaluate: task x failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)

    from distributed import KilledWorker

    assert is_transient(KilledWorker("unit 3", last_worker=None, allowed_failures=3))
    assert is_transient(RuntimeError("(sqlite3.OperationalError) database is locked"))


def test_a_lost_prefect_server_names_the_server_and_is_transient(tmp_path, monkeypatch):
    """The Prefect server dies while the flow runs: its state reports fail with httpx's ConnectError when the
    stages are done (tests/faults/test_infra.py's Prefect case). The screen names the server, not a bare
    'ConnectError ... outside the stages'; without a configured server the generic screen stays."""
    import httpx

    def lost() -> BaseException:
        try:
            try:
                raise httpx.ConnectError("[Errno 111] Connection refused")
            except httpx.ConnectError as inner:
                raise RuntimeError("could not report the flow run's state") from inner
        except RuntimeError as outer:
            return outer

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4201/api")
    f = flow_failure(lost(), tmp_path / "prefect.log", cwd=tmp_path)
    assert "lost the Prefect server at http://127.0.0.1:4201/api" in f.title
    assert f.exit_code == EXIT_TRANSIENT and "run-cache" in " ".join(f.hints)
    assert len(failure_lines(f, 80)) <= MAX_LINES
    monkeypatch.delenv("PREFECT_API_URL")
    f = flow_failure(lost(), tmp_path / "prefect.log", cwd=tmp_path)
    assert "outside the stages" in f.title
    f = flow_failure(ValueError("not a connection"), tmp_path / "prefect.log", cwd=tmp_path)
    assert "outside the stages" in f.title and f.exit_code == EXIT_STAGE_FAILED


def test_a_lost_mlflow_server_names_the_server(tmp_path, monkeypatch):
    """The tracking server dies after a stage finished: the flow's own MLflow call (ending the parent run)
    fails with MlflowException 'Max retries exceeded'. The screen names the server (its password hidden)."""
    from mlflow.exceptions import MlflowException

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://me:s3cret@127.0.0.1:5999")
    e = MlflowException("API request to http://127.0.0.1:5999/api/2.0/mlflow/runs/update failed with "
                        "exception HTTPConnectionPool(host='127.0.0.1', port=5999): Max retries exceeded")  # fmt: skip
    f = flow_failure(e, tmp_path / "prefect.log", cwd=tmp_path)
    assert "lost the MLflow tracking server at http://me:***@127.0.0.1:5999" in f.title
    assert "s3cret" not in repr(failure_lines(f, 80)) and f.exit_code == EXIT_TRANSIENT
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # a local store: no server to lose
    assert "outside the stages" in flow_failure(e, tmp_path / "prefect.log", cwd=tmp_path).title


def test_an_actionable_error_in_the_flow_keeps_its_code_reason_and_hint(tmp_path: Path) -> None:
    """A team server's 401 met by the flow itself (not a stage): its own exit code (77), reason and hint
    from the error's data, not "failed in the flow" and exit 1."""
    from pfactory.tracking.identity import NotAuthenticated, PermissionRefused

    f = flow_failure(NotAuthenticated("the MLflow server http://h refused the request: 401"), tmp_path / "p.log")
    assert (f.exit_code, f.reason) == (77, ["the MLflow server http://h refused the request: 401"])
    assert "outside the stages" in f.title and "failed" not in f.title

    class Refused(PermissionRefused):
        hint = "ask a maintainer"

    f = flow_failure(Refused("user 'alice' has READ on 'pfactory-detector'"), None)
    assert f.exit_code == 77 and f.hints == ["ask a maintainer"] and f.logs == []
