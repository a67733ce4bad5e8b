"""Object storage (`pfactory.storage.objects`) against a real S3 API: moto's standalone server on 127.0.0.1.

The clients are the ones users run (s3fs through fsspec, DVC's dvc-s3), never a mock of them. Checks:
- `factory prepare --raw s3://.../raw --out s3://.../prepared --dask local:2` on a dataset with planted
  corruptions: the published objects are byte-identical to a local single-process run of the same frames,
  exactly the bad frames are refused, and train reads the shards (a verified local copy);
- the publish protocol: a prefix is readable only with its manifest, a rerun replaces the previous output
  (files it no longer lists are removed), a prefix holding foreign objects is refused, a tampered shard is
  refused by the reader;
- the DVC remote on the same server: `dvc push` of the prepared output and `dvc pull` into a fresh clone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prepare.conftest import small_params
from tests.prepare.test_scaleout import plant, tree

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "pfactory-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server on a free 127.0.0.1 port, the AWS variables pointing at it; yields its endpoint."""
    import moto.server  # noqa: F401  (the dev extra installs moto[server], s3fs and dvc-s3: no skip for them)
    import s3fs

    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=f, stderr=f
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.skip(f"the moto S3 server did not start: {log.read_text()[-500:]}")
            time.sleep(0.1)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    import fsspec

    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        # fsspec caches filesystem instances by their arguments, not by the environment: an instance made
        # for an earlier module's server (tests/storage/test_dvccache.py reuses this fixture) would still point there.
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            fsspec.filesystem("s3").mkdir(BUCKET)
            yield endpoint
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def _dask_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_TEMPORARY_DIRECTORY", str(tmp_path / "dask"))


@pytest.fixture(scope="module")
def raw_local(tmp_path_factory) -> tuple[Path, set[str]]:
    from pfactory.synth.dataset import generate_dataset

    raw = tmp_path_factory.mktemp("raw") / "synth"
    generate_dataset(raw, frames=24, seed=9, cameras=1, image_size=(208, 64), workers=1)
    return raw, plant(raw)


