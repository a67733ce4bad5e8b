"""`pfactory.team.slots.enabled` without the team's services: a stage of `factory run` whose flow found no
Prefect server (the local ephemeral API) knows it without importing Prefect; a server in the environment
still counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import json, sys; from pfactory.team import slots; print(json.dumps([slots.enabled(), 'prefect' in sys.modules]))"


def _probe(tmp_path: Path, **env: str) -> list[bool]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PFACTORY_"))}
    base["PREFECT_HOME"] = str(tmp_path / "prefect")  # no profile of this machine's user
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env}, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_stage_of_a_flow_without_a_server_does_not_import_prefect(tmp_path: Path) -> None:
    from pfactory.team.slots import NO_SERVER_ENV

    assert _probe(tmp_path, **{NO_SERVER_ENV: "1"}) == [False, False]
    assert _probe(tmp_path) == [False, True]  # without the flow's word: Prefect's settings are read
    # a server named in the environment wins over the flow's word (Prefect is asked)
    assert _probe(tmp_path, **{NO_SERVER_ENV: "1", "PREFECT_API_URL": "http://127.0.0.1:9/api"}) == [
        True,
        True,
    ]
