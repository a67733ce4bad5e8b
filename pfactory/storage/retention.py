"""Retention: what a project's runs cost on disk, and `factory gc`, which frees it without ever touching the
lineage of a registered model.

What there is (`pfactory.storage.dvccache`): run workspaces `artifacts/runs/<run id>/` (their outputs are links into
the DVC cache), the project's own paths (links too), the DVC cache (`files/md5/`: every output once; `runs/`:
the run-cache). A file's bytes are freed only when its last link goes, so every size here is counted per
inode: "frees" is the bytes of the inodes whose every link is among what is removed.

What is kept (`plan`), each with its reason in the table `factory gc` prints:
- runs: the `keep_last` newest run workspaces, those younger than `keep_days`, and every run in progress
  (a lease, below);
- cache objects (and the files of a `.dir` listing) referenced by: a kept run's `dvc.lock`; the project's
  `dvc.lock` (what its own paths and `release/` hold); every version of every registered model in the MLflow
  registry (its pipeline run's `data.<out>.md5` tags: raw data, shards, model, optimized artifacts, release),
  the champion first; every run in progress; and any object changed in the last `GRACE_S` (a stage committing
  right now);
- run-cache entries whose outputs are all kept (so a kept run's stages still restore); an entry naming an
  object that goes is removed first, so no entry ever points at a missing object.
Nothing under MLflow's store is touched: `models:/<name>@champion` loads from there.

Concurrency: a run holds a lease for its whole life, `<cache>/pfactory/leases/<run id>.lease`, an exclusive
`flock` on an open file (released by the kernel when the process dies, so a killed run never blocks gc for
ever). `gc` reads the leases before deciding and again before each removal: a run in progress keeps its
workspace and every object its dvc.lock names; an object linked or written after gc started is younger than
the grace window. Two gcs on one cache: the second waits for `<cache>/pfactory/gc.lock`'s owner.

Order of removal (a gc stopped at any point — killed, disk full — leaves only extra files, never a reference
to a missing one): run-cache entries, then run workspaces, then `.dir` listings, then object files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.storage.dag import load_yaml
from pfactory.storage.dvccache import CacheConfig, read_config

RUNS_DIR = Path("artifacts") / "runs"
STATE_DIR = "pfactory"  # inside the cache dir: leases, gc lock, producer records (shared by its clones)
# An object whose inode changed this recently (written, linked, protected) may belong to a stage committing
# right now: kept. `PFACTORY_GC_GRACE_S` overrides it (tests; a cache on a clock-skewed network file system).
GRACE_S = 600.0


# ---------------------------------------------------------------------------------------------- leases


def grace_s() -> float:
    """The grace window in seconds (`GRACE_S`, or `PFACTORY_GC_GRACE_S` as it is now)."""
    return float(os.environ.get("PFACTORY_GC_GRACE_S", GRACE_S))


def lease_dir(cache: CacheConfig) -> Path:
    """`<cache>/pfactory/leases`: where every clone sharing the cache leaves its runs' leases."""
    return cache.dir / STATE_DIR / "leases"


def _lease_dirs(cache: CacheConfig, root: Path | None = None) -> list[Path]:
    """The cache's lease dir, and the project's own (`artifacts/.state/leases`: where a run leaves its lease
    when the shared cache's directory refuses it)."""
    dirs = [lease_dir(cache)]
    if root is not None:
        dirs.append(Path(root) / "artifacts" / ".state" / "leases")
    return dirs


