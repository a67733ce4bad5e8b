"""Write the installed Prefect version's schema snapshot (flows/prefect_schema/prefect-<version>.sql).

A fresh `factory run` creates Prefect's local database from it instead of running Prefect's ~150 migrations
(`flows.startup.seed_prefect_database`). Run after upgrading Prefect; a version without a snapshot still works,
its first start migrates as before. tests/flows/test_startup.py checks the snapshot against the migrations.

Run: python scripts/prefect_schema.py
"""

from __future__ import annotations

import tempfile
from importlib.metadata import version
from pathlib import Path

from flows.startup import PREFECT_SCHEMA_DIR, migrated_schema_dump
from pfactory.storage.fsutil import atomic_write_text


def main() -> Path:
    with tempfile.TemporaryDirectory(prefix="prefect-schema-") as tmp:
        dump = migrated_schema_dump(Path(tmp))
    out = PREFECT_SCHEMA_DIR / f"prefect-{version('prefect')}.sql"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, dump)
    print(f"{out}: {len(dump.splitlines())} lines")
    return out


if __name__ == "__main__":
    main()
