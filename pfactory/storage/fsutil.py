"""Atomic file and directory writes, output ownership, and content hashes.

Every file the factory writes goes through here: written to a temporary sibling, flushed,
fsynced and renamed over the target, so a reader never sees half a file and an interrupted
run leaves nothing a later stage would read. Files and directories get the modes of any new
one under the process's umask (0644 / 0755 with the usual 022; owner-only with 077, which a
team's private state uses: docs/OPERATIONS.md). Temporary siblings carry the writer's pid
(`.<name>.<pid>-<random>.tmp`); one left by a killed process is removed by the next write of
the same target once that pid is gone.

Output directories are *owned*: a stage's directory carries `OUTPUT_MARKER` (`.pfactory-output`,
`{"stage": ...}`), written last, and `atomic_directory` replaces an existing directory only when
it is empty or carries that stage's marker. Anything else -- a user's own files, another stage's
output, a regular file, a symlink, a mount point, the root or home directory, or a directory
that is or holds or lies inside one of the stage's inputs -- is refused with `OutputRefused`
before any work starts, and nothing is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pfactory.runtime.failures import EXIT_USAGE, UserError


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def current_umask() -> int:
    """This process's umask (Linux: read from /proc, so no thread sees it changed; elsewhere set and reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}-"


def temp_sibling(path: str | os.PathLike[str]) -> Path:
    """A fresh name for a temporary sibling of `path` (`.<name>.<pid>-<random>.tmp`, not created): for a
    writer that makes the file itself (a link) before renaming it over `path`; `remove_stale_temps` knows it."""
    path = Path(path)
    return path.with_name(f"{_temp_prefix(path)}{os.urandom(4).hex()}.tmp")


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove temporary siblings of `path` (`.<name>.<pid>-*.tmp`, files or directories) whose writer
    process is gone (SIGKILL, power loss); returns what was removed. Those of live processes stay."""
    path = Path(path)
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for p in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        pid_s = p.name[len(path.name) + 2 :].split("-", 1)[0]
        if not pid_s.isdigit() or int(pid_s) == os.getpid() or pid_alive(int(pid_s)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        removed.append(p)
    return removed


def dead_temp(name: str) -> bool:
    """Whether file name `name` is a temporary file of ours (`.<name>.<pid>[-<random>].tmp`) whose writer
    process is gone: debris of a killed write, not anybody's data."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    pid_s = name[:-4].rsplit(".", 1)[-1].split("-", 1)[0]
    return pid_s.isdigit() and int(pid_s) != os.getpid() and not pid_alive(int(pid_s))


def glob_escape(name: str) -> str:
    """`name` with glob metacharacters escaped (a literal part of a pattern)."""
    import glob

    return glob.escape(name)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, clean_stale: bool = False) -> Path:
    """Write `data` to `path` atomically (temp file in the same directory + rename).

    `clean_stale`: first remove temp files a killed earlier writer of `path` left (`remove_stale_temps`;
    one directory listing: for big files rewritten in place, such as checkpoints, not per dataset file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if clean_stale:
        remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; a published file gets the mode of any new file (0666 less the umask: 0644
        # with the usual 022, owner-only under a team's 077).
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise_disk_full(e, path)
        raise
    return path


def raise_disk_full(exc: BaseException, target: str | os.PathLike[str]) -> None:
    """Re-raise a full-disk error (ENOSPC, EDQUOT, or a library's error saying so) as an OSError naming
    `target`, the file or directory being written; anything else returns."""
    from pfactory.runtime.failures import is_disk_full

    if isinstance(exc, Exception) and is_disk_full(exc) and not getattr(exc, "filename", None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(target)) from exc


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    """numpy scalars/arrays and paths in JSON; anything else is an error (not silently str()-ed)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int = 2) -> Path:
    """Write `obj` as JSON (sorted keys, trailing newline) to `path` atomically."""
    return atomic_write_text(
        path, json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n"
    )


OUTPUT_MARKER = ".pfactory-output"


