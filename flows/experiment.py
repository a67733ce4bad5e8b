"""A finished run as DVC sees it: a DVC experiment of the project, and its outputs at the project's paths.

`save_experiment(ws, name)` (a git workspace, `flows.workspace`): `dvc exp save -n <name>` inside the run's
worktree. The experiment commit (parent: the workspace's baseline = the project's HEAD when the run started)
holds the run's params.yaml, dvc.lock, the uncached metrics and plots files, and the project's uncommitted
code the run used; its ref (`refs/exps/<baseline>/<name>`) lands in the project's own repository (a worktree
shares refs), so at the project root

    dvc exp show                      lists every `factory run` by name: params + headline metrics
    dvc exp diff A B / dvc metrics diff A B / dvc params diff A B / dvc plots diff A B
    dvc exp apply NAME                brings a run's params, dvc.lock and outputs (from the shared cache)

Saves are serialized by a lock in the git directory: DVC's experiment executor keeps a few refs of its own
(`refs/exps/exec/*`) that two saves at the same moment would race on. A name already taken on that baseline
gets the run id's suffix. A project without a git commit (copy workspace) has no experiments: the summary
says how to get them.

`checkout_outputs(ws)`: links every output of the run's dvc.lock to the same path under the project root
(hard links to the workspace's files, which are DVC's links into its cache: no second copy, read-only as DVC
protects them; a symlink stays a symlink; a copy only where links are impossible; each replaced atomically, under a lock, so two runs finishing together leave one whole run's files, never
a mix within a directory) and merges the run's stages into the project's dvc.lock, so a follow-up command on
its defaults (`factory evaluate`, `factory data show artifacts/data/raw/synth 000001`, `dvc status`...)
finds this run's files. params.yaml and the code are left as they are (unlike `dvc exp apply`, which also
writes the run's params.yaml: use it when that is what you want).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flows.workspace import Workspace, _git

LOCK_NAME = "pfactory-exp-save.lock"
CHECKOUT_LOCK = Path("artifacts") / ".state" / "checkout.lock"
_REF_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive `fcntl.lockf` on `path` (created), released on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def exp_ref(baseline: str, name: str) -> str:
    """DVC's ref of experiment `name` on `baseline` (dvc.repo.experiments.refs.ExpRefInfo)."""
    return f"refs/exps/{baseline[:2]}/{baseline[2:]}/{name}"


def experiment_name(ws: Workspace, name: str | None) -> str:
    """`name` (else the run id) as a valid experiment name not yet used on the baseline."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", name or ws.run_id).strip("-.") or ws.run_id
    if not _REF_OK.match(base) or base.endswith(".lock"):
        base = ws.run_id
    candidates = [base, f"{base}-{ws.run_id.rsplit('-', 1)[-1]}", ws.run_id]
    for cand in candidates:
        if not _ref_exists(ws.root, exp_ref(str(ws.baseline), cand)):
            return cand
    raise FileExistsError(f"experiment names {candidates} are all taken on {ws.baseline}")


def _ref_exists(root: Path, ref: str) -> bool:
    try:
        _git(root, "show-ref", "--verify", "--quiet", ref)
    except subprocess.CalledProcessError:
        return False
    return True


def uncached_outputs(ws: Workspace) -> list[str]:
    """Paths (relative to the workspace) of the stage outputs DVC does not cache (`cache: false` metrics and
    plots): git keeps them, so the experiment commit must include them (`dvc exp save -I`)."""
    from dvc.repo import Repo

    with Repo(str(ws.path)) as repo:
        outs = [o for o in repo.index.outs if not o.use_cache]
        paths = [os.path.relpath(o.fs_path, ws.path) for o in outs]
    return sorted(p for p in paths if (ws.path / p).exists() and not p.startswith(".."))


def _default_git_identity(root: Path) -> None:
    """`dvc exp save` commits: on a machine where git has no user identity (a fresh account, CI), use a
    neutral one for the experiment commits instead of failing a finished run. The user's own setting wins."""
    import subprocess

    for key, env_name, env_mail in (("user.name", "GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"),):
        have = subprocess.run(["git", "-C", str(root), "config", key], capture_output=True, text=True).stdout
        if not have.strip() and not os.environ.get(env_name):
            os.environ.setdefault(env_name, "factory run")
            os.environ.setdefault(env_mail, "factory run")
    have = subprocess.run(["git", "-C", str(root), "config", "user.email"], capture_output=True, text=True).stdout
    if not have.strip() and not os.environ.get("GIT_AUTHOR_EMAIL") and not os.environ.get("EMAIL"):
        os.environ.setdefault("GIT_AUTHOR_EMAIL", "factory@localhost")
        os.environ.setdefault("GIT_COMMITTER_EMAIL", "factory@localhost")


