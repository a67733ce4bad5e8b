"""Run workspaces: each pipeline run executes the DVC stages in its own directory.

Why: overrides (`-S train.lr=...`) live in `params.yaml`, and `dvc.lock` + the stage outputs live
beside it; two runs sharing one directory would overwrite each other's params, outputs and lock
(DESIGN.md §3: "concurrent runs are isolated"). A workspace is what `dvc exp run --temp` makes:

    artifacts/runs/<run_id>/
        (git)  a git worktree of the project, detached at HEAD, plus the project's uncommitted changes
               (modified tracked files, deleted ones, and untracked files of the stage code dirs), so the
               run uses the code as it is in the project right now and `dvc exp save` can record it as a
               DVC experiment in the project's own repository (`flows.experiment`)
        (copy) when the project has no git commit: the stage code dirs copied, `.dvc/config` no_scm
        .dvc/config.local   [cache] of the project as configured (`cache_settings`): its cache dir (`.dvc/cache`,
                            or a team's shared one: `dvc cache dir`), `cache.shared`, and `cache.type`, the
                            link types chosen for the file system (pfactory/storage/dvccache.py): outputs are links
                            into the cache, not copies. Content-addressed, and DVC's run-cache there lets a
                            run skip a stage another run (another clone too) computed with the same code,
                            deps and params; with a default remote, stages run `repro --pull` and a finished
                            run is pushed (`Workspace.push`)
        dvc.yaml            the project's (the one declaration of the stage DAG)
        params.yaml         the project's params + this run's overrides (git: the overridden keys edited in
                            place, comments kept, the way `dvc exp run -S` writes them; copy: resolved)
        pfactory/ tasks/ kernels/   the code the stages import (`python -m tasks.<stage>` runs with the
                            workspace as cwd; DVC hashes them)
        artifacts/...       the stage outputs, `dvc.lock` records their hashes
        artifacts/.state/resume/<stage>/   what an interrupted stage resumes from (train: its checkpoint,
                            written every N steps / M minutes and on SIGTERM), outside DVC's outputs, which DVC
                            deletes before it reruns a stage (`$PFACTORY_RESUME_DIR`, `tasks/train.py`)
        logs/run.json       the run's record: id, name, overrides, stages, MLflow parent run, Prefect flow
                            run, state (running | interrupted | failed | finished): what `factory run
                            --resume [NAME]` reopens (`open_workspace`, `find_resumable`)

With a default DVC remote, the run travels: train uploads each checkpoint (with the record and params.yaml)
to `<remote>/pfactory-runs/<run id>/` (`pfactory.train.remote_checkpoint`, `$PFACTORY_CHECKPOINT_REMOTE`), an
interrupted run pushes its finished stages' outputs and run-cache and marks its record there interrupted, a
finished one marks it finished (its checkpoint removed); `factory run --resume NAME` in a clone that has no
such workspace makes one from the remote's record and checkpoint (`fetch_remote_run`).

`dvc repro` in the project root runs the same DAG without Prefect; `dvc repro` inside a workspace
replays that run. Workspaces are kept (they are the run's artifacts) until `factory gc` removes them
(pfactory/storage/retention.py: never the lineage of a registered model, never a run in progress); a run saved as an
experiment stays in `dvc exp show`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.runtime.failures import (
    EXIT_TRANSIENT,
    OUTCOME_ENV,
    STAGE_LOG_ENV,
    Outcome,
    clear_outcome,
    read_outcome,
)

RUNS_DIR = Path("artifacts") / "runs"
RESUME_DIR = Path("artifacts") / ".state" / "resume"  # in a workspace: `$PFACTORY_RESUME_DIR` of its stages
RESUME_ENV = "PFACTORY_RESUME_DIR"  # = tasks.train.RESUME_ENV
RUN_RECORD = Path("logs") / "run.json"
EXIT_INTERRUPTED = 143  # 128 + SIGTERM: a stage (or `factory run`) stopped on SIGTERM after checkpointing
CODE_DIRS = ("pfactory", "tasks", "kernels")
COPIED_FILES = ("dvc.yaml", ".dvcignore")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


class StageFailed(RuntimeError):
    """A `dvc repro <stage>` exited non-zero: the `index`-th of `total` stages, on its `attempts`-th try.

    `outcome`: what the stage process wrote (`pfactory.runtime.failures.Outcome`: code, error, reason, hint), None
    when it never started (DVC failed around it). `status`: its exit code (None: no verdict). `killed`: it
    started and ended without a verdict (SIGKILL, SIGTERM). `interrupted`: it stopped on SIGTERM after
    checkpointing (exit 143) or was killed: a rerun in the same workspace resumes it. `transient`: a retry may
    help -- a transient verdict (75), an interruption, or DVC finding the workspace locked by another DVC
    process.
    `output`: this attempt's DVC + stage output, `log` the stage log (all attempts), for people to read."""

    def __init__(
        self, stage: str, outcome: Outcome | None, output: str, log: Path, *, returncode: int,
        index: int = 0, total: int = 0, attempts: int = 1, locked: bool = False,
    ) -> None:  # fmt: skip
        self.stage, self.outcome, self.output, self.log = stage, outcome, output, log
        self.returncode, self.index, self.total, self.attempts = returncode, index, total, attempts
        if outcome is not None and outcome.code == 0:
            outcome = self.outcome = None  # the stage finished; DVC failed after it (an output missing, ...)
        self.status = outcome.code if outcome is not None else None
        self.killed = outcome is not None and outcome.code is None
        self.interrupted = self.killed or self.status == EXIT_INTERRUPTED
        self.transient = self.interrupted or self.status == EXIT_TRANSIENT or (outcome is None and locked)
        how = "transient" if self.transient else "deterministic"
        reason = "\n  ".join(outcome.reason if outcome is not None else [])
        super().__init__(
            f"stage {stage!r} failed ({how}, exit {self.status}; dvc exit {returncode}); log: {log}\n  {reason}"
        )


