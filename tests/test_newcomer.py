"""The README's first command as a newcomer meets it: a fresh clone, no state, a slower machine.

What happened on a fresh 2-core machine (issue 12): the first `factory run` died after 27 s with a
70-line traceback because Prefect's ephemeral server needed 42 s to create its database and Prefect waits
20 s. Every other test runs in a warm checkout, on this (fast) machine, and could not see it. This one:

- a fresh `git clone` of the repository under test into a temp dir (`tests.newcomer.fresh_clone`): no
  `artifacts/`, no Prefect home, no MLflow database, no DVC cache, a HOME of its own;
- the environment already installed for the suite (`sys.executable`): the README's install is a second
  ~4 GB `pip install` (2-4 min even from a warm pip cache) that does not fit CI's budget on top of the
  suite. `python -m factory.cli` from the clone's root puts the clone's code first on `sys.path`, and
  the stages import the run workspace's copy of it;
- `factory run` with small overrides, inside a CPU quota of `NEWCOMER_CPUS` of this machine's CPUs
  (cgroup, `tests.newcomer.cpu_quota`): what a 2-3x slower machine under load gives the run. Where the
  cgroup file system is not writable the run is not slowed, and the test says so (the message-level
  checks below still catch a missing first-start message or a traceback on the terminal);
- exit 0 on the first try, a champion alias in the clone's registry, the first-start messages on the
  terminal, and no traceback there.

Measured on the dev box: c0686b9 under the 1/3-CPU quota exits 1 after ~30 s ("Timed out while attempting
to connect to ephemeral Prefect API server"); docs/OPERATIONS.md, "First start".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.flows.pipeline_project import tiny_args
from tests.newcomer import cpu_quota, fresh_clone, is_git_checkout, newcomer_env

# Full tier (docs/TESTING.md): a whole run under a 1/3-CPU quota (~370 s); the default tier keeps the
# first-start messages checked by tests/flows (a fresh Prefect home in every project copy).
pytestmark = [pytest.mark.slow, pytest.mark.full]

# A third of one CPU of this machine: the machine started Prefect 3.2x slower than a quiet dev box
# (42 s vs 13 s). Override with PFACTORY_NEWCOMER_CPUS (0: no quota).
NEWCOMER_CPUS = float(os.environ.get("PFACTORY_NEWCOMER_CPUS", "0.33"))
RUN_TIMEOUT_S = 900


def _champion_version(clone: Path, model_name: str = "pfactory-detector") -> str | None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{clone / 'artifacts' / 'mlflow' / 'mlflow.db'}")
    try:
        return str(client.get_model_version_by_alias(model_name, "champion").version)
    except Exception:
        return None


@pytest.mark.skipif(
    not is_git_checkout(), reason="the newcomer test clones the repository: not a git checkout"
)
def test_fresh_clone_first_factory_run_passes_on_a_slower_machine(tmp_path: Path) -> None:
    clone = fresh_clone(tmp_path / "clone")
    for state in ("artifacts/mlflow", "artifacts/.state", "artifacts/runs", ".dvc/cache"):
        assert not (clone.path / state).exists(), f"{state} in a fresh clone"
    env = newcomer_env(tmp_path / "home")
    # 12 frames, 1 epoch: a model far below promote.min_map (0.3, what the default run's ~0.7 passes);
    # without the absolute mAP gate the candidate still goes through parity, latency and the registry.
    small = [*tiny_args(), "-S", "promote.min_map=0"]
    cmd = [sys.executable, "-m", "factory.cli", "run", *small, "--name", "newcomer"]
    with cpu_quota(NEWCOMER_CPUS) as quota:
        print(f"newcomer: clone of {clone.commit[:10]} (+{len(clone.dirty)} working-tree files); {quota.how}")
        t0 = time.perf_counter()
        r = subprocess.run(
            cmd,
            cwd=clone.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            preexec_fn=quota.preexec,
        )
        wall = time.perf_counter() - t0
    print(f"newcomer: exit {r.returncode} in {wall:.1f} s (load {os.getloadavg()[0]:.2f})")
    screen = f"exit {r.returncode} after {wall:.0f} s ({quota.how}); stderr:\n{r.stderr[-4000:]}"
    assert r.returncode == 0, screen
    assert "first run only: creating the local Prefect database" in r.stderr, screen
    assert "first run only: creating the local MLflow database" in r.stderr, screen
    assert "Traceback" not in r.stderr, screen  # library output goes to the run's log file
    runs = list((clone.path / "artifacts" / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "logs" / "prefect.log").is_file()
    promotion = json.loads((runs[0] / "artifacts" / "promotion.json").read_text())
    assert promotion["decision"] == "promoted", promotion
    assert _champion_version(clone.path) == str(promotion["version"]), "no champion alias in the registry"
    if not quota.applied:
        warnings.warn(
            f"the newcomer run passed, but not on an emulated slower machine: {quota.how}", stacklevel=1
        )
