"""What a newcomer's machine looks like, for the newcomer test and `factory bench newcomer`.

- `fresh_clone(dst)`: `git clone` of this repository: no `artifacts/`, no Prefect home, no MLflow DB, no
  DVC cache. Uncommitted edits of tracked files and new files git does not ignore are copied over (so a
  developer tests what they are about to commit; CI's clean checkout has none) and listed in `.dirty`.
- `cpu_quota(cores)`: a cgroup (v2 `cpu.max`, or v1 `cpu.cfs_quota_us`) that holds every process started
  in it — the run, its Prefect server, DVC, the stage processes, Dask workers — to `cores` CPUs of this
  machine: a 2-3x slower machine, emulated. Needs a writable cgroup file system (root, or a delegated
  subtree); otherwise it says why and limits nothing.
- `newcomer_env(home)`: the environment of someone who has never run the project: none of the project's
  or the tools' variables, a HOME of its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))  # v2 (pure, or hybrid's unified)
CGROUP_V1_CPU = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"))
PERIOD_US = 100_000
TOOL_PREFIXES = ("MLFLOW_", "PREFECT_", "DASK_", "DVC_", "PFACTORY_", "TRITON_", "TORCHINDUCTOR_", "OMP_")


@dataclass
class Clone:
    path: Path
    commit: str
    dirty: list[str] = field(default_factory=list)  # working-tree files copied over the commit


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def is_git_checkout(path: Path = REPO) -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree", cwd=path).strip() == "true"
    except (OSError, subprocess.CalledProcessError):
        return False


def fresh_clone(dst: Path, repo: Path = REPO, working_tree: bool = True) -> Clone:
    """Clone `repo` into `dst` (which must not exist). `working_tree`: copy uncommitted changes over."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(repo), str(dst)], check=True)
    commit = _git("rev-parse", "HEAD", cwd=dst).strip()
    dirty: list[str] = []
    if working_tree:
        changed = _git("diff", "--name-only", "HEAD", cwd=repo).splitlines()
        untracked = _git("ls-files", "--others", "--exclude-standard", cwd=repo).splitlines()
        for rel in sorted(set(changed) | set(untracked)):
            src, out = repo / rel, dst / rel
            if src.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
            elif out.exists():  # deleted in the working tree
                out.unlink()
            dirty.append(rel)
    return Clone(dst, commit, dirty)


def newcomer_env(home: Path, python: str = sys.executable) -> dict[str, str]:
    """os.environ without the project's and the tools' settings, HOME = `home`, `python`'s bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(TOOL_PREFIXES) and k != "PYTHONPATH"}
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        PATH=str(Path(python).parent) + os.pathsep + env.get("PATH", ""),
        PYTHONDONTWRITEBYTECODE="1",
        XDG_CACHE_HOME=str(home / ".cache"),
    )
    return env


@dataclass
class Quota:
    """A CPU limit for child processes: pass `preexec` to subprocess; `how` says what was applied."""

    cores: float | None
    preexec: Callable[[], None] | None
    how: str
    cgroup: Path | None = None

    @property
    def applied(self) -> bool:
        return self.preexec is not None


def _v2_root() -> Path | None:
    for root in CGROUP_ROOTS:
        ctl = root / "cgroup.controllers"
        if ctl.is_file() and "cpu" in ctl.read_text().split():
            return root
    return None


def _make_cgroup(cores: float) -> tuple[Path, Path, str]:
    """Create the cgroup; returns (dir, procs file, description). Raises OSError when not possible."""
    name = f"pfactory-newcomer-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    quota_us = max(int(cores * PERIOD_US), 1000)
    root = _v2_root()
    if root is not None:
        sub = root / "cgroup.subtree_control"
        if "cpu" not in sub.read_text().split():
            sub.write_text("+cpu")
        d = root / name
        d.mkdir()
        (d / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        return d, d / "cgroup.procs", f"cgroup v2 {d}: cpu.max {quota_us} {PERIOD_US} = {cores:g} CPU"
    for root in CGROUP_V1_CPU:
        if (root / "cpu.cfs_quota_us").is_file():
            d = root / name
            d.mkdir()
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota_us))
            return (
                d,
                d / "cgroup.procs",
                f"cgroup v1 {d}: cfs quota {quota_us}/{PERIOD_US} us = {cores:g} CPU",
            )
    raise OSError("no cgroup cpu controller found (v2 cgroup.controllers without cpu, no v1 cpu mount)")


def _remove_cgroup(d: Path) -> None:
    """Kill what is still running in the cgroup (processes the run started and left), then remove it."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            with contextlib.suppress(OSError):
                d.rmdir()
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


@contextlib.contextmanager
def cpu_quota(cores: float | None) -> Iterator[Quota]:
    """A `Quota` of `cores` CPUs for the processes started with its `preexec` (None: no limit)."""
    if not cores:
        yield Quota(None, None, "no CPU quota (not asked)")
        return
    try:
        d, procs, how = _make_cgroup(cores)
    except OSError as e:
        yield Quota(cores, None, f"no CPU quota: the cgroup could not be made ({e})")
        return

    def preexec() -> None:  # runs in the child between fork and exec: it and its descendants are held
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    try:
        yield Quota(cores, preexec, how, d)
    finally:
        _remove_cgroup(d)