def dvc_locked(path: Path) -> bool:
    """Whether another DVC process holds the lock of the DVC project at `path` right now (`.dvc/tmp/lock`,
    taken with zc.lockfile as DVC does): a run that met it may succeed on a retry."""
    import zc.lockfile

    lock = Path(path) / ".dvc" / "tmp" / "lock"
    if not lock.is_file():
        return False
    try:
        zc.lockfile.LockFile(str(lock)).close()
    except zc.lockfile.LockError:
        return True
    return False


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
    mode: str = "copy"
    """"git": a git worktree of the project (its runs become DVC experiments); "copy": no git commit."""
    baseline: str | None = None
    """git: the commit the worktree is detached at (the experiment's baseline)."""
    untracked: list[str] = field(default_factory=list)
    """git: the project's untracked code files copied in (included in the experiment commit)."""
    params_written: str = "resolved"
    """How params.yaml got the overrides: "edited" (in place, DVC's way) | "resolved" (full dump)."""
    cache_dir: str | None = None
    """The DVC cache the workspace uses: the project's configured one (a team's shared cache, if set)."""
    link_types: str = "copy"
    """Its `cache.type` (how outputs come from the cache: `pfactory.storage.dvccache`)."""
    links_how: str = ""
    """Where `link_types` came from: "configured" or "chosen (working: ...)"."""
    remote: str | None = None
    """The project's default DVC remote: pulled from before a stage recomputes, pushed to after the run."""
    running: subprocess.Popen | None = field(default=None, repr=False)
    """The `dvc` process running now (a stage): what `interrupt` signals."""
    reproduced: list[str] = field(default_factory=list)
    """Stages whose `dvc repro` succeeded through this object, in order (`repro`'s `--single-item`)."""

    def abs(self, rel: str | Path) -> Path:
        """A `params.paths` entry resolved inside the workspace (absolute paths stay as they are)."""
        p = Path(rel)
        return p if p.is_absolute() else self.path / p

    @property
    def outcomes(self) -> Path:
        """Where the stage processes write their outcome JSON (`pfactory.runtime.failures`, `$PFACTORY_OUTCOME_DIR`)."""
        return self.path / "logs" / "outcomes"

    def env(self) -> dict[str, str]:
        """Environment for DVC and the stage processes: this interpreter's bin first on PATH (the stage
        cmd is `python -m tasks.<stage>`), the workspace first on PYTHONPATH, the outcome folder."""
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = str(self.path) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("DVC_NO_ANALYTICS", "1")
        env[OUTCOME_ENV] = str(self.outcomes)
        env[RESUME_ENV] = str(self.path / RESUME_DIR)
        if self.remote:  # train's checkpoints travel with the run (module docstring)
            from pfactory.train.remote_checkpoint import REMOTE_ENV, target_env

            env[REMOTE_ENV] = target_env(self.root, self.run_id, self.path, self.path / RUN_RECORD,
                                         self.path / "params.yaml")  # fmt: skip
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
            proc = subprocess.Popen(cmd, cwd=self.path, env={**self.env(), STAGE_LOG_ENV: str(log)},
                                    stdout=f, stderr=subprocess.STDOUT, text=True)  # fmt: skip
            self.running = proc
            try:
                proc.wait()
            except BaseException:  # an exception raised in a signal handler: nothing is left running
                self.interrupt(signal.SIGKILL)
                proc.kill()
                raise
            finally:
                self.running = None
        with open(log) as f:
            f.seek(start)
            output = f.read()
        if check and proc.returncode != 0:
            name = log_name or args[0]
            raise StageFailed(name, read_outcome(self.outcomes, name), output, log, returncode=proc.returncode,
                              locked=dvc_locked(self.path))  # fmt: skip
        return subprocess.CompletedProcess(cmd, proc.returncode, output, None)

    def interrupt(self, sig: int = signal.SIGTERM) -> list[int]:
        """Send `sig` to the processes of the running stage: every process under the `dvc` process but the
        shell DVC runs the command with (train checkpoints and exits 143 on SIGTERM). Not DVC and not the
        shell: they would end first and report while the stage is still writing; they end when it does.
        Returns the pids signalled."""
        import psutil

        proc = self.running
        if proc is None or proc.poll() is not None:
            return []
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        shells = {"sh", "bash", "dash", "zsh"}
        stage = [p for p in tree if _name(p) not in shells]
        for p in stage:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        return [p.pid for p in stage]

    def record(self, **fields: Any) -> dict[str, Any]:
        """Update the run's record `logs/run.json` (module docstring) with `fields`; returns it."""
        from pfactory.storage.fsutil import atomic_write_json

        data = read_record(self.path)
        data.update(fields)
        atomic_write_json(self.path / RUN_RECORD, data)
        return data

    def repro(self, stage: str, index: int = 0, total: int = 0) -> dict[str, Any]:
        """`dvc repro <stage>` (upstream stages already reproduced are no-ops), the `index`-th of `total`;
        returns what happened: `{"seconds", "ran", "restored_from_run_cache", "unchanged", "how"}` ("how":
        ran | run-cache | up to date), read from the stage's outcome and `dvc.lock`, not DVC's console."""
        self.attempts[stage] = self.attempts.get(stage, 0) + 1
        clear_outcome(self.outcomes, stage)  # an earlier attempt's verdict must not be read as this one's
        before = (self.lock().get("stages") or {}).get(stage)
        t0 = time.perf_counter()
        # With a default remote (machines that share no disk), `--pull` first fetches DVC's run-cache entries
        # and, for a stage they match, its outputs: restored from the remote instead of recomputed.
        pull = ["--pull"] if self.remote else []
        # Every stage before this one in dvc.yaml (its upstream: test_dvc checks the order is the DAG's) was
        # reproduced through this object just now: DVC need not check them again (~0.1-0.5 s per stage).
        single = ["--single-item"] if self.upstream_reproduced(stage) else []
        try:
            proc = self.dvc("repro", *pull, *single, stage, log_name=stage, check=False)
        finally:
            self.stage_seconds[stage] = time.perf_counter() - t0
        outcome = read_outcome(self.outcomes, stage)
        if proc.returncode != 0:
            raise StageFailed(stage, outcome, proc.stdout, self.path / "logs" / f"{stage}.log",
                              returncode=proc.returncode, index=index, total=total, attempts=self.attempts[stage],
                              locked=outcome is None and dvc_locked(self.path))  # fmt: skip
        ran = outcome is not None and outcome.code == 0
        unchanged = not ran and before is not None and before == (self.lock().get("stages") or {}).get(stage)
        result = {
            "seconds": round(self.stage_seconds[stage], 3),
            "ran": ran,
            "restored_from_run_cache": not ran and not unchanged,
            "unchanged": unchanged,
        }
        result["how"] = "ran" if ran else "up to date" if unchanged else "run-cache"
        self.reproduced.append(stage)
        if ran and self.cache_dir:
            self._record_producer(stage)
        return result

    def upstream_reproduced(self, stage: str) -> bool:
        """Whether every stage declared before `stage` in the workspace's dvc.yaml was reproduced through this
        object (`reproduced`), in that order: then `dvc repro --single-item stage` skips re-checking them."""
        from pfactory.storage.dag import stage_names

        names = list(stage_names(self.path))
        if stage not in names:
            return False
        return self.reproduced[: names.index(stage)] == names[: names.index(stage)]

    def _record_producer(self, stage: str) -> None:
        """Who computed `stage`'s outputs, kept beside them in the cache (`<cache>/pfactory/producers/<md5>.json`):
        a clone sharing the cache (its own MLflow store) restores them from the run-cache and can still name
        the run (`flows.parent_run`). Best effort: a record that cannot be written loses a name, not a run."""
        from pfactory.storage.dvccache import write_producer

        stage_outs = ((self.lock().get("stages") or {}).get(stage) or {}).get("outs", [])
        for out in stage_outs:
            if out.get("md5"):
                write_producer(Path(self.cache_dir), out["md5"], {
                    "run_id": self.run_id, "stage": stage, "project": str(self.root),
                    "mlflow_parent_run_id": os.environ.get("PFACTORY_PARENT_RUN_ID"),
                })  # fmt: skip

    def sync_remote(self, state: str) -> dict[str, Any] | None:
        """With a default remote: the run's record (now in `state`) and params.yaml to the remote's copy of the
        run (`pfactory.train.remote_checkpoint`), keeping the checkpoint it names, or dropping it when the run
        `finished` (a finished run that never put anything there leaves nothing). Never raises: None without a
        remote, else `{"ok", "detail"}`."""
        if not self.remote:
            return None
        from pfactory.train.remote_checkpoint import RunRemote

        try:
            remote = RunRemote(self.root)
            if state == "finished" and remote.read_marker(self.run_id) is None:
                return {"ok": True, "detail": f"nothing of this run on the {remote}"}  # no clutter to mark
            remote.write_record(self.run_id, read_record(self.path), (self.path / "params.yaml").read_text(),
                                checkpoint=state != "finished")  # fmt: skip
        except Exception as e:  # the run's outcome stands; the remote copy is a convenience
            return {"ok": False, "detail": f"{type(e).__name__}: {e}".splitlines()[0][:250]}
        return {"ok": True, "detail": str(remote)}

    def push(self, stages: list[str] | None = None) -> dict[str, Any]:
        """`dvc push --run-cache` to the default remote (after a successful run; `stages`: only theirs, an
        interrupted run's finished ones): this run's outputs and the run-cache entries, so a clone on another
        machine restores them (`repro --pull`). Never raises: returns `{"remote", "ok", "detail"}` (a push that
        failed is reported, the run stays a success)."""
        if not self.remote:
            return {"remote": None, "ok": False, "detail": "no default remote (dvc remote add -d NAME URL)"}
        proc = self.dvc("push", "--run-cache", *(stages or []), log_name="push", check=False)
        lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
        return {"remote": self.remote, "ok": proc.returncode == 0, "detail": lines[-1] if lines else ""}

    def lock(self) -> dict[str, Any]:
        """The workspace's `dvc.lock` (empty dict before the first stage)."""
        from pfactory.storage.dag import load_yaml

        p = self.path / "dvc.lock"
        return (load_yaml(p.read_text()) or {}) if p.is_file() else {}

    def out_hashes(self) -> dict[str, str]:
        """`{out path: md5}` of every stage output recorded in `dvc.lock` (the data version of this run)."""
        hashes: dict[str, str] = {}
        for stage in (self.lock().get("stages") or {}).values():
            for out in stage.get("outs", []):
                if "md5" in out:
                    hashes[out["path"]] = out["md5"]
        return hashes