def save_experiment(ws: Workspace, name: str | None, stages: list[str] | None = None) -> dict[str, Any] | None:
    """Record the finished run `ws` as a DVC experiment (module docstring); None for a copy workspace.
    `stages`: the stages a partial run (`factory run --until`) ran; the experiment commits only those
    (`dvc exp save <stage> ...`: the later stages' outputs do not exist). None: every stage.
    Returns `{"name", "rev", "baseline", "ref"}`."""
    if ws.mode != "git" or ws.baseline is None:
        return None
    include = [*uncached_outputs(ws), *ws.untracked]
    git_dir = Path(_git(ws.root, "rev-parse", "--git-common-dir").strip())
    if not git_dir.is_absolute():
        git_dir = (ws.root / git_dir).resolve()
    _default_git_identity(ws.root)
    with file_lock(git_dir / LOCK_NAME):
        exp = experiment_name(ws, name)
        args = ["exp", "save", "-n", exp, "-m", f"factory run {ws.run_id}"]
        for p in include:
            args += ["-I", p]
        ws.dvc(*args, *(stages or []), log_name="experiment")
    ref = exp_ref(ws.baseline, exp)
    rev = _git(ws.root, "rev-parse", ref).strip()
    return {"name": exp, "rev": rev, "baseline": ws.baseline, "ref": ref}


def experiment_tags(ws: Workspace, exp: dict[str, Any] | None) -> dict[str, str]:
    """The parent MLflow run's tags naming the DVC experiment (or why there is none)."""
    if exp is None:
        return {"dvc.workspace": ws.mode, "dvc.experiment": "none (the project has no git commit)"}
    return {
        "dvc.workspace": ws.mode,
        "dvc.experiment": exp["name"],
        "dvc.experiment.rev": exp["rev"],
        "dvc.baseline": exp["baseline"],
    }


def _lock_outs(ws: Workspace) -> list[tuple[str, str]]:
    """(stage, out path) of every output in the workspace's dvc.lock."""
    stages = (ws.lock().get("stages") or {}).items()
    return [(name, o["path"]) for name, stage in stages for o in stage.get("outs", [])]


def checkout_outputs(ws: Workspace) -> list[str]:
    """Link the run's outputs to the project root and merge its dvc.lock there (module docstring). Returns the
    output paths brought (relative to the root)."""
    import yaml

    from pfactory.storage.dag import load_yaml
    from pfactory.storage.dvccache import link_or_copy
    from pfactory.storage.fsutil import (
        OutputRefused,
        atomic_directory,
        atomic_write_text,
        remove_stale_temps,
        temp_sibling,
    )

    lock = ws.lock()
    if not lock.get("stages"):
        return []
    brought: list[str] = []
    with file_lock(ws.root / CHECKOUT_LOCK):
        for stage, rel in _lock_outs(ws):
            if os.path.isabs(rel) or rel.startswith(".."):
                continue  # outside the workspace: the same file for the root already
            src, dst = ws.path / rel, ws.root / rel
            if src.is_dir():
                try:  # the root's copy is that stage's output (its marker): replaced, else left alone
                    with atomic_directory(dst, stage=stage) as tmp:
                        shutil.copytree(src, tmp, dirs_exist_ok=True, symlinks=True, copy_function=link_or_copy)
                except OutputRefused:
                    continue  # a directory of the user's own at that path: never overwritten
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                remove_stale_temps(dst)  # a checkout killed between the link and the rename
                tmp_file = temp_sibling(dst)
                try:
                    link_or_copy(src, tmp_file)
                    os.replace(tmp_file, dst)
                except BaseException:
                    tmp_file.unlink(missing_ok=True)
                    raise
            else:
                continue
            brought.append(rel)
        root_lock_path = ws.root / "dvc.lock"
        root_lock = load_yaml(root_lock_path.read_text()) if root_lock_path.is_file() else None
        merged = dict(root_lock or {"schema": lock.get("schema", "2.0")})
        merged["stages"] = {**(merged.get("stages") or {}), **lock["stages"]}
        atomic_write_text(root_lock_path, yaml.safe_dump(merged, sort_keys=False))
    return brought
