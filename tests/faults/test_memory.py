"""Memory stays bounded on hostile inputs: measured on the real console entry in a fresh process (peak
resident memory of its process tree, sampled every 20 ms).

- a 2 GB sparse file posing as a point cloud (it passed `data check` as OK using 4.7 GB): refused from its
  size, never read;
- a label of 19 lines x 10,000 (16 MB; prepare took 3.7 GB for a boxes x points matrix, 7 GB at x 20,000):
  refused from its object count.
The bound (1.5 GiB) is ~2x a clean run of the same command here; the figures go into the ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.faults.conftest import CORPUS_PREPARE, copy_dataset, factory_subprocess

BOUND_MIB = 1536
PREPARE = CORPUS_PREPARE


def _both(raw: Path, tmp_path: Path, victim: str, words: str) -> tuple[bool, str]:
    check, t_check, m_check = factory_subprocess("data", "check", str(raw), *PREPARE, timeout=300)
    prep, t_prep, m_prep = factory_subprocess(
        "prepare", "--raw", str(raw), "--out", str(tmp_path / "out"), *PREPARE, timeout=300
    )
    rejected = (tmp_path / "out" / "rejected.jsonl").read_text().splitlines() if prep.returncode == 0 else []
    refused = [json.loads(r)["frame_id"] for r in rejected]
    ok = check.returncode == 1 and words in check.stdout and prep.returncode == 0 and refused == [victim]
    ok = ok and max(m_check, m_prep) < BOUND_MIB and "Traceback" not in check.stderr + prep.stderr
    detail = (
        f"data check exit {check.returncode}, {t_check:.1f} s, peak {m_check:.0f} MiB; prepare refused {refused}, "
        f"{t_prep:.1f} s, peak {m_prep:.0f} MiB"
    )
    return ok, detail + (
        "" if ok else f"\n{check.stdout[-800:]}\n{check.stderr[-800:]}\n{prep.stderr[-800:]}"
    )


def test_sparse_2gb_point_file(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    raw = copy_dataset(clean_kitti, tmp_path / "raw")
    victim = "000001"
    with open(raw / "training" / "velodyne" / f"{victim}.bin", "r+b") as f:
        f.truncate(2 * 2**30)  # sparse: 2 GiB of zeros that take no disk
    ok, detail = _both(raw, tmp_path, victim, "at most 10000000 points")
    ledger.record(
        "input/memory", "2 GB sparse file posing as a point cloud", ok, detail=detail.splitlines()[0]
    )
    assert ok, detail


def test_label_with_190000_objects(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    raw = copy_dataset(clean_kitti, tmp_path / "raw")
    victim = "000001"
    label = raw / "training" / "label_2" / f"{victim}.txt"
    lines = label.read_text().splitlines()[:19]
    label.write_text("".join(line + "\n" for line in lines) * 10_000)
    ok, detail = _both(raw, tmp_path, victim, "at most 1000 objects")
    ledger.record("input/memory", f"label of {len(lines)} lines x 10,000 ({label.stat().st_size / 2**20:.0f} MB)", ok,
                  detail=detail.splitlines()[0])  # fmt: skip
    assert ok, detail
