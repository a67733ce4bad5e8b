"""Every case of the bad-input corpus (tests/faults/corpus.py), planted in a copy of a clean dataset, through
`factory data check` and `factory prepare` (the console-script entry, in this process).

Demanded for each case (see corpus.py): check and prepare agree, name the file and field, refuse exactly
the victim frame (prepare keeps every other frame: none lost, none wrongly kept), print no traceback; valid
variants are accepted, converted images decode to the same pixels as their reference.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.faults.conftest import CORPUS_PREPARE, copy_dataset, factory, one_line_error
from tests.faults.corpus import CASES, Case, Planted

PREPARE = CORPUS_PREPARE


def _plant(case: Case, clean: Path, dst: Path) -> Planted:
    root = copy_dataset(clean, dst)
    from pfactory.sensors.datasets import open_dataset

    ids = open_dataset(root).frame_ids()
    p = Planted(root, case.layout, ids[1], ids)
    case.plant(p)
    return p


def _expected_file(case: Case, p: Planted) -> str:
    f = case.file.replace("{fid}", p.fid)
    if "{int}" in f:
        f = f.replace("{int}", str(int(p.fid)))
    for channel in ("LIDAR_TOP", "CAM_FRONT"):
        if "{" + channel + "}" in f:
            from pfactory.sensors.datasets import open_dataset

            sd = open_dataset(p.root).sample_data(p.fid)[channel]  # type: ignore[attr-defined]
            f = f.replace("{" + channel + "}", sd["filename"])
    return f


def _frame_ids(root: Path) -> list[str]:
    from pfactory.sensors.datasets import open_dataset

    return open_dataset(root).check_ids()


def _kept(out: Path) -> list[str]:
    """Frame ids in the prepared shards, sorted."""
    ids: list[str] = []
    for f in sorted(out.glob("*/shard-*.parquet")):
        ids += pq.read_table(f, columns=["frame_id"]).column("frame_id").to_pylist()
    return sorted(ids)


def _images(out: Path, fid: str) -> bytes:
    for f in sorted(out.glob("*/shard-*.parquet")):
        t = pq.read_table(f)
        rows = t.column("frame_id").to_pylist()
        if fid in rows:
            i = rows.index(fid)
            return repr(t.column("cam_image")[i].as_py()).encode()
    raise KeyError(fid)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, clean_kitti: Path, clean_nuscenes: Path, tmp_path: Path, ledger) -> None:
    t0 = time.perf_counter()
    clean = clean_kitti if case.layout == "kitti" else clean_nuscenes
    p = _plant(case, clean, tmp_path / "data")
    klass = f"input/{case.layout}"
    failures: list[str] = []
    lost = 0

    check = factory("data", "check", str(p.root), "--json", *PREPARE)  # the report as JSON on stdout
    if "Traceback" in check.text or check.code == -1:
        failures.append(f"data check crashed: {check.err[-800:]}")
    report = json.loads(check.out) if check.out.lstrip().startswith("{") else None
    out = tmp_path / "prepared"
    prep = factory("prepare", "--raw", str(p.root), "--out", str(out), *PREPARE)
    if "Traceback" in prep.text or prep.code == -1:
        failures.append(f"prepare crashed: {prep.err[-800:]}")

    if case.outcome == "dataset":
        want = case.file
        if (
            check.code != 1
            or report is None
            or not any(
                q["file"].endswith(want) and case.field in q["field"] and case.words in q["reason"]
                for q in report["problems"]
            )
        ):
            failures.append(f"data check did not name {want}/{case.field}: {check.text[-600:]}")
        if not one_line_error(prep) or want not in prep.err:
            failures.append(
                f"prepare did not refuse the dataset in one line naming {want}: {prep.text[-600:]}"
            )
        if out.exists():
            failures.append("prepare wrote an output for an unreadable dataset")
        detail = prep.err.strip().splitlines()[-1] if prep.err.strip() else ""
    elif case.outcome == "accept":
        if check.code != 0:
            failures.append(f"data check refused a valid variant: {check.text[-600:]}")
        if prep.code != 0:
            failures.append(f"prepare failed on a valid variant: {prep.text[-600:]}")
        else:
            kept = _kept(out)
            lost = len(set(p.frame_ids) ^ set(kept))
            if lost:
                failures.append(f"frames kept {kept}, expected all of {p.frame_ids}")
            if case.reference is not None:
                ref = _plant(Case(case.name, case.layout, case.reference), clean, tmp_path / "ref")
                ref_out = tmp_path / "ref-prepared"
                r = factory("prepare", "--raw", str(ref.root), "--out", str(ref_out), *PREPARE)
                assert r.code == 0, r.text
                if _images(out, p.fid) != _images(ref_out, p.fid):
                    failures.append("the converted image differs from its reference: mis-decoded")
                    lost += 1
        detail = "accepted" + (", pixels equal to the reference" if case.reference and not failures else "")
    else:
        want = _expected_file(case, p)
        problems = report["problems"] if report else []
        bad = {q["frame_id"] for q in problems}
        named = [q for q in problems if q["file"].endswith(want) and case.field in q["field"]
                 and case.words in q["reason"]]  # fmt: skip
        if check.code != 1 or not named:
            failures.append(
                f"data check did not name {want} / {case.field!r} / {case.words!r}: {check.text[-900:]}"
            )
        planted = set(_frame_ids(p.root)) - set(p.frame_ids)  # frames the planting created (stray files)
        if bad - {p.fid} - planted:
            failures.append(f"data check also blamed frames {sorted(bad - {p.fid} - planted)}")
        rejected_path = out / "rejected.jsonl"
        if prep.code != 0 or not rejected_path.is_file():
            failures.append(f"prepare did not finish: {prep.text[-600:]}")
        else:
            rejected = [json.loads(line) for line in rejected_path.read_text().splitlines()]
            mine = [r for r in rejected if r["frame_id"] == p.fid]
            if (
                {r["frame_id"] for r in rejected} - {p.fid} - planted
                or not mine
                or not (mine[0]["file"].endswith(want) and case.field in mine[0]["reason"])
            ):
                failures.append(f"prepare refused {rejected}, expected {p.fid} for {want} / {case.field!r}")
            kept = _kept(out)
            expected = sorted(set(p.frame_ids) - {p.fid})
            lost = len(set(kept) ^ set(expected))
            if lost:
                failures.append(f"prepare kept {kept}, expected {expected}")
        detail = f"{named[0]['field']}: {named[0]['reason']}" if named else ""
    ledger.record(klass, case.name, survived=not failures, lost=lost, detail=detail[:200],
                  seconds=time.perf_counter() - t0)  # fmt: skip
    assert not failures, "\n".join(failures)


def test_corpus_size() -> None:
    """The issue's floor: at least 40 distinct corrupt or hostile inputs across both layouts."""
    refused = [c for c in CASES if c.outcome != "accept"]
    assert len(refused) >= 40, len(refused)
    assert {c.layout for c in refused} == {"kitti", "nuscenes"}
