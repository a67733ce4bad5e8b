"""tasks._stage: a stage process that finished exits without the interpreter's teardown, after every `atexit`
handler and non-daemon thread of its body, with its whole output flushed; a failed one tears down as usual, and
a stage entry called from another program (as the stage tests call `main()`) leaves that program's exit alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, os, sys, threading, time
from pathlib import Path
from tasks._command import Command
from tasks._stage import stage_main
from tasks.synth import sections

OUT = Path(os.environ["OUT"])


class Teardown:
    def __del__(self, _open=os.open, _close=os.close, _path=str(OUT / "teardown")):
        _close(_open(_path, os.O_CREAT | os.O_WRONLY))  # only the interpreter's teardown collects it


KEEP = Teardown()


def late():
    time.sleep(0.3)
    (OUT / "thread").write_text("joined")


def body(params, options):
    atexit.register(lambda: (OUT / "atexit").write_text("ran"))
    threading.Thread(target=late).start()  # non-daemon: joined before the atexit handlers
    if os.environ["HOW"] == "fail":
        raise RuntimeError("boom")
    return {"blob": "x" * 300_000}  # more than a pipe's buffer: lost unless flushed before the exit

COMMAND = Command("synth", "a stage that ends as HOW says", (), body, sections)
if os.environ["HOW"] == "hosted":  # another program calls the stage's entry, then ends its own way
    stage_main(Command("synth", "not this program's own", (), body, sections), sys.argv[1:])
    sys.exit(3)
stage_main(COMMAND, sys.argv[1:])
"""


@pytest.mark.parametrize(("how", "rc", "teardown"), [("done", 0, False), ("fail", 1, True), ("hosted", 3, True)])
def test_a_finished_stage_skips_teardown_after_its_exit_handlers(how, rc, teardown, tmp_path) -> None:
    (tmp_path / "stage.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OUT": str(tmp_path), "HOW": how, "PYTHONPATH": str(REPO)}
    env.pop("COVERAGE_PROCESS_START", None)
    r = subprocess.run([sys.executable, "stage.py", "--params", str(REPO / "params.yaml")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == rc, r.stderr[-2000:]
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "teardown").exists() == teardown
    if how != "fail":
        assert json.loads(r.stdout) == {"blob": "x" * 300_000}
