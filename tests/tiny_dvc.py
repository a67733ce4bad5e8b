"""A tiny factory-shaped DVC project for the cache, link and retention tests: seconds, not a pipeline.

A git repository with the factory's own params.yaml shape (one real section, `synth.frames`, read by the
stages) and a two-stage dvc.yaml whose commands are one-line Python: `data` writes a directory of
`synth.frames` files of 256 KiB (a 'dataset'), `model` reads it and writes one file (a 'model'). Run
workspaces are made by the factory's own `flows.workspace.create_workspace` and reproduced with `dvc repro`,
as `factory run` does, without Prefect or MLflow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.flows.pipeline_project import clean_env

FILE_BYTES = 256 * 1024
DVC_YAML = """stages:
  data:
    cmd: python -c "import os,yaml,hashlib; n=yaml.safe_load(open('params.yaml'))['synth']['frames']; os.makedirs('artifacts/data', exist_ok=True); [open(f'artifacts/data/{i}.bin','wb').write(hashlib.sha256(f'{n}-{i}'.encode()).digest()*8192) for i in range(n)]; import pfactory.runtime.failures as f; f.write_outcome(f.stage_outcome('data', None))"
    params:
      - synth.frames
    outs:
      - artifacts/data
  model:
    cmd: python -c "import os,glob,hashlib; h=hashlib.sha256(b''.join(open(p,'rb').read() for p in sorted(glob.glob('artifacts/data/*.bin')))).digest(); os.makedirs('artifacts/model', exist_ok=True); open('artifacts/model/model.pt','wb').write(h*32768); import pfactory.runtime.failures as f; f.write_outcome(f.stage_outcome('model', None))"
    deps:
      - artifacts/data
    outs:
      - artifacts/model/model.pt
"""
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def env() -> dict[str, str]:
    return {**clean_env(Path.cwd()), **GIT_ENV, "DVC_NO_ANALYTICS": "1"}


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, env=env(), check=True, capture_output=True, text=True
    ).stdout


def dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=root, env=env(), capture_output=True, text=True
    )
    if check and r.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)}: {r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    return r


def make(root: Path, frames: int = 3) -> Path:
    """The project at `root` (created), committed; returns it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(f"synth:\n  frames: {frames}\n")
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / ".gitignore").write_text("/artifacts/*\n")
    (root / ".dvcignore").write_text("artifacts/runs/\n")
    git(root, "init", "-q")
    dvc(root, "init", "-q")
    dvc(root, "config", "core.analytics", "false")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "tiny")
    return root


def run(
    root: Path, run_id: str, overrides: list[str] | None = None, stages: tuple[str, ...] = ("data", "model")
):
    """A run as `factory run` makes it: the workspace (`create_workspace`), `dvc repro` per stage. Returns
    (workspace, {stage: how})."""
    from flows.params import load_params
    from flows.workspace import create_workspace

    params = load_params(root / "params.yaml", overrides or [])
    old = dict(os.environ)
    os.environ.update(GIT_ENV)
    try:
        ws = create_workspace(root, params, run_id, overrides or [])
        how = {s: ws.repro(s)["how"] for s in stages}
    finally:
        os.environ.clear()
        os.environ.update(old)
    return ws, how


def du(path: Path) -> int:
    """`du -sb --exclude=.git`: bytes on disk the way the issue measures them (a hard link counted once)."""
    out = subprocess.run(
        ["du", "-sb", "--exclude=.git", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])
