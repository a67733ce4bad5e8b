"""Ending a program that finished without the interpreter's teardown.

A process that imported torch, DALI, ONNX Runtime, pyarrow, MLflow and Prefect spends ~0.5-1.5 s after its
last line in the interpreter's teardown: modules cleared, objects collected, extension modules and their
thread pools unloaded (measured: a finished prepare stage process spent 0.14 s in its `atexit` handlers and
0.6 s more before it was gone; the `factory run` command 1.7 s after printing its result). None of that writes
anything a stage or the command needs: every output was written, closed and renamed before.

`QuickExit` registers one `atexit` handler; once the program says it `finished()`, that handler flushes the
logs and the standard streams and calls `os._exit(0)`. It runs after every handler registered later (atexit
runs them in reverse order of registration), so register it first thing: then every pool, Dask client,
temporary folder, MLflow queue and service the program opened is still closed by its own handler, and
non-daemon threads are joined before any handler runs. A program that did not finish (an exception, a
non-zero exit) tears down as usual.

Only a program's own entry may register it (`for_program`): the handler ends the process with status 0,
so inside another program (pytest calling a stage's `main()`) it would replace that program's exit status.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys


class QuickExit:
    """The registered handler (`for_program`) and its switch: `finished()` once the program succeeded."""

    def __init__(self) -> None:
        self._finished = False
        atexit.register(self._exit)

    def finished(self) -> None:
        """The program succeeded: at exit, skip the teardown (after every `atexit` handler registered later)."""
        self._finished = True

    def _exit(self) -> None:
        # coverage.py saves its data in an atexit handler registered before this one: never skip it
        if not self._finished or "coverage" in sys.modules:
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a pipe whose reader left
                stream.flush()
        os._exit(0)


def for_program(entry: object) -> QuickExit | None:
    """A `QuickExit` when this process's main module (`__main__`: the script, `python -m` module or console
    script that started it) holds `entry` -- the program's own entry point (a stage's `COMMAND`, the CLI's
    `main`) -- else None: the entry was called from inside another program, which ends as it would."""
    main = sys.modules.get("__main__")
    if main is None or not any(value is entry for value in vars(main).values()):
        return None
    return QuickExit()
