"""Deterministic outputs: two identical `factory prepare` runs over the same faulty dataset write the same
bytes (manifest.json, rejected.jsonl, every shard), and `factory data check --json` the same report (its timings aside).

The hostile probe found a refusal reason embedding a memory address (PIL's `cannot identify image file
<_io.BytesIO object at 0x...>`), so rejected.jsonl, manifest.json and the prepared hash changed from one run
to the next. Here several refusals whose text comes from a decoder or a parser (a wrong magic, a truncated
image, bytes that are not UTF-8, a table that is not JSON) are planted in one copy, each in its own frame.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from tests.faults.conftest import CORPUS_PREPARE, copy_dataset, factory
from tests.faults.corpus import CASES, Planted

PLANTED = (
    "kitti/image-wrong-magic",
    "kitti/image-truncated",
    "kitti/calib-not-utf8",
    "kitti/label-not-utf8",
    "kitti/lidar-length-not-multiple-of-16",
)
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def _digests(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def _untimed(doc: object) -> object:
    """A check report without its timings (`seconds`: wall time, never deterministic)."""
    if isinstance(doc, dict):
        return {k: _untimed(v) for k, v in doc.items() if k != "seconds"}
    if isinstance(doc, list):
        return [_untimed(v) for v in doc]
    return doc


def test_identical_runs_write_identical_bytes(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    from pfactory.sensors.datasets import open_dataset

    root = copy_dataset(clean_kitti, tmp_path / "raw")
    ids = open_dataset(root).frame_ids()
    cases = {c.name: c for c in CASES}
    for i, name in enumerate(PLANTED, start=1):
        cases[name].plant(Planted(root, "kitti", ids[i], ids))

    runs = []
    for k in (1, 2):
        out = tmp_path / f"prepared{k}"
        r = factory("prepare", "--raw", str(root), "--out", str(out), *CORPUS_PREPARE)
        assert r.code == 0, r.text
        c = factory("data", "check", str(root), "--json", *CORPUS_PREPARE)  # the report as JSON on stdout
        assert c.code == 1, c.text
        runs.append((_digests(out), _untimed(json.loads(c.out)), out))

    (d1, c1, out1), (d2, c2, _) = runs
    differ = sorted(k for k in set(d1) | set(d2) if d1.get(k) != d2.get(k))
    rejected = [json.loads(line) for line in (out1 / "rejected.jsonl").read_text().splitlines()]
    addresses = [r["reason"] for r in rejected if ADDRESS.search(r["reason"])]
    failures = []
    if differ:
        failures.append(f"files differ between two identical prepare runs: {differ}")
    if c1 != c2:
        failures.append("data check --json differs between two identical runs (timings aside)")
    if addresses:
        failures.append(f"reasons embed memory addresses: {addresses}")
    if len(rejected) != len(PLANTED):
        failures.append(f"expected {len(PLANTED)} refusals, got {[r['frame_id'] for r in rejected]}")
    ledger.record(
        "determinism",
        f"prepare twice over {len(PLANTED)} planted decoder/parser faults",
        not failures,
        lost=len(differ),
        detail=f"{len(d1)} files byte-identical, check report identical, {len(rejected)} refusals, no address"
        if not failures
        else "; ".join(failures)[:200],
    )
    assert not failures, "\n".join(failures)
