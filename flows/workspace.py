"""Run workspaces: each pipeline run executes the DVC stages in its own directory.

Why: overrides (`-S train.lr=...`) live in `params.yaml`, and `dvc.lock` + the stage outputs live
beside it; two runs sharing one directory would overwrite each other's params, outputs and lock
(DESIGN.md §3: "concurrent runs are isolated"). A workspace is what `dvc exp run --temp` makes, without
needing a git commit first:

    artifacts/runs/<run_id>/
        .dvc/config         no_scm; cache.dir = the project's `.dvc/cache` (shared: content-addressed,
                            and DVC's run-cache there lets a run skip a stage another run already
                            computed with the same code, deps and params)
        dvc.yaml            copied from the project (the one declaration of the stage DAG)
        params.yaml         the project's params + this run's overrides, resolved and validated
        pfactory/ tasks/ kernels/   the code as it was when the run started (what the stages import:
                            `python -m tasks.<stage>` runs with the workspace as cwd; DVC hashes them)
        artifacts/...       the stage outputs, `dvc.lock` records their hashes

`dvc repro` in the project root runs the same DAG without Prefect; `dvc repro` inside a workspace
replays that run. Workspaces are kept (they are the run's artifacts); `factory gc`-style cleanup is a
`rm -rf artifacts/runs/<id>` since every tracked output is also in the DVC cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.failure import is_transient_exit, stage_exit_status, stage_reason

RUNS_DIR = Path("artifacts") / "runs"
CODE_DIRS = ("pfactory", "tasks", "kernels")
COPIED_FILES = ("dvc.yaml", ".dvcignore")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


class StageFailed(RuntimeError):
    """A `dvc repro <stage>` exited non-zero. `output` is this attempt's DVC + stage output, `log` the
    stage log (all attempts), `status` the stage command's own exit status (negative: killed by that
    signal; None: DVC failed around it), `transient` whether a retry may help (`flows.failure`)."""

    def __init__(self, stage: str, returncode: int, output: str, log: Path) -> None:
        self.stage = stage
        self.returncode = returncode
        self.output = output
        self.log = log
        self.status = stage_exit_status(output)
        self.transient = is_transient_exit(self.status, output)
        how = "transient" if self.transient else "deterministic"
        reason = "\n  ".join(stage_reason(output))
        super().__init__(
            f"stage {stage!r} failed ({how}, exit {self.status}; dvc exit {returncode}); log: {log}\n  {reason}"
        )


def new_run_id(name: str | None = None) -> str:
    """`<UTC time>-<name>-<6 hex>`: sortable, readable, unique across concurrent starts."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name or "run").strip("-")[:40] or "run"
    return f"{stamp}-{slug}-{uuid.uuid4().hex[:6]}"


@dataclass
class Workspace:
    """One run's isolated DVC project (module docstring). `root` is the project it came from."""

    root: Path
    path: Path
    run_id: str
    params: Any
    stage_seconds: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)  # `repro` calls per stage (1 + retries)

    def abs(self, rel: str | Path) -> Path:
        """A `params.paths` entry resolved inside the workspace (absolute paths stay as they are)."""
        p = Path(rel)
        return p if p.is_absolute() else self.path / p

    def env(self) -> dict[str, str]:
        """Environment for DVC and the stage processes: this interpreter's bin first on PATH (the stage
        cmd is `python -m tasks.<stage>`), the workspace first on PYTHONPATH."""
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(self.path) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("DVC_NO_ANALYTICS", "1")
        return env

    def dvc(self, *args: str, log_name: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run `dvc <args>` in the workspace (this interpreter's DVC). Its output streams into
        `logs/<log_name>.log` as it runs (`tail -f` it to watch a stage) and is returned as `stdout`."""
        cmd = [sys.executable, "-m", "dvc", *args]
        log = self.path / "logs" / f"{log_name or args[0]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"$ dvc {' '.join(args)}\n")
            f.flush()
            start = f.tell()
            proc = subprocess.run(
                cmd, cwd=self.path, env=self.env(), stdout=f, stderr=subprocess.STDOUT, text=True
            )
        with open(log) as f:
            f.seek(start)
            output = f.read()
        if check and proc.returncode != 0:
            raise StageFailed(log_name or args[0], proc.returncode, output, log)
        return subprocess.CompletedProcess(cmd, proc.returncode, output, None)

    def repro(self, stage: str) -> dict[str, Any]:
        """`dvc repro <stage>` (upstream stages already reproduced are no-ops); returns what DVC did:
        `{"seconds", "ran", "restored_from_run_cache", "unchanged", "how"}` ("how": ran | run-cache | up to date)."""
        self.attempts[stage] = self.attempts.get(stage, 0) + 1
        t0 = time.perf_counter()
        try:
            proc = self.dvc("repro", stage, log_name=stage)
        finally:
            self.stage_seconds[stage] = time.perf_counter() - t0
        seconds = self.stage_seconds[stage]
        out = proc.stdout
        result = {
            "seconds": round(seconds, 3),
            "ran": f"Running stage '{stage}'" in out,
            "restored_from_run_cache": f"Stage '{stage}' is cached" in out,
            "unchanged": f"Stage '{stage}' didn't change" in out,
        }
        result["how"] = (
            "ran" if result["ran"] else "run-cache" if result["restored_from_run_cache"] else "up to date"
        )
        return result

    def lock(self) -> dict[str, Any]:
        """The workspace's `dvc.lock` (empty dict before the first stage)."""
        import yaml

        p = self.path / "dvc.lock"
        return yaml.safe_load(p.read_text()) if p.is_file() else {}

    def out_hashes(self) -> dict[str, str]:
        """`{out path: md5}` of every stage output recorded in `dvc.lock` (the data version of this run)."""
        hashes: dict[str, str] = {}
        for stage in (self.lock().get("stages") or {}).values():
            for out in stage.get("outs", []):
                if "md5" in out:
                    hashes[out["path"]] = out["md5"]
        return hashes


def create_workspace(root: Path, params: Any, run_id: str) -> Workspace:
    """Make `artifacts/runs/<run_id>/` for `params` (already resolved with the run's overrides).

    Built in a temporary sibling and renamed into place, so a half-made workspace is never used.
    """
    from pfactory.config import params_to_yaml
    from pfactory.fsutil import atomic_write_text

    root = Path(root).resolve()
    path = root / RUNS_DIR / run_id
    if path.exists():
        raise FileExistsError(f"{path}: a run workspace with this id exists already")
    tmp = path.with_name(f".{run_id}.tmp")
    tmp.mkdir(parents=True)
    try:
        for d in CODE_DIRS:
            shutil.copytree(root / d, tmp / d, ignore=_IGNORE)
        for f in COPIED_FILES:
            if (root / f).is_file():
                shutil.copy2(root / f, tmp / f)
        atomic_write_text(tmp / "params.yaml", params_to_yaml(params))
        cache = root / ".dvc" / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        (tmp / ".dvc").mkdir()
        (tmp / ".dvc" / "config").write_text(
            "[core]\n    no_scm = true\n    analytics = false\n    autostage = false\n"
            f"[cache]\n    dir = {cache}\n"
        )
        (tmp / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Workspace(root=root, path=path, run_id=run_id, params=params)
