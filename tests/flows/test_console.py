"""Stage progress from the stage processes to `factory run`'s terminal: the event file (pfactory.runtime.progress),
its reader, and the console's plain mode (what CI logs and non-terminals get)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

from flows.console import RunConsole, _Rate, describe
from pfactory.runtime import progress
from pfactory.runtime.progress import PROGRESS_ENV, ProgressReader, emit


def test_emit_is_a_no_op_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    emit("train", step=1, total=2)
    assert list(tmp_path.iterdir()) == []


def test_events_from_another_process_arrive_whole_and_throttled(tmp_path):
    path = tmp_path / "progress.jsonl"
    code = (
        "from pfactory.runtime.progress import emit\n"
        "for s in range(1, 201): emit('train', step=s, total=200, loss=1.0 / s, samples_per_s=8.0)\n"
        "emit('optimize', phase='parity vs PyTorch')\n"
    )
    subprocess.run([sys.executable, "-c", code], env={**_env(), PROGRESS_ENV: str(path)}, check=True)
    events = ProgressReader(path).read()
    steps = [e["step"] for e in events if e["stage"] == "train"]
    # A tight loop: the first step, then nothing closer than MIN_INTERVAL_S, and always the last one.
    assert steps[0] == 1 and steps[-1] == 200 and len(steps) < 20
    assert events[-1] == {**events[-1], "stage": "optimize", "phase": "parity vs PyTorch"}


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != PROGRESS_ENV}


def test_reader_keeps_a_partial_last_line_for_the_next_read(tmp_path):
    path = tmp_path / "p.jsonl"
    line = json.dumps({"t": 1.0, "stage": "evaluate", "done": 4, "total": 8})
    path.write_text(line[:10])
    reader = ProgressReader(path)
    assert reader.read() == []
    with open(path, "a") as f:
        f.write(line[10:] + "\nnot json\n")
    assert reader.read() == [json.loads(line)]
    assert reader.read() == []


def test_describe_gives_train_figures_and_an_eta():
    rate = _Rate()
    first = describe({"t": 100.0, "stage": "train", "step": 10, "total": 110, "loss": 2.0}, rate)
    assert first[1:] == (10.0, 110.0) and "ETA …" in first[0]
    text, done, total = describe(
        {"t": 110.0, "stage": "train", "step": 20, "total": 110, "loss": 1.5, "samples_per_s": 4.0}, rate
    )
    # 10 steps in 10 s, 90 to go: 90 s.
    assert "step 20/110" in text and "loss 1.5000" in text and "4.0 samples/s" in text and "ETA 1m30s" in text
    text, done, total = describe(
        {"t": 5.0, "stage": "evaluate", "kind": "optimized", "done": 8, "total": 16}, rate
    )
    assert text.startswith("optimized: 8/16 frames") and (done, total) == (8.0, 16.0)
    assert describe({"t": 1.0, "stage": "optimize", "phase": "exporting ONNX"}, rate) == (
        "exporting ONNX",
        None,
        None,
    )


def test_plain_console_prints_a_heartbeat_with_the_latest_progress(tmp_path, monkeypatch):
    import flows.console

    out = io.StringIO()
    console = RunConsole(file=out, live=False)
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(PROGRESS_ENV, str(path))
    monkeypatch.setattr(progress, "_last", {})
    monkeypatch.setattr(flows.console, "PLAIN_EVERY_S", 0.5)
    console.stage_started(3, 6, "train")
    with console.following(path):
        emit("train", step=1, total=3, loss=1.0, samples_per_s=2.0)
        time.sleep(0.2)  # read, not yet printed: no line before the heartbeat interval
        assert out.getvalue() == ""
        emit("train", step=2, total=3, loss=0.9, samples_per_s=2.0, force=True)
        time.sleep(0.9)
    console.stage_finished(3, 6, "train", "ran", 12.34)
    lines = out.getvalue().splitlines()
    beats = lines[:-1]  # one or two, depending on the scheduler: each with the latest figures
    assert 1 <= len(beats) <= 2 and console.printed == len(lines), lines
    assert all("[3/6] train: step 2/3  loss 0.9000  2.0 samples/s" in b for b in beats), beats
    assert lines[-1].endswith("[3/6] train: ran, 12.3 s")