@contextlib.contextmanager
def run_lease(root: Path, run_id: str, cache: CacheConfig | None = None) -> Iterator[Path]:
    """Hold run `run_id`'s lease (module docstring) while the block runs; yields the lease file. The file
    says who holds it (run id, workspace, pid, host, user, start) for `factory gc` / `factory disk`."""
    from pfactory.storage.dvccache import state_dir

    cache = cache or read_config(root)
    try:
        path = state_dir(cache.dir, "leases") / f"{run_id}.lease"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    except PermissionError:  # a shared cache whose pfactory/ another user made without group write
        d = _lease_dirs(cache, root)[1]
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{run_id}.lease"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        info = {
            "run_id": run_id,
            "workspace": str(Path(root).resolve() / RUNS_DIR / run_id),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "user": _user(),
            "started": time.time(),
        }
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def active_leases(cache: CacheConfig, root: Path | None = None) -> list[dict[str, Any]]:
    """The leases held right now (a run in progress, in any clone sharing the cache; with `root`, also the
    project's own lease dir). A lease file whose holder is gone (its lock free) is stale: removed."""
    held: list[dict[str, Any]] = []
    paths = [p for d in _lease_dirs(cache, root) if d.is_dir() for p in sorted(d.glob("*.lease"))]
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                try:
                    info = json.loads(path.read_text() or "{}")
                except (OSError, ValueError):
                    info = {}
                held.append({"run_id": path.stem, **info})
                continue
            with contextlib.suppress(OSError):  # free: its holder died without removing it
                path.unlink()
        finally:
            os.close(fd)
    return held


@contextlib.contextmanager
def gc_lock(cache: CacheConfig, wait: bool = True) -> Iterator[None]:
    """One gc at a time per cache (`<cache>/pfactory/gc.lock`); `wait=False` raises BlockingIOError."""
    from pfactory.storage.dvccache import state_dir

    path = state_dir(cache.dir) / "gc.lock"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o664)  # flock needs no write access: any clone may lock it
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o664)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield
    finally:
        os.close(fd)


def _user(uid: int | None = None) -> str:
    try:
        return pwd.getpwuid(os.getuid() if uid is None else uid).pw_name
    except KeyError:
        return getpass.getuser() if uid is None else str(uid)


# ------------------------------------------------------------------------------------- what exists


@dataclass
class Run:
    """One run workspace."""

    run_id: str
    path: Path
    created: float
    """Seconds since the epoch: the id's UTC stamp (`flows.workspace.new_run_id`), else the dir's mtime."""
    user: str
    hashes: dict[str, str] = field(default_factory=dict)
    """`{out path: md5}` of its dvc.lock (`.dir` for a directory)."""
    stages: dict[str, list[str]] = field(default_factory=dict)
    """`{stage: [md5, ...]}` of its dvc.lock."""


