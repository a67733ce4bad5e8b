"""A small real flow with the pipeline flow's parameters, for the deployment tests.

The real pipeline takes minutes; the deployment machinery (`flows.deploy`: cron schedule,
serve, trigger, run in a subprocess) is the same for any flow, so the tests serve this one.
It records what it was called with in `<root>/ran.json` so a test can see the deployment's
default parameters arrive.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow

from pfactory.storage.fsutil import atomic_write_json


@flow(name="tiny-pipeline")
def tiny_pipeline(
    overrides: list[str] | None = None, name: str | None = None, root: str | None = None
) -> dict:
    """Returns (and writes to `<root>/ran.json` when `root` is given) its parameters and pid."""
    record = {"overrides": list(overrides or []), "name": name, "pid": os.getpid()}
    if root:
        atomic_write_json(Path(root) / "ran.json", record)
    return record
