"""pfactory.runtime.quick_exit: a program that finished skips the interpreter's teardown after every `atexit`
handler and non-daemon thread, with its output flushed; one that did not, or an entry called from inside
another program, ends as it would have (the other program's exit status is never replaced)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# `Teardown` leaves a file only when the interpreter's teardown collects it (the module's globals cleared).
PRELUDE = """
import atexit, os, sys, threading, time
from pathlib import Path
OUT = Path(os.environ["OUT"])

class Teardown:
    def __del__(self, _open=os.open, _close=os.close, _path=str(OUT / "teardown")):
        _close(_open(_path, os.O_CREAT | os.O_WRONLY))

KEEP = Teardown()

def late():
    time.sleep(0.3)
    (OUT / "thread").write_text("joined")

def work():
    atexit.register(lambda: (OUT / "atexit").write_text("ran"))
    threading.Thread(target=late).start()  # non-daemon: joined before the atexit handlers
    sys.stdout.write("x" * 300_000)  # more than a pipe's buffer: lost unless flushed before the exit
"""

PROGRAM = PRELUDE + """
from pfactory.runtime.quick_exit import for_program

def entry():
    quick = for_program(entry)
    work()
    if os.environ["HOW"] == "fail":
        sys.exit(3)
    quick.finished()

entry()
"""

# A host program calls another module's entry (as pytest calls a stage's main()) and then exits 3.
HOSTED = PRELUDE + """
import types
from pfactory.runtime.quick_exit import for_program

guest = types.ModuleType("guest")
exec("from pfactory.runtime.quick_exit import for_program\\ndef entry():\\n    return for_program(entry)", guest.__dict__)
assert guest.entry() is None
work()
sys.exit(3)
"""


def _run(tmp_path: Path, script: str, how: str = "done") -> subprocess.CompletedProcess:
    (tmp_path / "prog.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "OUT": str(tmp_path), "HOW": how, "PYTHONPATH": str(REPO)}
    env.pop("COVERAGE_PROCESS_START", None)
    return subprocess.run([sys.executable, "prog.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize(("script", "how", "rc", "teardown"), [
    (PROGRAM, "done", 0, False),
    (PROGRAM, "fail", 3, True),
    (HOSTED, "done", 3, True),
], ids=["finished", "failed", "hosted"])  # fmt: skip
def test_only_a_finished_program_skips_teardown(tmp_path, script, how, rc, teardown) -> None:
    r = _run(tmp_path, script, how)
    assert r.returncode == rc, r.stderr[-2000:]
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "teardown").exists() == teardown
    assert r.stdout == "x" * 300_000


CLI = PRELUDE + """
from factory.cli import main
sys.argv = ["factory", *os.environ["ARGS"].split()]
main()
"""


@pytest.mark.parametrize(("args", "rc", "teardown"), [("--help", 0, False), ("no-such-command", 2, True)])
def test_the_factory_command_is_a_program(tmp_path, args, rc, teardown) -> None:
    (tmp_path / "prog.py").write_text(textwrap.dedent(CLI))
    env = {**os.environ, "OUT": str(tmp_path), "ARGS": args, "PYTHONPATH": str(REPO)}
    env.pop("COVERAGE_PROCESS_START", None)
    r = subprocess.run([sys.executable, "prog.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == rc, r.stderr[-2000:]
    assert (tmp_path / "teardown").exists() == teardown
    if rc == 0:
        assert "Usage" in r.stdout
