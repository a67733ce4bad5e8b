"""DVC cache faults (issue 32): a link target deleted behind the factory's back, a read-only shared cache, a
full disk during `factory gc`. On the tiny DVC project (tests/tiny_dvc.py): runs made by the factory's own
workspace code, seconds each.

- a cache object deleted (hardlinks: the workspace keeps its inode; symlinks: its link dangles): the next run
  with the same params recomputes the stage instead of failing, `factory disk` still reports, and gc drops
  the run-cache entry that named the missing object;
- a read-only shared cache (a read-only bind mount in a private mount namespace): `factory run` stops before
  anything starts, exit 2, one screen naming the cache and what to do; nothing ran, no workspace;
- a full disk (a tmpfs filled to the last byte): `factory gc --keep-last 1 --yes` still removes what it
  should (removing needs no space), frees the space, exit 0, and the kept run is intact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pfactory.storage import retention
from tests import tiny_dvc
from tests.faults.test_params_paths import _mount_tmpfs

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    return {**tiny_dvc.env(), "PYTHONPATH": str(REPO), **extra}


def _factory(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], cwd=root, env=env or _env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("link", ["hardlink", pytest.param("symlink", marks=pytest.mark.full)])
def test_a_cache_object_deleted_behind_the_factorys_back(tmp_path: Path, link: str, ledger) -> None:
    root = tiny_dvc.make(tmp_path / "p")
    tiny_dvc.dvc(root, "config", "--local", "cache.type", "hardlink" if link == "hardlink" else "symlink")
    ws, _ = tiny_dvc.run(root, "20261201T000000Z-a-000001")
    cache = retention.read_config(root)
    md5 = ws.out_hashes()["artifacts/model/model.pt"]
    model = ws.path / "artifacts/model/model.pt"
    expected = hashlib_bytes(ws.path / "artifacts/data")
    retention.object_path(cache, md5).unlink()  # the fault: someone cleaned the cache by hand
    if link == "hardlink":
        assert model.read_bytes() == expected, "a hard link keeps the bytes"
    else:
        assert model.is_symlink() and not model.exists(), "a symlink into the cache dangles"
    r = _factory(root, "disk", "--json")
    ok_disk = r.returncode == 0 and len(json.loads(r.stdout)["runs"]) == 1
    ws2, how = tiny_dvc.run(root, "20261201T000100Z-b-000002")
    ok_run = (
        how == {"data": "run-cache", "model": "ran"}
        and (ws2.path / "artifacts/model/model.pt").read_bytes() == expected
    )
    plan = retention.plan(root, keep_last=5, keep_days=None, registry=None)
    ok = ok_disk and ok_run and retention.object_path(cache, md5).is_file()
    ledger.record("infra", f"DVC cache: a {link}ed output's cache object deleted, then the same run again", ok,
                  detail=f"next run: {how}; disk exit {r.returncode}; gc plan keeps {len(plan.kept_objects)}")  # fmt: skip
    assert ok_disk, r.stderr[-2000:]
    assert ok_run, how
    assert retention.object_path(cache, md5).is_file(), "the recomputed stage put the object back"


def hashlib_bytes(data_dir: Path) -> bytes:
    """What the tiny project's model stage writes for `data_dir` (its cmd, in Python)."""
    import hashlib

    h = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(data_dir.glob("*.bin")))).digest()
    return h * 32768


def test_a_read_only_shared_cache_stops_factory_run_before_anything_starts(tmp_path: Path, ledger) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs unshare and root")
    shared = tmp_path / "team-cache"
    a = tiny_dvc.make(tmp_path / "alice")
    from pfactory.storage.dvccache import share_cache

    share_cache(a, shared)
    tiny_dvc.run(a, "20261201T000000Z-alice-000001")  # the team's cache has entries
    b = tiny_dvc.make(tmp_path / "bob")
    share_cache(b, shared)
    script = (
        f"mount --bind {shared} {shared} && mount -o remount,bind,ro {shared} && "
        f"exec {sys.executable} -m factory.cli run --name ro"
    )
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=b, env=_env(), capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    if "mount" in r.stderr and r.returncode != 2 and "not writable" not in r.stderr:
        pytest.skip(f"no read-only bind mount here: {r.stderr[-300:]}")
    runs = list((b / "artifacts" / "runs").glob("*")) if (b / "artifacts" / "runs").is_dir() else []
    ok = (
        r.returncode == 2
        and "Traceback" not in r.stdout + r.stderr
        and str(shared) in r.stderr
        and "not writable" in r.stderr
        and "cache.shared group" in r.stderr
        and not runs
    )
    ledger.record("infra", "DVC cache: a read-only shared cache, factory run", ok,
                  detail=(r.stderr.strip().splitlines() or [""])[0][:200])  # fmt: skip
    assert ok, (r.returncode, r.stdout[-1500:], r.stderr[-1500:], runs)


def test_a_full_disk_during_gc_still_frees_it(tmp_path: Path, ledger) -> None:
    mnt = tmp_path / "disk"
    if not _mount_tmpfs(mnt, "24m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        root = tiny_dvc.make(mnt / "p", frames=6)
        runs = {rid: tiny_dvc.run(root, rid, [f"synth.frames={n}"])[0] for rid, n in
                (("20261201T000000Z-a-000001", 6), ("20261201T010000Z-b-000002", 7), ("20261201T020000Z-c-000003", 8))}  # fmt: skip
        keep = runs["20261201T020000Z-c-000003"]
        kept_bytes = {p: p.read_bytes() for p in keep.path.joinpath("artifacts").rglob("*") if p.is_file()}
        filler = mnt / "filler"
        with open(filler, "wb", buffering=0) as f:  # fill the file system to the last byte
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
            try:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
            except OSError:
                pass
        free_before = shutil.disk_usage(mnt).free
        registry = tmp_path / "mlflow.db"  # the registry lives elsewhere (a server, another disk)
        r = _factory(root, "gc", "--keep-last", "1", "--yes", "--json",
                     env=_env(MLFLOW_TRACKING_URI=f"sqlite:///{registry}", PFACTORY_GC_GRACE_S="0"))  # fmt: skip
        free_after = shutil.disk_usage(mnt).free
        out = json.loads(r.stdout) if r.returncode == 0 else {}
        removed = (out.get("removed") or {}).get("runs", [])
        intact = all(p.read_bytes() == b for p, b in kept_bytes.items())
        ok = (
            r.returncode == 0
            and sorted(removed) == ["20261201T000000Z-a-000001", "20261201T010000Z-b-000002"]
            and free_after - free_before >= 2 * 6 * tiny_dvc.FILE_BYTES
            and intact
        )
        ledger.record("infra", "disk full: factory gc --keep-last 1 --yes on a full file system", ok,
                      detail=f"exit {r.returncode}; freed {(free_after - free_before) / 2**20:.1f} MiB")  # fmt: skip
        assert ok, (r.returncode, r.stderr[-2000:], removed, free_before, free_after, intact)
        filler.unlink()
        tiny_dvc.dvc(keep.path, "status")  # the kept run is whole as DVC sees it
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
