"""Publishing a prepared output, local or on object storage, and reading one back (the protocol is in
`pfactory.storage.objects`' docstring): a prefix is readable only with its manifest, written last.

- `check_output(out)` / `build_output(out)`: the build directory of a prepare run, published when complete;
- `publish(staging, target)`: manifest unpublished first, files copied, manifest last;
- `fetch_prepared(url, dest)` / `local_prepared(data, cache)`: a verified local copy for the stages that
  read shards (train).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from pfactory.runtime.failures import EXIT_FAILED, UserError
from pfactory.storage.fsutil import atomic_directory, pid_alive
from pfactory.storage.objects import PUBLISHING, Location, is_url


class OutputError(UserError, ValueError):
    """The output location cannot be written (names it and why)."""

    exit_code = EXIT_FAILED


def check_output(out: str) -> Location:
    """The output URL as a Location, refused when it is a bucket root or holds foreign objects."""
    from pfactory.prepare.shards import MANIFEST

    target = Location(out)
    if "/" not in target.path().strip("/"):
        raise OutputError(
            f"{out}: output: a prefix inside a bucket (s3://bucket/prepared), not a bucket root"
        )
    files = target.files()
    if files and MANIFEST not in files and PUBLISHING not in files:
        raise OutputError(
            f"{out}: output: an empty prefix or a prepared output (with {MANIFEST}); it holds "
            f"{len(files)} objects that prepare did not write (e.g. {files[0]}): choose another --out"
        )
    return target


def _remove_stale_remote(parent: Location, name: str) -> None:
    """Remove `.<name>.partial-<this host>-<pid>-*` prefixes left by dead runs on this machine."""
    host = socket.gethostname()
    mark = f".{name}.partial-{host}-"
    with contextlib.suppress(FileNotFoundError):
        for entry in parent.fs.ls(parent.path(), detail=False):
            base = PurePosixPath(entry).name
            if not base.startswith(mark):
                continue
            pid = base.removeprefix(mark).split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                parent.remove_tree(base)


@contextlib.contextmanager
def build_output(
    out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = ()
) -> Iterator[Location]:
    """The build directory of `out` (see the module docstring); published when the body completes.
    A local `out` is refused (`pfactory.storage.fsutil.OutputRefused`) when it overlaps a local one of `inputs`."""
    if not is_url(out):
        local = [i for i in inputs if i is not None and not is_url(i)]
        with atomic_directory(Path(out), stage="prepare", inputs=local) as tmp:
            yield Location(tmp)
        return
    target = check_output(os.fspath(out))
    parent_url, name = target.url.rsplit("/", 1)
    parent = Location(parent_url)
    _remove_stale_remote(parent, name)
    staging = parent.child(f".{name}.partial-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        yield staging
    except BaseException:
        staging.remove_tree()
        raise
    publish(staging, target)


def publish(staging: Location, target: Location) -> None:
    """Move a complete build at `staging` to `target`, manifest.json last (module docstring)."""
    from pfactory.prepare.shards import MANIFEST, REJECTED

    files = staging.files()
    if MANIFEST not in files:
        raise OutputError(f"{staging.url}: no {MANIFEST}: the build is not complete, nothing published")
    target.write_bytes(
        PUBLISHING, b"a prepare run is publishing this prefix; incomplete until manifest.json\n"
    )
    if target.exists(MANIFEST):
        old = json.loads(target.read_bytes(MANIFEST))
        target.remove(MANIFEST)  # unpublished first: no reader sees old and new files mixed
        listed = [s["file"] for split in old.get("splits", {}).values() for s in split.get("shards", [])]
        for rel in {*listed, REJECTED} - set(files):
            target.remove(rel)
    rest = [rel for rel in files if rel != MANIFEST]
    if rest:  # one batched call: s3fs runs the server-side copies concurrently
        target.fs.copy([staging.path(r) for r in rest], [target.path(r) for r in rest])
    target.fs.copy(staging.path(MANIFEST), target.path(MANIFEST))
    target.remove(PUBLISHING)
    staging.remove_tree()


def fetch_prepared(url: str, dest: Path) -> Path:
    """A local copy of the published prepared output at `url` in `dest`, every file checked against the
    manifest's sha256 (a copy already there with the same manifest is reused). Raises SchemaError when
    `url` holds no manifest (not published, or still publishing) or a file does not match it."""
    from pfactory.prepare.errors import SchemaError
    from pfactory.prepare.shards import MANIFEST, REJECTED, check_schema_version
    from pfactory.storage.fsutil import sha256_file

    src = Location(url)
    if not src.exists(MANIFEST):
        raise SchemaError(f"{url}: no {MANIFEST}; not a published prepared output (run `factory prepare`)")
    raw = src.read_bytes(MANIFEST)
    manifest = json.loads(raw)
    check_schema_version(manifest.get("schema_version"), f"{url}/{MANIFEST}")
    if (dest / MANIFEST).is_file() and (dest / MANIFEST).read_bytes() == raw:
        return dest
    listed = [(s["file"], s["sha256"]) for split in manifest["splits"].values() for s in split["shards"]]
    listed.append((REJECTED, manifest["rejected"]["sha256"]))
    with atomic_directory(dest, stage="prepare") as tmp:  # a copy of prepare's output
        for rel, _ in listed:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        try:  # one batched call: the downloads run concurrently
            src.fs.get([src.path(rel) for rel, _ in listed], [str(tmp / rel) for rel, _ in listed])
        except FileNotFoundError as e:
            raise SchemaError(f"{url}: a file its {MANIFEST} lists is missing ({e})") from e
        for rel, want in listed:
            got = sha256_file(tmp / rel)
            if got != want:
                raise SchemaError(f"{url}/{rel}: sha256 {got} does not match {want} in its {MANIFEST}")
        (tmp / MANIFEST).write_bytes(raw)
    return dest


def local_prepared(data: str | os.PathLike[str], cache: Path) -> Path:
    """`data` itself when local, else its verified copy under `cache/<name>-<hash of the URL>`."""
    if not is_url(data):
        return Path(data)
    from pfactory.storage.fsutil import sha256_bytes

    url = os.fspath(data).rstrip("/")
    return fetch_prepared(url, cache / f"{PurePosixPath(url).name}-{sha256_bytes(url.encode())[:12]}")
