"""pfactory.sensors.digest: a raw dataset's content digest, and the cache that spares evaluate a second read of
data that prepare has just read (`checked_source_digest`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.digest import (
    DIGEST_CACHE_ENV,
    checked_source_digest,
    listing_fingerprint,
    remember_digest,
    source_digest,
)
from tests.prepare.conftest import small_params


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """4 synthetic frames in the KITTI layout (208x64 images)."""
    from pfactory.synth.dataset import generate_dataset

    out = tmp_path_factory.mktemp("raw") / "synth"
    generate_dataset(out, frames=4, seed=5, cameras=1, image_size=(208, 64), workers=1)
    return out


def test_prepare_remembers_what_it_read_and_a_change_is_read_again(
    raw: Path, tmp_path: Path, monkeypatch
) -> None:
    from pfactory.prepare.stage import prepare_dataset

    cache = tmp_path / "digests"
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(cache))
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    prepare_dataset(copy, tmp_path / "prepared", small_params())
    recorded = json.loads((tmp_path / "prepared" / "manifest.json").read_text())["source"]["sha256"]
    assert len(list(cache.iterdir())) == 1

    assert checked_source_digest(open_dataset(copy)) == (recorded, False)  # no file read
    assert source_digest(open_dataset(copy)) == recorded  # what a read would have found

    label = copy / "training" / "label_2" / "000002.txt"
    label.write_text(label.read_text() + "DontCare -1 -1 -10 0 0 1 1 -1 -1 -1 -1000 -1000 -1000 -10\n")
    changed, read = checked_source_digest(open_dataset(copy))
    assert read and changed != recorded and changed == source_digest(open_dataset(copy))
    assert checked_source_digest(open_dataset(copy)) == (changed, False)  # remembered after that read

    (copy / "training" / "velodyne" / "000001.bin").unlink()  # a frame's file gone: another listing
    assert checked_source_digest(open_dataset(copy))[1] is True


def test_a_rewrite_with_a_new_mtime_but_the_same_size_is_read_again(
    raw: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "digests"))
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    before, read = checked_source_digest(open_dataset(copy))
    assert read
    points = copy / "training" / "velodyne" / "000003.bin"
    data = bytearray(points.read_bytes())
    data[0] ^= 0xFF
    st = points.stat()
    points.write_bytes(bytes(data))
    os.utime(points, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    after, read = checked_source_digest(open_dataset(copy))
    assert read and after != before


def test_no_cache_no_trust_and_a_bad_entry_is_ignored(raw: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(DIGEST_CACHE_ENV, raising=False)
    ds = open_dataset(raw)
    want = source_digest(ds)
    assert checked_source_digest(ds) == (want, True) and checked_source_digest(ds) == (want, True)

    cache = tmp_path / "digests"
    cache.mkdir()
    fingerprint = listing_fingerprint(ds)
    (cache / fingerprint).write_text("not a digest\n")
    assert checked_source_digest(ds, cache_dir=cache) == (want, True)
    assert remember_digest(fingerprint, "f" * 64, cache_dir=cache)  # a forged entry is what it says, though:
    assert checked_source_digest(ds, cache_dir=cache) == ("f" * 64, False)  # the cache is the project's own
