"""pfactory.runtime.project: the environment every stage process inherits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD_BLAS_THREADS = """
import subprocess, sys
from pfactory.runtime.project import configure_environment
configure_environment(sys.argv[1])
probe = ("import numpy, threadpoolctl; print(max(i['num_threads'] for i in threadpoolctl.threadpool_info() "
         "if i['user_api'] == 'blas'))")
print(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip())
"""


def _stage_blas_threads(root: Path, **env: str) -> int:
    """BLAS threads of a process started after `configure_environment(root)` (as `dvc repro` starts a stage)."""
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD_BLAS_THREADS, str(root)],
        capture_output=True, text=True, check=True, timeout=120, env={**base, **env},
    )  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts one thread on a 1-core machine anyway")
def test_stage_processes_get_one_blas_thread_unless_the_user_chose(tmp_path: Path) -> None:
    assert _stage_blas_threads(tmp_path) == 1
    assert _stage_blas_threads(tmp_path, OPENBLAS_NUM_THREADS="2") == 2