def _upload(local: Path, url: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3")
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    fs.put([str(p) for p in files], [f"{url}/{p.relative_to(local).as_posix()}" for p in files])


def _manifest_digest(data: bytes) -> str:
    """sha256 of a manifest.json without `source.root`: the raw data's location as given (a bucket URL or a
    local path) is the one thing that differs between the same data prepared from either."""
    import hashlib
    import json

    doc = json.loads(data)
    doc.get("source", {}).pop("root", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _local_published(root: Path) -> dict[str, str]:
    """`tree(root)` of a local prepared output without its ownership marker: a local directory says it is
    prepare's own output with `.pfactory-output`; an object-storage prefix with its manifest (published last)
    and `.pfactory-publishing` (`pfactory.storage.objects`), so the published objects never carry the marker.
    The manifest is compared without `source.root` (`_manifest_digest`)."""
    from pfactory.storage.fsutil import OUTPUT_MARKER

    out = {k: v for k, v in tree(root).items() if k != OUTPUT_MARKER}
    out["manifest.json"] = _manifest_digest((root / "manifest.json").read_bytes())
    return out


def _remote_tree(url: str) -> dict[str, str]:
    import hashlib

    from pfactory.storage.objects import Location

    loc = Location(url)
    out = {rel: hashlib.sha256(loc.read_bytes(rel)).hexdigest() for rel in loc.files()}
    out["manifest.json"] = _manifest_digest(loc.read_bytes("manifest.json"))
    return out


def test_s3_raw_to_s3_shards_on_dask_then_train_reads_them(s3, raw_local, tmp_path) -> None:
    from typer.testing import CliRunner

    import tasks.train
    from factory.cli import app
    from flows.params import load_params
    from pfactory.prepare.stage import prepare_dataset

    raw, bad = raw_local
    _upload(raw, f"s3://{BUCKET}/raw/synth")
    prepare_dataset(raw, tmp_path / "local", small_params())  # the same frames, one process, local files
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"prepare": small_params().model_dump(mode="json")}))

    out = f"s3://{BUCKET}/prepared/synth"
    args = [
        "prepare",
        "--raw",
        f"s3://{BUCKET}/raw/synth",
        "--out",
        out,
        "--dask",
        "local:2",
        "--params",
        str(params),
    ]
    res = CliRunner().invoke(app, args, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    assert res.exit_code == 0, res.output
    assert _remote_tree(out) == _local_published(tmp_path / "local")  # every shard, rejected.jsonl, manifest.json
    from pfactory.storage.objects import Location

    rejected = [json.loads(x) for x in Location(out).read_bytes("rejected.jsonl").decode().splitlines()]
    assert [r["frame_id"] for r in rejected] == sorted(bad)
    assert not [p for p in Location(f"s3://{BUCKET}/prepared").files() if ".partial-" in p]  # no staging left

    # train reads the published shards (through a verified local copy under paths.artifacts/.state).
    overrides = [
        "model.painted_pillars.image_channels=8", "model.painted_pillars.point_channels=16", "model.painted_pillars.bev_channels=[16,16,32]",
        "model.painted_pillars.up_channels=16", "model.painted_pillars.head_channels=16", "train.epochs=1", "train.torch_threads=1",
        "train.loader=torch", "train.loader_workers=1", "prepare.image_size=[104,32]",
        f"paths.artifacts={tmp_path / 'artifacts'}",
    ]  # fmt: skip
    summary = tasks.train.run(
        load_params(None, overrides), out, tmp_path / "model", track=False, progress=False
    )
    assert summary["steps"] >= 1 and (tmp_path / "model" / "model.pt").is_file()
    copy = next((tmp_path / "artifacts" / ".state" / "prepared").iterdir())
    assert _local_published(copy) == _local_published(tmp_path / "local")


def test_nuscenes_layout_from_s3(s3, synth_nuscenes, tmp_path) -> None:
    """A nuScenes-layout dataset (3 cameras) on the bucket: the same bytes as from the local directory."""
    from pfactory.prepare.scaleout import prepare_data
    from pfactory.prepare.stage import prepare_dataset

    _upload(synth_nuscenes, f"s3://{BUCKET}/raw/nuscenes")
    prepare_dataset(synth_nuscenes, tmp_path / "local", small_params())
    out = f"s3://{BUCKET}/prepared/nuscenes"
    result = prepare_data(f"s3://{BUCKET}/raw/nuscenes", out, small_params(unit_frames=2), "local:2")
    assert result.metrics["frames_total"] == 6 and result.metrics["images"] == 18
    assert _remote_tree(out) == _local_published(tmp_path / "local")


def test_publish_protocol_on_s3(s3, raw_local, tmp_path) -> None:
    from pfactory.prepare.errors import SchemaError
    from pfactory.prepare.publish import OutputError, fetch_prepared
    from pfactory.prepare.scaleout import prepare_data
    from pfactory.storage.objects import Location

    raw = tmp_path / "raw"
    shutil.copytree(raw_local[0], raw)
    out = f"s3://{BUCKET}/protocol/prepared"
    prepare_data(raw, out, small_params(shard_max_frames=2), "local:1")  # many small shards
    first = _remote_tree(out)
    assert sum(k.endswith(".parquet") for k in first) > 8
    # A rerun with bigger shards replaces the output: the shards it no longer lists are gone.
    prepare_data(raw, out, small_params(), "local:1")
    second = _remote_tree(out)
    prepare_dataset_tree = tmp_path / "ref"
    from pfactory.prepare.stage import prepare_dataset

    prepare_dataset(raw, prepare_dataset_tree, small_params())
    assert second == _local_published(prepare_dataset_tree)

    # Readers require the manifest: without it the prefix is not a prepared output.
    loc = Location(out)
    manifest = loc.read_bytes("manifest.json")
    loc.remove("manifest.json")
    with pytest.raises(SchemaError, match=r"no manifest\.json; not a published prepared output"):
        fetch_prepared(out, tmp_path / "copy")
    # ... nor one prepare overwrites: without a manifest (or its publishing marker) the objects are not its.
    with pytest.raises(OutputError, match="objects that prepare did not write"):
        prepare_data(raw, out, small_params(), "local:1")
    loc.write_bytes("manifest.json", manifest)
    # A shard that differs from its manifest is refused by the reader.
    shard = next(k for k in second if k.endswith(".parquet"))
    loc.write_bytes(shard, loc.read_bytes(shard) + b"\0")
    with pytest.raises(SchemaError, match=f"{shard}: sha256 .* does not match"):
        fetch_prepared(out, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()

    # A prefix holding objects prepare did not write is refused before any work.
    Location(f"s3://{BUCKET}/user-data").write_bytes("notes.txt", b"mine")
    with pytest.raises(OutputError, match="1 objects that prepare did not write"):
        prepare_data(raw, f"s3://{BUCKET}/user-data", small_params(), "local:1")
    assert Location(f"s3://{BUCKET}/user-data").files() == ["notes.txt"]
    with pytest.raises(OutputError, match="not a bucket root"):
        prepare_data(raw, f"s3://{BUCKET}", small_params(), "local:1")


def test_dvc_remote_on_s3_push_and_pull(s3, raw_local, tmp_path) -> None:
    """The DVC remote of the pipeline on object storage: push the prepared output, pull it in a fresh clone."""
    import dvc_s3  # noqa: F401

    from pfactory.prepare.stage import prepare_dataset

    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    dvc = [sys.executable, "-m", "dvc"]

    def sh(cmd: list[str], cwd: Path) -> str:
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{cmd}: {res.stdout}\n{res.stderr}"
        return res.stdout

    repo = tmp_path / "repo"
    repo.mkdir()
    sh(["git", "init", "-q"], repo)
    sh([*dvc, "init", "-q"], repo)
    sh([*dvc, "remote", "add", "-d", "storage", f"s3://{BUCKET}/dvc-store"], repo)
    sh([*dvc, "remote", "modify", "storage", "endpointurl", s3], repo)
    prepare_dataset(raw_local[0], repo / "prepared", small_params())
    sh([*dvc, "add", "-q", "prepared"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "prepared"], repo)
    sh([*dvc, "push", "-q"], repo)

    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    sh([*dvc, "pull", "-q"], clone)
    assert tree(clone / "prepared") == tree(repo / "prepared")
