"""The terminal side of a pipeline run: stage lines, live progress of the running stage, notes, failures.

The stages run as `dvc repro` subprocesses with their output in `logs/<stage>.log`; what they report
as they go (`pfactory.runtime.progress.emit`: train step / loss / samples/s, evaluate frames, optimize phase)
arrives as JSON lines in `logs/progress.jsonl`, which `RunConsole.following` tails while a stage runs.

Two modes, chosen by whether stderr is a terminal:
    live    a rich progress line for the running stage (spinner, bar, figures, ETA) under the finished
            stages' lines
    plain   timestamped lines only (CI logs, a deployment's worker, `2> file`): one per finished stage, and
            while a stage runs, its latest progress every `PLAIN_EVERY_S` seconds (a heartbeat)
Both count the lines they print (`printed`), so a failure screen after them keeps the whole run's output
within one screen (`flows.failure.MAX_LINES`).
`current()` is the console the flow writes to: the one `factory run` installed with `use()`, else a plain
one on stderr.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pfactory.runtime.progress import ProgressReader

PLAIN_EVERY_S = 30.0  # a CI log gets a progress line this often during a long stage
POLL_S = 0.25  # how often the progress file is read


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Rate:
    """ETA of a counter from its first and latest events (event timestamps, so thread lag does not count)."""

    def __init__(self) -> None:
        self.start: dict[str, tuple[float, float]] = {}

    def eta(self, key: str, t: float, done: float, total: float) -> str:
        t0, d0 = self.start.setdefault(key, (t, done))
        if done >= total:
            return "done"
        if done <= d0 or t <= t0:
            return "ETA …"
        return f"ETA {_clock((total - done) * (t - t0) / (done - d0))}"


def describe(ev: dict[str, Any], rate: _Rate) -> tuple[str, float | None, float | None]:
    """`(text, completed, total)` of one progress event (completed/total None: no bar)."""
    stage = ev.get("stage", "")
    if "phase" in ev:
        return str(ev["phase"]), None, None
    if stage == "train" and "step" in ev and "total" in ev:
        parts = [f"step {ev['step']}/{ev['total']}"]
        if ev.get("loss") is not None:
            parts.append(f"loss {float(ev['loss']):.4f}")
        if ev.get("samples_per_s") is not None:
            parts.append(f"{float(ev['samples_per_s']):.1f} samples/s")
        parts.append(rate.eta("train", float(ev["t"]), float(ev["step"]), float(ev["total"])))
        return "  ".join(parts), float(ev["step"]), float(ev["total"])
    if "done" in ev and "total" in ev:
        kind = ev.get("kind", "")
        key = f"{stage}/{kind}"
        text = f"{kind + ': ' if kind else ''}{ev['done']}/{ev['total']} frames  " + rate.eta(
            key, float(ev["t"]), float(ev["done"]), float(ev["total"])
        )
        return text, float(ev["done"]), float(ev["total"])
    fields = {k: v for k, v in ev.items() if k not in ("t", "stage", "pid")}
    return " ".join(f"{k} {v}" for k, v in fields.items()), None, None


class RunConsole:
    """Stage lines and live progress on `file` (default stderr); `live=None`: live when it is a terminal."""

    def __init__(self, file: IO[str] | None = None, live: bool | None = None) -> None:
        from rich.console import Console

        self.file = file or sys.stderr
        self.live = bool(self.file.isatty()) if live is None else live
        self.console = Console(file=self.file, force_terminal=self.live, highlight=False, soft_wrap=False)
        self.printed = 0  # lines written so far (the transient live line not counted)
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._label = ""
        self._latest = ""  # plain mode: the running stage's latest progress text
        self._started = 0.0
        self._last_plain = 0.0
        self._rate = _Rate()
        self._readers: dict[
            Path, ProgressReader
        ] = {}  # one per progress file: each stage reads on from there

    @property
    def width(self) -> int:
        return self.console.width

    def _plain(self, text: str) -> None:
        with self._lock:
            self.file.write(f"{time.strftime('%H:%M:%S')} {text}\n")
            self.file.flush()
            self.printed += 1

    def note(self, text: str, style: str = "") -> None:
        """One line: above the live progress line, or timestamped in plain mode."""
        if self.live:
            self.console.print(text, style=style or None)
            self.printed += 1
        else:
            self._plain(text)

    @contextlib.contextmanager
    def status(self, text: str, announce: bool = True) -> Iterator[None]:
        """A spinner with `text` while the body runs (plain mode: the line, once, when `announce`)."""
        if not self.live:
            if announce:
                self._plain(text)
            yield
            return
        with self.console.status(text, spinner="dots"):
            yield

    def stage_started(self, index: int, total: int, stage: str) -> None:
        self._label = f"[{index}/{total}] {stage}"
        self._rate = _Rate()
        self._latest = ""
        self._started = self._last_plain = time.monotonic()
        if not self.live:
            return  # plain: the heartbeat says what is running, the end line what it did
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(self._label, total=None, info="")

    def stage_progress(self, ev: dict[str, Any]) -> None:
        """Show one progress event of the running stage (plain mode: kept for the next heartbeat)."""
        text, completed, total = describe(ev, self._rate)
        if not self.live:
            self._latest = text
            return
        if self._progress is not None:
            kw: dict[str, Any] = {"info": text}
            if total is not None:
                kw.update(total=total, completed=completed)
            self._progress.update(self._task, **kw)

    def heartbeat(self) -> None:
        """Plain mode: the running stage's latest progress, when nothing was printed for `PLAIN_EVERY_S`."""
        now = time.monotonic()
        if self.live or not self._label or now - self._last_plain < PLAIN_EVERY_S:
            return
        self._last_plain = now
        self._plain(f"{self._label}: {self._latest or 'running'} ({_clock(now - self._started)})")

    def _stop_live(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def stage_finished(self, index: int, total: int, stage: str, how: str, seconds: float) -> None:
        self._stop_live()
        self._label = ""
        if self.live:
            self.console.print(f"[green]✓[/] [{index}/{total}] {stage:<9} {how:<11} {seconds:7.1f} s")
            self.printed += 1
        else:
            self._plain(f"[{index}/{total}] {stage}: {how}, {seconds:.1f} s")

    def stage_failed(self) -> None:
        """The running stage failed: stop its progress line (the failure screen says the rest)."""
        self._stop_live()
        self._label = ""

    @contextlib.contextmanager
    def following(self, path: str | Path, stage: str | None = None) -> Iterator[None]:
        """Tail the progress file `path` on a thread while the body runs (a stage's `dvc repro`); only
        events of `stage` are shown (None: all)."""
        reader = self._readers.setdefault(Path(path), ProgressReader(path))
        stop = threading.Event()

        def pump() -> None:
            while True:
                done = stop.wait(POLL_S)
                with contextlib.suppress(Exception):  # a display problem must not fail the run
                    for ev in reader.read():
                        if stage is None or ev.get("stage") == stage:
                            self.stage_progress(ev)
                    self.heartbeat()
                if done:
                    return

        thread = threading.Thread(target=pump, name="progress-follower", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    def failure(self, lines: list[tuple[str, str]]) -> None:
        """Print a failure screen (`flows.failure.failure_lines`)."""
        self._stop_live()
        from rich.text import Text

        for style, text in lines:
            if self.live:
                self.console.print(Text(text, style=style or ""), soft_wrap=True)
            else:
                with self._lock:
                    self.file.write(text + "\n")
            self.printed += 1
        self.file.flush()


_current: RunConsole | None = None


def current() -> RunConsole:
    """The console of this process's run (`use`), else a plain one on stderr."""
    global _current
    if _current is None:
        _current = RunConsole(live=False)
    return _current


def use(console: RunConsole | None) -> None:
    """Make `console` the one `current()` returns (None: back to the default)."""
    global _current
    _current = console
