"""pfactory.train.runtime: the CPU malloc tuning of a training process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pfactory.train.runtime import tune_malloc


def test_tune_malloc_steps_aside_for_the_users_own_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert tune_malloc() is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_malloc_applies_on_glibc_in_a_fresh_process() -> None:
    """mallopt accepts both values (each must fit a C int: a 4 GiB trim threshold would wrap). Its effect,
    fewer page faults per training step, is measured by the benchmark, not here (docs/MODEL.md)."""
    code = "from pfactory.train.runtime import tune_malloc; print(tune_malloc())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