def _created(run_id: str, path: Path) -> float:
    import calendar

    try:
        return float(calendar.timegm(time.strptime(run_id[:16], "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return path.stat().st_mtime


def lock_hashes(lock_file: Path) -> dict[str, list[tuple[str, str]]]:
    """`{stage: [(out path, md5), ...]}` of a dvc.lock (cached outputs only)."""
    import yaml

    if not lock_file.is_file():
        return {}
    try:
        doc = load_yaml(lock_file.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    out: dict[str, list[tuple[str, str]]] = {}
    for name, stage in (doc.get("stages") or {}).items():
        for o in (stage or {}).get("outs", []) or []:
            if o.get("md5"):
                out.setdefault(name, []).append((o["path"], o["md5"]))
    return out


def list_runs(root: Path) -> list[Run]:
    """Every run workspace of the project (not the half-made `.<id>.tmp` ones), oldest first."""
    runs_dir = Path(root) / RUNS_DIR
    runs: list[Run] = []
    for p in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        if not p.is_dir() or p.name.startswith("."):
            continue
        st = p.stat()
        stages = lock_hashes(p / "dvc.lock")
        run = Run(p.name, p, _created(p.name, p), _user(st.st_uid))
        run.stages = {s: [h for _, h in outs] for s, outs in stages.items()}
        run.hashes = {path: h for outs in stages.values() for path, h in outs}
        runs.append(run)
    return sorted(runs, key=lambda r: (r.created, r.run_id))


def object_path(cache: CacheConfig, md5: str) -> Path:
    """Where DVC 3 keeps object `md5` (`abc...` or `abc....dir`)."""
    return cache.files / md5[:2] / md5[2:]


def expand(cache: CacheConfig, hashes: Iterable[str]) -> set[str]:
    """`hashes` plus, for each `.dir`, the md5 of every file it lists (DVC's directory objects)."""
    out: set[str] = set()
    for h in hashes:
        out.add(h)
        if h.endswith(".dir"):
            try:
                entries = json.loads(object_path(cache, h).read_text())
            except (OSError, ValueError):
                continue  # not in this cache (a remote-only object): nothing local to keep
            out.update(e["md5"] for e in entries if isinstance(e, dict) and e.get("md5"))
    return out


def cache_objects(cache: CacheConfig) -> dict[str, Path]:
    """`{md5: path}` of every object in the cache."""
    objs: dict[str, Path] = {}
    if not cache.files.is_dir():
        return objs
    for sub in cache.files.iterdir():
        if len(sub.name) != 2 or not sub.is_dir():
            continue
        for f in sub.iterdir():
            if f.is_file() and not f.name.startswith("."):
                objs[sub.name + f.name] = f
    return objs


def run_cache_entries(cache: CacheConfig) -> dict[Path, set[str]]:
    """`{entry file: {md5 of its outputs}}` of DVC's run-cache."""
    import yaml

    entries: dict[Path, set[str]] = {}
    if not cache.runs.is_dir():
        return entries
    for f in cache.runs.glob("*/*/*"):
        if not f.is_file():
            continue
        try:
            doc = load_yaml(f.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        entries[f] = {o["md5"] for o in doc.get("outs", []) or [] if isinstance(o, dict) and o.get("md5")}
    return entries


# ------------------------------------------------------------------------------- registry lineage


@dataclass
class Registered:
    """A registered model version and the DVC objects its lineage needs."""

    model: str
    version: int
    aliases: list[str]
    run_id: str | None
    """The factory run id (the pipeline run's `run_id` tag) that produced it, when known."""
    hashes: dict[str, str]
    """`{out path: md5}` from its pipeline run's `data.<out>.md5` tags."""


def _all_pages(search: Callable[..., Any], *args: Any) -> Iterator[Any]:
    """Every result of an MLflow paged search (a nightly run adds a version a night: hundreds in a year)."""
    token = None
    while True:
        page = search(*args, page_token=token) if token else search(*args)
        yield from page
        token = getattr(page, "token", None)
        if not token:
            return


def registry_lineage(client: Any) -> list[Registered]:
    """Every version of every registered model with the DVC hashes of its pipeline run (the version's run,
    or the pipeline run above it: `mlflow.parentRunId`). Raises what MLflow raises when the registry cannot
    be read: gc must not guess what a registered model needs."""
    found: list[Registered] = []
    runs: dict[str, Any] = {}

    def run(rid: str) -> Any:
        if rid not in runs:
            try:
                runs[rid] = client.get_run(rid)
            except Exception as e:  # a deleted run: its version keeps nothing of ours
                if "RESOURCE_DOES_NOT_EXIST" in str(e) or "not found" in str(e).lower():
                    runs[rid] = None
                else:
                    raise
        return runs[rid]

    for rm in _all_pages(client.search_registered_models):
        aliases: dict[int, list[str]] = {}
        for alias, v in (rm.aliases or {}).items():
            aliases.setdefault(int(v), []).append(alias)
        for mv in _all_pages(client.search_model_versions, f"name = '{rm.name}'"):
            hashes: dict[str, str] = {}
            factory_run = None
            rid = mv.run_id
            for _ in range(4):  # stage run -> pipeline run: at most a level or two
                r = run(rid) if rid else None
                if r is None:
                    break
                tags = r.data.tags
                hashes.update(
                    {k[5:-4]: v for k, v in tags.items() if k.startswith("data.") and k.endswith(".md5")}
                )
                factory_run = factory_run or tags.get("run_id")
                if tags.get("pipeline") == "true":
                    break
                rid = tags.get("mlflow.parentRunId")
            found.append(
                Registered(
                    rm.name, int(mv.version), sorted(aliases.get(int(mv.version), [])), factory_run, hashes
                )
            )
    return found


# ------------------------------------------------------------------------------------------ the plan


@dataclass
class Plan:
    """What `gc` keeps and removes, and why."""

    cache: CacheConfig
    started: float
    kept_runs: list[tuple[Run, str]] = field(default_factory=list)
    removed_runs: list[Run] = field(default_factory=list)
    keep_reasons: dict[str, list[str]] = field(default_factory=dict)
    """`{md5: [why, ...]}` of the objects referenced by something kept."""
    kept_objects: set[str] = field(default_factory=set)
    removed_objects: dict[str, Path] = field(default_factory=dict)
    removed_entries: list[Path] = field(default_factory=list)
    kept_entries: int = 0
    registered: list[Registered] = field(default_factory=list)
    active: list[dict[str, Any]] = field(default_factory=list)
    frees_bytes: int = 0
    kept_bytes: int = 0

    def table(self) -> list[dict[str, Any]]:
        """Rows `{what, name, action, bytes, why}`: the runs, the kept lineage, the objects removed."""
        rows: list[dict[str, Any]] = []
        for run, why in self.kept_runs:
            rows.append({"what": "run", "name": run.run_id, "action": "keep", "bytes": None, "why": why})
        for run in self.removed_runs:
            rows.append({"what": "run", "name": run.run_id, "action": "remove",
                         "bytes": _unique_bytes([run.path]), "why": "older than the policy keeps"})  # fmt: skip
        for reg in self.registered:
            label = f"{reg.model} v{reg.version}" + (f" @{','.join(reg.aliases)}" if reg.aliases else "")
            outs = ", ".join(sorted(Path(p).name for p in reg.hashes)) or "no DVC lineage recorded"
            rows.append({"what": "model", "name": label, "action": "keep", "bytes": None,
                         "why": f"registered (run {reg.run_id or '?'}): keeps {outs}"})  # fmt: skip
        for lease in self.active:
            rows.append(
                {
                    "what": "lease",
                    "name": lease.get("run_id", "?"),
                    "action": "keep",
                    "bytes": None,
                    "why": f"in progress (pid {lease.get('pid')} on {lease.get('host')}, {lease.get('user')})",
                }
            )
        if self.removed_objects:
            n = len(self.removed_objects)
            rows.append(
                {
                    "what": "cache",
                    "name": f"{n} objects",
                    "action": "remove",
                    "bytes": None,
                    "why": "referenced by no kept run, registered model, run in progress or the project",
                }
            )
        if self.removed_entries:
            rows.append({"what": "run-cache", "name": f"{len(self.removed_entries)} entries", "action": "remove",
                         "bytes": None, "why": "they name outputs that are removed"})  # fmt: skip
        return rows

    def summary(self) -> dict[str, Any]:
        return {
            "cache": str(self.cache.dir),
            "runs_kept": [r.run_id for r, _ in self.kept_runs],
            "runs_removed": [r.run_id for r in self.removed_runs],
            "objects_kept": len(self.kept_objects),
            "objects_removed": len(self.removed_objects),
            "run_cache_entries_removed": len(self.removed_entries),
            "run_cache_entries_kept": self.kept_entries,
            "registered_versions": [f"{r.model}/{r.version}" for r in self.registered],
            "in_progress": [a.get("run_id") for a in self.active],
            "frees_bytes": self.frees_bytes,
        }


def _unique_bytes(paths: Iterable[Path], extra_links: dict[tuple[int, int], int] | None = None) -> int:
    """Bytes freed by removing every file under `paths` (+ `extra_links`: `{inode: links removed elsewhere}`):
    the inodes whose every link is among them."""
    seen: dict[tuple[int, int], list[int]] = {}  # inode -> [links here, nlink, size]
    for base in paths:
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                entry = seen.setdefault(key, [0, st.st_nlink, st.st_size])
                entry[0] += 1
    for key, n in (extra_links or {}).items():
        if key in seen:
            seen[key][0] += n
    return sum(size for here, nlink, size in seen.values() if here >= nlink)


def plan(
    root: Path,
    keep_last: int | None,
    keep_days: float | None,
    registry: Callable[[], list[Registered]] | None,
    now: float | None = None,
) -> Plan:
    """Decide what gc keeps and removes (module docstring). `registry`: returns the registered versions'
    lineage (`registry_lineage` on the project's MLflow client); None only for a project without a registry
    (tests). Raises when the registry cannot be read."""
    root = Path(root).resolve()
    cache = read_config(root)
    now = time.time() if now is None else now
    p = Plan(cache=cache, started=now)
    p.active = active_leases(cache, root)
    active_ids = {a.get("run_id") for a in p.active}
    p.registered = registry() if registry is not None else []
    runs = list_runs(root)
    newest = {r.run_id for r in runs[-keep_last:]} if keep_last else set()
    for run in runs:
        why = []
        if run.run_id in active_ids:
            why.append("in progress (leased)")
        if run.run_id in newest:
            why.append(f"one of the {keep_last} newest")
        if keep_days is not None and now - run.created < keep_days * 86400:
            why.append(f"younger than {keep_days:g} days")
        if keep_last is None and keep_days is None:
            why.append("no policy given (--keep-last / --keep-days)")
        if why:
            p.kept_runs.append((run, "; ".join(why)))
        else:
            p.removed_runs.append(run)

    def keep(hashes: Iterable[str], why: str) -> None:
        for h in hashes:
            p.keep_reasons.setdefault(h, []).append(why)

    for run, _ in p.kept_runs:
        keep(run.hashes.values(), f"run {run.run_id}")
    keep((h for outs in lock_hashes(root / "dvc.lock").values() for _, h in outs), "the project's dvc.lock")
    for reg in p.registered:
        keep(reg.hashes.values(), f"{reg.model} v{reg.version}")
    for lease in p.active:  # a run of another clone sharing the cache: its workspace's lock
        ws = Path(lease.get("workspace", ""))
        keep(
            (h for outs in lock_hashes(ws / "dvc.lock").values() for _, h in outs),
            f"run {lease.get('run_id')}",
        )
    p.kept_objects = expand(cache, p.keep_reasons)
    objects = cache_objects(cache)
    removed_links: dict[tuple[int, int], int] = {}
    for md5, path in objects.items():
        if md5 in p.kept_objects:
            continue
        try:
            st = path.stat()
        except OSError:
            continue
        if (
            now - st.st_ctime < grace_s()
        ):  # linked or written during the last minutes: maybe a running stage's
            p.kept_objects.add(md5)
            continue
        p.removed_objects[md5] = path
        removed_links[(st.st_dev, st.st_ino)] = removed_links.get((st.st_dev, st.st_ino), 0) + 1
    for entry, outs in run_cache_entries(cache).items():
        if outs & p.removed_objects.keys() or any(o not in objects for o in outs):
            p.removed_entries.append(entry)
        else:
            p.kept_entries += 1
    p.frees_bytes = _unique_bytes([r.path for r in p.removed_runs], removed_links) + sum(
        _object_only_bytes(path, removed_links) for path in p.removed_objects.values()
    )
    return p


def _object_only_bytes(path: Path, removed_links: dict[tuple[int, int], int]) -> int:
    """An object's bytes when its only links are the cache's (counted once by `_unique_bytes` otherwise)."""
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_size if st.st_nlink == 1 else 0


# ------------------------------------------------------------------------------------------ collect


@dataclass
class Collected:
    runs: list[str] = field(default_factory=list)
    objects: int = 0
    entries: int = 0
    skipped: list[str] = field(default_factory=list)
    freed_bytes: int = 0


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _remove_tree(root: Path, path: Path) -> None:
    """A run workspace: `git worktree remove --force` when git knows it, else removed; read-only files too."""
    if (path / ".git").is_file():
        r = subprocess.run(
            ["git", "worktree", "remove", "--force", "--force", str(path)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if r.returncode == 0 and not path.exists():
            return
    shutil.rmtree(path)


def collect(root: Path, p: Plan, echo: Callable[[str], None] = lambda s: None) -> Collected:
    """Remove what plan `p` removes, in the safe order (module docstring), under the gc lock, re-reading the
    leases first: a run that started since the plan keeps its workspace and what its lock names."""
    root = Path(root).resolve()
    done = Collected()
    before = _free_bytes(p.cache.dir)
    with gc_lock(p.cache):
        active = active_leases(p.cache, root)
        new_ids = {a.get("run_id") for a in active}
        protect: set[str] = set()
        for lease in active:
            ws = Path(lease.get("workspace", ""))
            protect |= expand(p.cache, (h for outs in lock_hashes(ws / "dvc.lock").values() for _, h in outs))
        for entry in p.removed_entries:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                done.entries += 1
        for run in p.removed_runs:
            if run.run_id in new_ids:
                done.skipped.append(f"{run.run_id}: a run in progress holds it now")
                continue
            _remove_tree(root, run.path)
            done.runs.append(run.run_id)
            echo(f"removed run {run.run_id}")
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True)
        ordered = sorted(p.removed_objects.items(), key=lambda kv: not kv[0].endswith(".dir"))
        for md5, path in ordered:
            if md5 in protect:
                done.skipped.append(f"{md5}: named by a run that started after the plan")
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                done.objects += 1
        for sub in p.cache.files.iterdir() if p.cache.files.is_dir() else []:
            with contextlib.suppress(OSError):
                sub.rmdir()  # only when empty
        for sub in p.cache.runs.glob("*/*") if p.cache.runs.is_dir() else []:
            with contextlib.suppress(OSError):
                sub.rmdir()
    done.freed_bytes = max(_free_bytes(p.cache.dir) - before, 0)
    return done


# --------------------------------------------------------------------------------------------- disk


def disk_usage(root: Path) -> dict[str, Any]:
    """What the project costs on disk: per run (apparent bytes, bytes only it holds, user), per stage (cache
    bytes of the objects its outputs name, counted once), per user (run workspaces' own bytes + cache objects
    by file owner), the cache and the project's other state. Sizes per inode (a link is counted once)."""
    root = Path(root).resolve()
    cache = read_config(root)
    runs = list_runs(root)
    objects = cache_objects(cache)
    out: dict[str, Any] = {"cache": str(cache.dir), "runs": [], "stages": {}, "users": {}}
    seen: set[tuple[int, int]] = set()
    for run in runs:
        apparent, own = 0, 0
        for dirpath, _dirs, files in os.walk(run.path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                apparent += st.st_size
                if st.st_nlink == 1:
                    own += st.st_size
        out["runs"].append({"run_id": run.run_id, "user": run.user, "created": run.created,
                            "apparent_bytes": apparent, "own_bytes": own, "stages": sorted(run.stages)})  # fmt: skip
        out["users"].setdefault(run.user, {"run_bytes": 0, "cache_bytes": 0, "runs": 0})
        out["users"][run.user]["run_bytes"] += own
        out["users"][run.user]["runs"] += 1
    stage_objs: dict[str, set[str]] = {}
    for run in runs:
        for stage, hashes in run.stages.items():
            stage_objs.setdefault(stage, set()).update(hashes)
    for stage, lock in lock_hashes(root / "dvc.lock").items():
        stage_objs.setdefault(stage, set()).update(h for _, h in lock)
    for stage, hashes in stage_objs.items():
        total = 0
        stage_seen: set[tuple[int, int]] = set()
        for h in expand(cache, hashes):
            path = objects.get(h)
            if path is None:
                continue
            st = path.stat()
            if (st.st_dev, st.st_ino) not in stage_seen:
                stage_seen.add((st.st_dev, st.st_ino))
                total += st.st_size
        out["stages"][stage] = {"cache_bytes": total, "objects": len(stage_seen)}
    cache_total = 0
    for path in objects.values():
        st = path.stat()
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        cache_total += st.st_size
        user = _user(st.st_uid)
        out["users"].setdefault(user, {"run_bytes": 0, "cache_bytes": 0, "runs": 0})
        out["users"][user]["cache_bytes"] += st.st_size
    out["cache_bytes"] = cache_total
    out["cache_objects"] = len(objects)
    out["run_cache_entries"] = len(run_cache_entries(cache))
    out["in_progress"] = active_leases(cache, root)
    return out
