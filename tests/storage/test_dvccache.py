"""The project's DVC cache (pfactory/storage/dvccache.py) and run workspaces that link to it (flows/workspace.py):
outputs are links, not copies; a second run with the same params costs only its code checkout; a clone
pointed at another's cache with DVC's own settings restores from it and names the run that computed it; two
clones that share only an S3 remote (moto's server on 127.0.0.1) restore through `push` / `repro --pull`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pfactory.storage import dvccache
from tests import tiny_dvc
from tests.prepare.test_storage import BUCKET, s3  # noqa: F401 - the moto S3 server fixture (module scope)

pytestmark = pytest.mark.slow  # ~2 s of DVC per stage on 2 shared cores: ~1-2 min for the module


def test_choose_types_prefers_clones_then_hardlinks_and_never_lists_copy_after_a_link() -> None:
    # `copy` after a link type would stop DVC from relinking a directory output it just copied (dvccache doc)
    assert dvccache.choose_types(["reflink", "hardlink", "symlink"]) == ["reflink", "copy"]
    assert dvccache.choose_types(["hardlink", "symlink"]) == ["hardlink", "symlink"]
    assert dvccache.choose_types(["hardlink"]) == ["hardlink"]
    assert dvccache.choose_types(["symlink"]) == ["symlink"]
    assert dvccache.choose_types([]) == ["copy"]


def test_probe_finds_hardlinks_on_this_file_system(tmp_path: Path) -> None:
    got = dvccache.probe_links(tmp_path / "cache", tmp_path / "work")
    assert "hardlink" in got and "symlink" in got, got  # /tmp here is ext4 (FEASIBILITY.md)
    assert list((tmp_path / "cache").iterdir()) == [], "the probe leaves nothing behind"


def test_link_or_copy_links_protected_files_copies_writable_ones_recreates_symlinks(tmp_path: Path) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 100)
    dvccache.link_or_copy(
        src, tmp_path / "w.bin"
    )  # writable (an uncached metrics file): never the same inode
    assert (
        os.stat(tmp_path / "w.bin").st_ino != os.stat(src).st_ino
        and (tmp_path / "w.bin").read_bytes() == b"x" * 100
    )
    src.chmod(0o444)  # what DVC leaves: a protected link into its cache
    dvccache.link_or_copy(src, tmp_path / "b.bin")
    assert os.stat(tmp_path / "b.bin").st_ino == os.stat(src).st_ino
    (tmp_path / "l").symlink_to(src)
    dvccache.link_or_copy(tmp_path / "l", tmp_path / "m")
    assert os.readlink(tmp_path / "m") == str(src)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        dst = shm / f"pf-link-{os.getpid()}"
        try:
            dvccache.link_or_copy(src, dst)  # another file system: a copy, same bytes
            assert dst.read_bytes() == src.read_bytes() and os.stat(dst).st_ino != os.stat(src).st_ino
        finally:
            dst.unlink(missing_ok=True)


def test_runs_link_outputs_and_a_second_run_costs_only_its_code(tmp_path: Path) -> None:
    root = tiny_dvc.make(tmp_path / "p", frames=4)
    ws, how = tiny_dvc.run(root, "20261201T000000Z-a-aaaaaa")
    assert how == {"data": "ran", "model": "ran"}
    assert ws.link_types == "hardlink,symlink" and ws.cache_dir == str(root / ".dvc" / "cache")
    data_bytes = 4 * tiny_dvc.FILE_BYTES + 32 * 32768
    for f in [*(ws.path / "artifacts" / "data").iterdir(), ws.path / "artifacts" / "model" / "model.pt"]:
        st = os.stat(f)
        assert st.st_nlink >= 2 and st.st_mode & 0o222 == 0, f"{f}: a copy, or writable (DVC protects links)"
    first = tiny_dvc.du(root)
    assert first < data_bytes * 1.3, f"first run {first} B for {data_bytes} B of outputs: outputs copied"
    ws2, how2 = tiny_dvc.run(root, "20261201T000100Z-b-bbbbbb")
    assert how2 == {"data": "run-cache", "model": "run-cache"}
    second = tiny_dvc.du(root) - first
    assert second < 200_000, f"a second identical run added {second} B (its worktree only expected)"

    from flows.experiment import checkout_outputs

    assert checkout_outputs(ws2) == ["artifacts/data", "artifacts/model/model.pt"]
    assert (
        os.stat(root / "artifacts/model/model.pt").st_ino
        == os.stat(ws2.path / "artifacts/model/model.pt").st_ino
    )
    assert tiny_dvc.du(root) - first - second < 50_000, "the project's paths are links too"
    # DVC at the project root links as the runs do: the chosen cache.type is in the project's config.local
    assert dvccache.read_config(root).types == ["hardlink", "symlink"]
    tiny_dvc.dvc(root, "checkout", "--force")
    tiny_dvc.dvc(root, "status")


def test_a_clone_pointed_at_a_shared_cache_restores_and_names_the_run_that_computed_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "team-cache"
    a = tiny_dvc.make(tmp_path / "alice")
    dvccache.share_cache(a, shared)
    ws_a, how_a = tiny_dvc.run(a, "20261201T000000Z-alice-aaaaaa")
    assert how_a == {"data": "ran", "model": "ran"} and ws_a.cache_dir == str(shared)
    b = tiny_dvc.make(tmp_path / "bob")
    tiny_dvc.dvc(b, "cache", "dir", "--local", str(shared))  # what a DVC user already knows
    tiny_dvc.dvc(b, "config", "--local", "cache.shared", "group")
    ws_b, how_b = tiny_dvc.run(b, "20261201T000500Z-bob-bbbbbb")
    assert how_b == {"data": "run-cache", "model": "run-cache"}
    md5 = ws_b.out_hashes()["artifacts/model/model.pt"]
    rec = dvccache.read_producer(shared, md5)
    assert rec and rec["run_id"] == ws_a.run_id and rec["project"] == str(a.resolve()), rec
    from factory.summary import render_summary
    from flows.parent_run import _computed_by

    by = _computed_by(ws_b, ws_b.lock(), "model")  # the parent run's tag `stage.model.computed_by`
    assert by is not None and by.startswith(f"run {ws_a.run_id} (") and str(a.resolve()) in by, by
    result = {"run_id": ws_b.run_id, "stages": {"model": {"how": "run-cache", "seconds": 1.0}},
              "lineage": {"model": {"how": "run-cache", "computed_by": by}}}  # fmt: skip
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_summary(result))
    assert f"run-cache (from run {ws_a.run_id})" in console.export_text()
    assert not (b / ".dvc" / "cache").exists(), "bob's clone made a cache of its own"
    assert oct(os.stat(shared).st_mode & 0o7777) == oct(0o2775)


@pytest.mark.parametrize("level", ["local", pytest.param("project", marks=pytest.mark.full)])
def test_a_cache_type_the_user_set_is_kept(tmp_path: Path, level: str) -> None:
    root = tiny_dvc.make(tmp_path / "p")
    tiny_dvc.dvc(root, "config", *(["--local"] if level == "local" else []), "cache.type", "symlink")
    if level == "project":
        tiny_dvc.git(root, "commit", "-qam", "symlinks")
    ws, _ = tiny_dvc.run(root, "20261201T000000Z-a-aaaaaa", stages=("data",))
    assert ws.link_types == "symlink" and ws.links_how == "configured"
    assert all(p.is_symlink() for p in (ws.path / "artifacts" / "data").iterdir())


def test_two_clones_that_share_only_an_s3_remote_restore_through_it(tmp_path: Path, s3: str) -> None:  # noqa: F811
    def remote(root: Path) -> None:
        tiny_dvc.dvc(root, "remote", "add", "--local", "-d", "team", f"s3://{BUCKET}/dvc-team")
        tiny_dvc.dvc(root, "remote", "modify", "--local", "team", "endpointurl", s3)

    a = tiny_dvc.make(tmp_path / "a")
    remote(a)
    ws_a, how_a = tiny_dvc.run(a, "20261201T000000Z-a-aaaaaa")
    assert how_a == {"data": "ran", "model": "ran"} and ws_a.remote == "team"
    pushed = ws_a.push()  # what `factory run` does after a successful run with a default remote
    assert pushed["ok"], pushed
    b = tiny_dvc.make(tmp_path / "b")  # another machine: its own cache, nothing shared but the remote
    remote(b)
    ws_b, how_b = tiny_dvc.run(b, "20261201T000500Z-b-bbbbbb")
    assert how_b == {"data": "run-cache", "model": "run-cache"}, "pulled from the remote, not recomputed"
    assert ws_b.cache_dir == str(b / ".dvc" / "cache")
    assert (ws_b.path / "artifacts/model/model.pt").read_bytes() == (
        ws_a.path / "artifacts/model/model.pt"
    ).read_bytes()