def _name(p: Any) -> str:
    """A psutil process' name ("" once it is gone)."""
    try:
        return p.name()
    except Exception:
        return ""


def read_record(workspace: Path) -> dict[str, Any]:
    """A workspace's `logs/run.json` ({} when it has none or it is unreadable)."""
    try:
        data = json.loads((Path(workspace) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class ResumeError(ValueError):
    """`factory run --resume [NAME]` found no run to resume (the message says which and what exists)."""


def _held(root: Path, run_id: str) -> bool:
    """Whether a live process holds the run's lease (`pfactory.storage.retention.run_lease`): a run in progress."""
    from pfactory.storage.dvccache import read_config
    from pfactory.storage.retention import active_leases

    return any(lease.get("run_id") == run_id for lease in active_leases(read_config(root), root))


def find_resumable(root: Path, name: str | None = None) -> Path:
    """The workspace `factory run --resume [NAME]` continues: NAME is a run id (`artifacts/runs/<id>`) or a run
    name (`--name`; its newest run); None: the newest interrupted run (its record not `finished`). A run in
    progress (its lease held) or a finished one is refused: ResumeError saying what there is."""
    runs = Path(root).resolve() / RUNS_DIR
    found = sorted((p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")), reverse=True) \
        if runs.is_dir() else []  # fmt: skip
    records = {p: read_record(p) for p in found}
    if name:
        named = [p for p in found if p.name == name] or [p for p in found if records[p].get("name") == name]
        if not named:
            raise ResumeError(f"--resume {name}: no run with this id or name under {runs}")
        ws = named[0]
        state = records[ws].get("state")
        if not records[ws]:
            raise ResumeError(f"--resume {name}: {ws} has no {RUN_RECORD} (made before runs could resume)")
        if state == "finished":
            raise ResumeError(f"--resume {name}: run {ws.name} finished; nothing to resume")
        if _held(root, ws.name):
            raise ResumeError(f"--resume {name}: run {ws.name} is in progress (another process holds it)")
        return ws
    for ws in found:
        if records[ws] and records[ws].get("state") != "finished" and not _held(root, ws.name):
            return ws
    raise ResumeError(
        f"--resume: no interrupted run under {runs} (every run there finished or is in progress)"
    )


def _remote_runs(root: Path) -> Any:
    """The project's default DVC remote's run area (`pfactory.train.remote_checkpoint.RunRemote`), None
    without a default remote."""
    from pfactory.storage.dvccache import read_config
    from pfactory.train.remote_checkpoint import RunRemote

    return RunRemote(root) if read_config(root).remote else None


def locate_run(root: Path, name: str | None) -> Path | str:
    """What `factory run --resume [NAME]` continues: a local workspace (`find_resumable`), else, for a NAME
    this clone has no workspace of and with a default DVC remote, the run id the remote holds it under (an
    interrupted run on another machine: `fetch_remote_run`). ResumeError (one line: the run, where it looked)."""
    from pfactory.train.remote_checkpoint import RemoteRunError

    try:
        return find_resumable(root, name)
    except ResumeError:
        local = any(p.name == name or read_record(p).get("name") == name
                    for p in (Path(root).resolve() / RUNS_DIR).glob("*"))  # fmt: skip
        try:
            remote = _remote_runs(root) if name and not local else None
        except RemoteRunError as e:
            raise ResumeError(f"--resume {name}: no run with this id or name here; {e}") from None
        if remote is None:
            raise
    try:
        run_id = remote.find(name)
        marker = remote.read_marker(run_id) if run_id else None
    except RemoteRunError as e:
        raise ResumeError(f"--resume {name}: no run with this id or name here; {e}") from None
    except Exception as e:  # the remote unreachable, credentials refused, ...
        raise ResumeError(f"--resume {name}: no run with this id or name here, and the {remote} could not be "
                          f"read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if marker is None:
        raise ResumeError(f"--resume {name}: no run with this id or name under {Path(root).resolve() / RUNS_DIR}"
                          f" nor on the {remote}")  # fmt: skip
    if (marker.get("record") or {}).get("state") == "finished":
        raise ResumeError(f"--resume {name}: run {run_id} finished (the {remote} says); nothing to resume")
    return run_id


def fetch_remote_run(root: Path, run_id: str) -> Path:
    """Make this clone's workspace of run `run_id` from the default DVC remote's copy (`locate_run`): the
    run's params.yaml and overrides, its record (state interrupted), train's checkpoint where the run keeps it
    (`artifacts/.state/resume/...`). The stages it finished come from the remote on the first `repro --pull`
    (an interrupted run pushed them). Returns the workspace's path."""
    import tempfile

    from flows.params import load_params

    root = Path(root).resolve()
    remote = _remote_runs(root)
    marker = remote.read_marker(run_id) if remote is not None else None
    if marker is None:
        raise ResumeError(f"--resume {run_id}: not on the {remote or 'DVC remote (none configured)'}")
    record = dict(marker.get("record") or {})
    overrides = list(record.get("overrides") or [])
    if marker.get("params_yaml"):
        with tempfile.TemporaryDirectory() as d:  # the run's own params, whatever this clone's params.yaml says
            (Path(d) / "params.yaml").write_text(marker["params_yaml"])
            params = load_params(Path(d) / "params.yaml")
    else:
        params = load_params(root / "params.yaml", overrides)
    ws = create_workspace(root, params, run_id, overrides)
    entry = marker.get("checkpoint") or {}
    rel = Path(entry.get("path", ""))
    if entry and (rel.is_absolute() or ".." in rel.parts or rel.parts[: len(RESUME_DIR.parts)] != RESUME_DIR.parts):
        raise ResumeError(f"--resume {run_id}: the {remote} names checkpoint path {rel}, expected one under "
                          f"{RESUME_DIR}")  # fmt: skip
    if entry:
        remote.get_checkpoint(run_id, ws.path / rel)
    ws.record(**{**record, "mode": ws.mode, "baseline": ws.baseline, "untracked": ws.untracked,
                 "params_written": ws.params_written, "state": "interrupted", "fetched_from": str(remote),
                 "fetched_step": entry.get("step")})  # fmt: skip
    return ws.path


def open_workspace(root: Path, path: Path) -> Workspace:
    """The `Workspace` of an earlier run at `path` (its record `logs/run.json` and its own params.yaml, which
    holds the run's overrides), to run its stages again: finished ones are up to date, an interrupted one
    resumes (`$PFACTORY_RESUME_DIR`)."""
    from flows.params import load_params

    root = Path(root).resolve()
    rec = read_record(path)
    cache = cache_settings(root)
    return Workspace(
        root=root, path=Path(path), run_id=Path(path).name, params=load_params(Path(path) / "params.yaml"),
        mode=rec.get("mode", "copy"), baseline=rec.get("baseline"), untracked=list(rec.get("untracked", [])),
        params_written=rec.get("params_written", "resolved"), cache_dir=cache["dir"], link_types=cache["type"],
        links_how=cache["_how"], remote=cache["_remote"],
    )  # fmt: skip


def git_commit(root: Path) -> str | None:
    """HEAD's sha when `root` is the top level of a git work tree with at least one commit, else None."""
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
        head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head if head and Path(top).resolve() == Path(root).resolve() else None


def _git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):  # a hook's environment must not leak in
        env.pop(k, None)
    out = subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=input, capture_output=True, check=True, timeout=120
    )
    return out.stdout.decode()


def _z(text: str) -> list[str]:
    return [p for p in text.split("\0") if p]


def _overlay_changes(root: Path, tree: Path) -> list[str]:
    """Copy the project's uncommitted changes into worktree `tree`: tracked files that differ from HEAD
    (staged or not; deleted ones deleted; not dvc.lock) and the untracked, not ignored files of `CODE_DIRS`. Returns the
    untracked files copied (relative paths: `dvc exp save` must be told to include them)."""
    for rel in _z(_git(root, "diff", "--name-only", "-z", "--no-renames", "HEAD")):
        if rel == "dvc.lock":  # the run records its own (the project's may be an earlier run's, brought back)
            continue
        src, dst = root / rel, tree / rel
        if src.is_file() or src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
    untracked = _z(_git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_DIRS))
    untracked = [rel for rel in untracked if not _IGNORED_CODE.search(rel)]
    for rel in untracked:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, tree / rel)
    return untracked


_IGNORED_CODE = re.compile(r"(^|/)__pycache__/|\.pyc$|\.egg-info(/|$)")


def _hydra_override(text: str, raw: dict[str, Any]) -> str:
    """`section.key=value` for DVC's params writer: `+section.key=value` when the file lacks the key (a
    schema default being set), as `dvc exp run -S` needs it written."""
    spec = text.split(":", 1)[1] if ":" in text.split("=", 1)[0] else text
    key = spec.split("=", 1)[0].strip().lstrip("+")
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "+" + spec.lstrip("+")
        node = node[part]
    return spec


def write_params(path: Path, params: Any, overrides: list[str]) -> str:
    """Write the run's params to `path` (a copy of the project's params.yaml): the overridden keys edited in
    place with DVC's own writer (comments and layout kept; what `dvc exp run -S` does), checked to read back
    as `params`; when they would not (a value DVC's override grammar reads differently), the resolved params
    instead. Returns "edited" | "resolved"."""
    import yaml

    from flows.params import load_params, params_to_yaml
    from pfactory.storage.fsutil import atomic_write_text

    if path.is_file() and overrides:
        original = path.read_text()
        try:
            from dvc.utils.hydra import apply_overrides

            raw = yaml.safe_load(original) or {}
            apply_overrides(path, [_hydra_override(o, raw) for o in overrides])
            if load_params(path).model_dump(mode="json") == params.model_dump(mode="json"):
                return "edited"
        except Exception:  # DVC's override grammar refused it, or it reads back differently
            pass
        atomic_write_text(path, original)
    if path.is_file() and load_params(path).model_dump(mode="json") == params.model_dump(mode="json"):
        return "edited"
    atomic_write_text(path, params_to_yaml(params))
    return "resolved"


class CacheNotWritable(RuntimeError):
    """The project's DVC cache cannot take new files (a read-only shared cache, a read-only mount): a stage
    that has to run could not store its outputs. Raised before any stage starts."""

    def __init__(self, cache: Path, reason: str) -> None:
        self.cache = cache
        self.reason = reason
        super().__init__(
            f"the DVC cache {cache} is not writable ({reason}): a stage that has to run could not store its "
            "outputs there"
        )


def check_cache(root: Path) -> Any:
    """The project's DVC cache settings (`pfactory.storage.dvccache.CacheConfig`), made if missing; `CacheNotWritable`
    when the cache (or its `files/`, `runs/`) cannot take a new file."""
    from pfactory.storage.dvccache import read_config, writable

    conf = read_config(root)
    why = writable(conf.dir)
    if why is None:  # DVC makes the cache on first use; the runs/ and files/ dirs must take files too
        conf.dir.mkdir(parents=True, exist_ok=True)
        why = next((w for d in (conf.runs, conf.files) if d.is_dir() and (w := writable(d))), None)
    if why is not None:
        raise CacheNotWritable(conf.dir, why)
    return conf


def cache_settings(root: Path) -> dict[str, Any]:
    """What every workspace of `root` gets in its `.dvc/config.local` `[cache]`: the project's configured
    cache (shared or not, absolute), its `cache.shared`, and the link types (`pfactory.storage.dvccache`: the user's
    `cache.type`, else the one chosen for the file system and recorded in the project's config.local).
    Raises `CacheNotWritable` when the cache cannot take new files."""
    from pfactory.storage.dvccache import ensure_link_config

    conf = check_cache(root)
    types, how = ensure_link_config(root)
    settings: dict[str, Any] = {
        "dir": str(conf.dir),
        "type": ",".join(types),
        "_how": how,
        "_remote": conf.remote,
    }
    if conf.shared:
        settings["shared"] = conf.shared
    return settings


def _dvc_config_local(root: Path, tree: Path, cache: dict[str, Any]) -> None:
    """`.dvc/config.local` of a git workspace: the project's local config (remotes...) with the cache set to
    `cache` (`cache_settings`: the project's configured cache, its link types)."""
    import configobj

    local = root / ".dvc" / "config.local"
    conf = configobj.ConfigObj(str(local) if local.is_file() else None)
    conf.filename = str(tree / ".dvc" / "config.local")
    conf.setdefault("cache", {}).update({k: v for k, v in cache.items() if not k.startswith("_")})
    conf.setdefault("core", {})["analytics"] = "false"
    conf.write()


def create_workspace(root: Path, params: Any, run_id: str, overrides: list[str] | None = None) -> Workspace:
    """Make `artifacts/runs/<run_id>/` for `params` (the project's params.yaml + `overrides`, resolved).

    A git worktree (module docstring) when the project is a git repository with a commit, else a copy.
    Built under a temporary name and moved into place, so a half-made workspace is never used.
    """
    root = Path(root).resolve()
    path = root / RUNS_DIR / run_id
    if path.exists():
        raise FileExistsError(f"{path}: a run workspace with this id exists already")
    tmp = path.with_name(f".{run_id}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cache = cache_settings(root)
    links = {"cache_dir": cache["dir"], "link_types": cache["type"], "links_how": cache["_how"],
             "remote": cache["_remote"]}  # fmt: skip
    head = git_commit(root)
    if head is None:
        _fill_copy(root, tmp, params, cache)
        _logs_dir(tmp)
        os.replace(tmp, path)
        return Workspace(root=root, path=path, run_id=run_id, params=params, mode="copy", **links)
    # No hooks: a `dvc install`ed post-checkout hook would run `dvc checkout` in the new worktree.
    _git(root, "-c", "core.hooksPath=/dev/null", "worktree", "add", "--detach", "--quiet", str(tmp), head)
    try:
        untracked = _overlay_changes(root, tmp)
        params_written = write_params(tmp / "params.yaml", params, list(overrides or []))
        _dvc_config_local(root, tmp, cache)
        _logs_dir(tmp)
        _git(root, "worktree", "move", str(tmp), str(path))
    except BaseException:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=root, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Workspace(
        root=root, path=path, run_id=run_id, params=params, mode="git", baseline=head,
        untracked=untracked, params_written=params_written, **links,
    )  # fmt: skip


def _logs_dir(ws: Path) -> None:
    """`logs/` of a workspace (stage logs, timings, progress): ignored by git, not part of the experiment."""
    (ws / "logs").mkdir(exist_ok=True)
    (ws / "logs" / ".gitignore").write_text("*\n")


def _copy_remotes(root: Path, tmp: Path) -> None:
    """The project's `.dvc/config` remotes (and `core.remote`) into a copy workspace's config (a git
    workspace has the project's committed config already)."""
    import configobj

    src = root / ".dvc" / "config"
    if not src.is_file():
        return
    conf = configobj.ConfigObj(str(src))
    dst = configobj.ConfigObj(str(tmp / ".dvc" / "config"))
    for name, section in conf.items():
        if name.startswith("remote "):
            dst[name] = dict(section)
            url = str(section.get("url", ""))
            if url and "://" not in url and not os.path.isabs(url):  # relative to the project's .dvc/
                dst[name]["url"] = str((root / ".dvc" / url).resolve())
    if conf.get("core", {}).get("remote"):
        dst.setdefault("core", {})["remote"] = conf["core"]["remote"]
    dst.write()


def _fill_copy(root: Path, tmp: Path, params: Any, cache: dict[str, Any]) -> None:
    """The workspace of a project without a git commit: code dirs copied, no_scm DVC config."""
    from flows.params import params_to_yaml
    from pfactory.storage.fsutil import atomic_write_text

    tmp.mkdir()
    try:
        for d in CODE_DIRS:
            shutil.copytree(root / d, tmp / d, ignore=_IGNORE)
        for f in COPIED_FILES:
            if (root / f).is_file():
                shutil.copy2(root / f, tmp / f)
        atomic_write_text(tmp / "params.yaml", params_to_yaml(params))
        (tmp / ".dvc").mkdir()
        template = root / ".dvc" / "plots" / "offline.html"  # dvc plots show: Vega inlined (offline)
        (tmp / ".dvc" / "config").write_text(
            "[core]\n    no_scm = true\n    analytics = false\n    autostage = false\n"
            + "[cache]\n"
            + "".join(f"    {k} = {v}\n" for k, v in cache.items() if not k.startswith("_"))
            + (f"[plots]\n    html_template = {template}\n" if template.is_file() else "")
        )
        (tmp / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
        _copy_remotes(root, tmp)
        _dvc_config_local(root, tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