class OutputRefused(UserError, ValueError):
    """An output path a stage must not replace: the message names it, says why and what to do instead."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str | os.PathLike[str], why: str, hint: str | None = None) -> None:
        self.path = str(path)
        self.why = why
        hint = hint or "choose a new or empty directory, or the directory this stage wrote before"
        super().__init__(f"{self.path}: {why}; nothing was written or deleted ({hint})")


def output_owner(path: str | os.PathLike[str]) -> str | None:
    """The stage whose output `path` is (its `OUTPUT_MARKER`), or None."""
    marker = Path(path) / OUTPUT_MARKER
    try:
        doc = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("stage") if isinstance(doc, dict) and isinstance(doc.get("stage"), str) else None


def mark_output(directory: str | os.PathLike[str], stage: str) -> Path:
    """Write `directory/OUTPUT_MARKER` saying that `stage` owns the directory."""
    return atomic_write_text(Path(directory) / OUTPUT_MARKER, json.dumps({"stage": stage}) + "\n")


# Outputs written before the marker existed: a stage's own signature file and nothing but the names the
# stage writes (fnmatch patterns) -- replaced like a marked output; a user's file beside them is refused.
LEGACY_OUTPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "synth": ("synth.json", ("synth.json", "training", "samples", "sweeps", "v1.0-*")),
    "prepare": ("manifest.json", ("manifest.json", "rejected.jsonl", "train", "val")),
    "optimize": ("backend.json", ("backend.json", "*.json", "*.onnx", "onnxruntime", "tensorrt")),
    "evaluate": ("kpis.json", ("kpis.json", "metrics.json", "pr", "report", "kitti_results", "kitti_frames.txt")),
    "promote": ("release.json", ("release.json", "*.json", "*.jsonl", "*.md", "optimized")),
}


def _legacy_output(entries: list[str], stage: str) -> bool:
    import fnmatch

    signature, allowed = LEGACY_OUTPUTS.get(stage, ("", ()))
    return signature in entries and all(any(fnmatch.fnmatch(e, a) for a in allowed) for e in entries)


def _overlap(out: Path, inp: Path) -> str | None:
    if out == inp:
        return "is also an input of this stage"
    if out in inp.parents:
        return f"contains the input {inp}: replacing it would delete the input"
    if inp in out.parents:
        return f"is inside the input {inp}: writing there would change the input"
    return None


def check_output_dir(
    path: str | os.PathLike[str], stage: str, inputs: Iterable[str | os.PathLike[str] | None] = ()
) -> Path:
    """Refuse (`OutputRefused`) an output directory that `stage` must not build or replace (module
    docstring); returns `path`. Called before any work, and again just before the rename."""
    p = Path(path)
    r = p.resolve()
    if r == Path(r.anchor):
        raise OutputRefused(p, "is the root of the file system")
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory
        if r == Path.home().resolve():
            raise OutputRefused(p, "is your home directory")
    for inp in inputs:
        if inp is None:
            continue
        why = _overlap(r, Path(inp).resolve())
        if why:
            raise OutputRefused(p, why, "choose an output directory apart from the inputs")
    if p.is_symlink():
        raise OutputRefused(p, f"is a symbolic link (to {os.readlink(p)}); refusing to replace it")
    if p.exists() and not p.is_dir():
        raise OutputRefused(p, "exists and is not a directory; refusing to replace it")
    if p.is_dir():
        if os.path.ismount(p):
            raise OutputRefused(
                p,
                "is a mount point: the output is built beside it and renamed into place, which a mount point "
                "cannot be",
                f"use a directory inside it, e.g. {p / stage}",
            )
        entries = sorted(e.name for e in p.iterdir() if not dead_temp(e.name))  # a killed write's debris
        owner = output_owner(p)
        if entries and owner != stage and not (owner is None and _legacy_output(entries, stage)):
            if owner is not None:
                why = f"holds the output of the {owner} stage, not of {stage}; refusing to replace it"
            else:
                shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
                why = (
                    f"is a non-empty directory that {stage} did not write ({shown}; no {OUTPUT_MARKER} "
                    "marker); refusing to replace it"
                )
            raise OutputRefused(p, why)
    return p


def replace_directory(tmp: Path, path: Path, stage: str) -> None:
    """Mark the finished `tmp` as `stage`'s output and rename it over `path` (checked again first: the
    old output is moved aside, then deleted, only once the new one is in place)."""
    check_output_dir(path, stage)
    mark_output(tmp, stage)
    if path.exists():
        old = path.parent / f"{_temp_prefix(path)}{os.urandom(4).hex()}.old.tmp"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike[str],
    overwrite: bool = True,
    *,
    stage: str,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
) -> Iterator[Path]:
    """Build `stage`'s output directory in a temporary sibling and rename it into place on success.

    Yields the temporary directory to write into. `path` is checked first (`check_output_dir`:
    `OutputRefused` before any work when it is not `stage`'s to replace, or overlaps `inputs`). On an
    exception the temporary directory is removed and `path` is left untouched; one left by a killed
    process is removed by the next run. With `overwrite`, an existing `path` of this stage is replaced
    only after the new one is complete.
    """
    path = Path(path)
    check_output_dir(path, stage, list(inputs))
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp creates 0700; a directory's usual mode under the umask
    try:
        yield tmp
        replace_directory(tmp, path, stage)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_disk_full(e, path)
        raise


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def read_json_object(
    path: str | os.PathLike[str], error: type[Exception], what: str = "JSON manifest"
) -> dict[str, Any]:
    """The JSON object in the file `path`; `error("<path>: not a <what> (...)")` when it is not UTF-8
    JSON, `error("<path>: expected a JSON object, got <type>")` when it holds another JSON value."""
    try:
        doc = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{path}: not a {what} ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def check_listed_file(
    path: Path,
    sha256: str,
    listed_in: str,
    error: type[Exception] = ValueError,
    *,
    hashed_in: str | None = None,
    hint: str = "",
    what: str = "",
) -> str:
    """`path`'s sha256 when the file exists and matches the `sha256` a manifest (`listed_in`) gives for it;
    else `error` naming the file, where it is listed and both hashes (corrupt or swapped files)."""
    if not path.is_file():
        raise error(f"{path}: {what}listed in {listed_in} but missing")
    got = sha256_file(path)
    if got != sha256:
        raise error(
            f"{path}: sha256 {got[:12]}... does not match {hashed_in or listed_in} ({sha256[:12]}...){hint}"
        )
    return got
