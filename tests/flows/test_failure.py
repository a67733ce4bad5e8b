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
    is_transient_exit,
    openable,
    rewrite_paths,
    stage_exit_status,
    stage_failure,
    stage_reason,
)
from tasks._stage import EXIT_TRANSIENT, is_transient

# What `logs/prepare.log` held after `factory run -S prepare.min_points=10000000` retried it (c0686b9).
PREPARE_LOG = """$ dvc repro prepare
Stage 'synth' didn't change, skipping
Running stage 'prepare':
> python -m tasks.prepare
prepare failed: 12 of 12 frames refused (100.0%), more than prepare.max_reject_fraction = 10.0%; the reasons are in artifacts/prepared/rejected.jsonl
ERROR: failed to reproduce 'prepare': failed to run: python -m tasks.prepare, exited with 1
$ dvc repro prepare
Stage 'synth' didn't change, skipping
Running stage 'prepare':
> python -m tasks.prepare
prepare failed: 12 of 12 frames refused (100.0%), more than prepare.max_reject_fraction = 10.0%; the reasons are in artifacts/prepared/rejected.jsonl
ERROR: failed to reproduce 'prepare': failed to run: python -m tasks.prepare, exited with 1
"""

PARITY_LOG = """$ dvc repro optimize
Running stage 'optimize':
> python -m tasks.optimize
2026/12/01 08:40:21 INFO mlflow.tracking.fluent: Experiment with name 'x' does not exist. Creating a new experiment.
/x/site-packages/onnxruntime/quantization/base_quantizer.py:12: UserWarning: per_channel is deprecated
  warnings.warn(
optimize: parity vs PyTorch failed (full report: artifacts/optimized.parity-failed.json):
  onnxruntime/int8: scores: max |diff| / (atol 0.25) = 1.43 > 1 (max |diff| 0.358)
  onnxruntime/int8: match rate 0.740 < 0.75
ERROR: failed to reproduce 'optimize': failed to run: python -m tasks.optimize, exited with 1
"""


def _traceback_log(ws: Path) -> str:
    return f"""$ dvc repro train
Running stage 'train':
> python -m tasks.train
train: step 30/40 loss 1.2345 7.1 samples/s
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{ws}/tasks/train.py", line 790, in <module>
    main()
  File "{ws}/tasks/train.py", line 512, in run
    terms = train_step(forward, model, batch, optimizer, scheduler, tp, rt, timer, use_bf16)
            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x32 and 64x32)
ERROR: failed to reproduce 'train': failed to run: python -m tasks.train, exited with 1
"""


def test_prepare_reason_is_the_stage_message_of_the_last_attempt():
    reason = stage_reason(PREPARE_LOG)
    assert reason == [
        "prepare failed: 12 of 12 frames refused (100.0%), more than prepare.max_reject_fraction = 10.0%; "
        "the reasons are in artifacts/prepared/rejected.jsonl"
    ]
    assert stage_exit_status(PREPARE_LOG) == 1


def test_parity_reason_keeps_the_gate_lines_and_drops_library_noise():
    reason = stage_reason(PARITY_LOG)
    assert reason[0].startswith("optimize: parity vs PyTorch failed")
    assert reason[1].strip().startswith("onnxruntime/int8: scores: max |diff|")
    assert len(reason) == 3
    assert not any("mlflow" in r or "Warning" in r for r in reason)


def test_traceback_reason_is_the_exception_and_the_innermost_project_frame(tmp_path):
    ws = tmp_path / "ws"
    reason = stage_reason(_traceback_log(ws), ws)
    assert reason == [
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x32 and 64x32)",
        "at tasks/train.py:512 in run",
    ]


def test_dvc_error_without_a_stage_exit_is_the_reason():
    out = "$ dvc repro train\nERROR: failed to reproduce 'train': output 'artifacts/model' does not exist\n"
    assert stage_exit_status(out) is None
    assert stage_reason(out) == [out.splitlines()[1]]


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
    log.write_text(PREPARE_LOG)
    f = stage_failure(
        "prepare", PREPARE_LOG, log, ws, 2, 6, 1, prefect_log=ws / "logs" / "prefect.log", cwd=tmp_path
    )
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
    out = (
        "$ dvc repro prepare\nprepare: 250 of 250 frames refused (100.0%), more than "
        "prepare.max_reject_fraction = 10.0%; the reasons are in artifacts/prepared/rejected.jsonl\n"
    )
    log = ws / "logs" / "prepare.log"
    log.write_text(out)
    f = stage_failure("prepare", out, log, ws, 2, 6, 1, prefect_log=ws / "logs" / "prefect.log", cwd=tmp_path)
    lines = failure_lines(f, width=72, max_lines=MAX_LINES - 8)
    assert sum(-(-len(t) // 72) for _, t in lines) <= MAX_LINES - 8
    text = [t for _, t in lines]
    assert text[0].startswith("✗ factory run failed at stage prepare") and text[-1].startswith("exit 1")
    assert any(t.startswith("reason: prepare: 250 of 250 frames refused") for t in text)
    reason = [t for (style, t) in lines if style == ""]
    assert reason[-1].endswith(" …") and not any(t.endswith(" …") for t in reason[:-1])  # cut at the end
    assert any(t.startswith("log:") and t.endswith("artifacts/runs/20261201T173909Z-run-c3602a/logs/prepare.log")
               for t in text), text  # fmt: skip
    assert (tmp_path / next(t for t in text if t.startswith("log:")).split()[-1]).is_file()  # it opens


def test_a_long_reason_still_fits_the_screen(tmp_path):
    long = "$ dvc repro optimize\noptimize: failed:\n" + "".join(
        f"  gate {i}: " + "x" * 300 + "\n" for i in range(30)
    )
    f = stage_failure("optimize", long, tmp_path / "o.log", tmp_path, 4, 6, 1)
    lines = failure_lines(f, width=80)
    assert len(lines) <= MAX_LINES
    assert lines[0][1].startswith("✗ factory run failed at stage optimize")
    assert lines[-1][1].startswith("exit 1")


@pytest.mark.parametrize(
    ("status", "output", "transient"),
    [
        (1, "", False),
        (2, "", False),
        (EXIT_TRANSIENT, "", True),
        (-9, "", True),  # SIGKILL: the OOM killer
        (-15, "", True),
        (-11, "", False),  # SIGSEGV: a bug
        (None, "ERROR: Unable to acquire lock. Most likely another DVC process is running", True),
        (None, "ERROR: unexpected error", False),
    ],
)
def test_which_stage_outcomes_are_transient(status, output, transient):
    assert is_transient_exit(status, output) is transient


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

    class KilledWorker(Exception):  # distributed.scheduler.KilledWorker, by module and name
        pass

    KilledWorker.__module__ = "distributed.scheduler"
    assert is_transient(KilledWorker("unit 3"))
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
