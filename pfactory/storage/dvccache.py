"""The project's DVC cache as the factory uses it: where it is, how outputs link to it, who shares it.

DVC keeps every stage output once, in its cache (content-addressed: `files/md5/<2>/<30>`, a directory as
a `.dir` listing), and its run-cache (`runs/`: stage hash -> the outputs a run produced) inside the same
directory. Workspaces, the project's own paths and `dvc exp apply` get their outputs from the cache by
`cache.type`, DVC's list of link types, tried in order:

    reflink   copy-on-write clone (btrfs, XFS, APFS): costs no disk, safe to edit
    hardlink  the same inode (ext4, most local file systems): no disk; DVC makes it read-only (0444)
    symlink   a link to the cache file (works across file systems); read-only target
    copy      a second copy of every byte: what a run costs when none of the above works

DVC's default is `reflink,copy`: on ext4 (no reflinks) every run copies everything (issue 32: 2.0 GB for one
default run). Why not DVC's documented `reflink,hardlink,symlink,copy`: DVC 3.67 relinks a directory output
after committing it only when the first type is `hardlink` or the list has no `copy` (dvc_data
`_needs_relink`: a copy counts as already linked when `copy` or `reflink` is allowed), so on ext4 the files
of `artifacts/prepared/` stayed full copies. What the factory writes when nobody chose (`link_types`):

    reflink works                  reflink,copy       (DVC's default; copies are clones)
    hardlink works                 hardlink,symlink   (symlink: a shared cache file another user owns,
                                                       which Linux' protected_hardlinks refuses to link)
    only symlink works             symlink
    none (FAT, some network FS)    copy               every run costs a full copy: put the cache on a
                                                       file system with hardlinks, or run gc more often

A `cache.type` set at any DVC config level (system, global, project, local) is the user's choice and is
kept. One cache for a team is DVC's own setting: `dvc cache dir PATH` + `dvc config cache.shared group`
(`share_cache` does both); every `factory run` workspace uses the project's configured cache and run-cache.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

LINK_PROBE_ORDER = ("reflink", "hardlink", "symlink")


@dataclass(frozen=True)
class CacheConfig:
    """The project's effective DVC cache settings (every config level merged, as DVC reads them)."""

    dir: Path
    """Absolute cache directory (`files/md5/...` and the run-cache `runs/` under it)."""
    types: list[str] | None
    """`cache.type` when someone set it at any level, else None (the factory chooses: `choose_types`)."""
    shared: str | None
    """`cache.shared` ("group": files group-readable, dirs group-writable) or None."""
    remote: str | None
    """`core.remote`, the default remote (`dvc push`/`pull` target), or None."""

    @property
    def files(self) -> Path:
        """Where DVC 3 keeps the objects: `<dir>/files/md5`."""
        return self.dir / "files" / "md5"

    @property
    def runs(self) -> Path:
        """DVC's run-cache: `<dir>/runs/<2>/<stage hash>/<entry hash>` (YAML: deps, params, outs)."""
        return self.dir / "runs"


def read_config(root: Path) -> CacheConfig:
    """The cache settings of the DVC project at `root` (its `.dvc/config`, `config.local`, the user's and the
    system's), resolved the way DVC resolves them (a relative `cache.dir` is relative to its config file)."""
    from dvc.config import Config

    root = Path(root).resolve()
    conf = Config(dvc_dir=str(root / ".dvc"))
    cache = conf.get("cache", {})
    core = conf.get("core", {})
    where = Path(cache["dir"]) if cache.get("dir") else root / ".dvc" / "cache"
    types = cache.get("type")
    if isinstance(types, str):
        types = [t.strip() for t in types.split(",") if t.strip()]
    return CacheConfig(
        dir=where if where.is_absolute() else (root / ".dvc" / where).resolve(),
        types=list(types) if types else None,
        shared=cache.get("shared"),
        remote=core.get("remote"),
    )


def probe_links(cache_dir: Path, work_dir: Path) -> list[str]:
    """The link types that work from a file in `cache_dir` to one in `work_dir` (created if needed), in
    `LINK_PROBE_ORDER`: DVC's own test (a real file linked each way, removed after)."""
    from dvc_objects.fs.generic import test_links
    from dvc_objects.fs.local import LocalFileSystem

    fs = LocalFileSystem()
    cache_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        return list(test_links(list(LINK_PROBE_ORDER), fs, str(cache_dir), fs, str(work_dir / "probe")))
    except OSError:  # the cache itself is not writable: nothing can be probed, DVC will say so
        return []


def choose_types(available: list[str]) -> list[str]:
    """`cache.type` for the link types that work (module docstring's table)."""
    if "reflink" in available:
        return ["reflink", "copy"]
    if "hardlink" in available:
        return ["hardlink", "symlink"] if "symlink" in available else ["hardlink"]
    if "symlink" in available:
        return ["symlink"]
    return ["copy"]


def link_types(root: Path, conf: CacheConfig | None = None) -> tuple[list[str], str]:
    """(`cache.type` to use, where it came from: "configured" | "chosen (probed: ...)") for `root`."""
    conf = conf or read_config(root)
    if conf.types:
        return conf.types, "configured"
    available = probe_links(conf.dir, Path(root) / ".dvc" / "tmp")
    return choose_types(available), f"chosen (working: {', '.join(available) or 'none'})"


def _edit_local(root: Path, section: str, values: dict[str, str]) -> None:
    """Set `values` in `[section]` of the project's `.dvc/config.local` (what `dvc config --local` does),
    written atomically."""
    import configobj

    from pfactory.storage.fsutil import atomic_write_text

    path = Path(root) / ".dvc" / "config.local"
    conf = configobj.ConfigObj(str(path) if path.is_file() else None)
    conf.setdefault(section, {}).update(values)
    conf.filename = None
    atomic_write_text(path, "\n".join(conf.write()) + "\n")


def ensure_link_config(root: Path) -> tuple[list[str], str]:
    """Record the chosen `cache.type` in the project's `.dvc/config.local` when no level sets one, so that
    `dvc checkout`, `dvc exp apply` and `dvc repro` at the project root link as the factory's runs do.
    Returns `link_types(root)`."""
    conf = read_config(root)
    types, how = link_types(root, conf)
    if conf.types is None:
        _edit_local(root, "cache", {"type": ",".join(types)})
    return types, how


def share_cache(root: Path, path: Path, group: bool = True) -> CacheConfig:
    """Point the project at the cache directory `path` (created; made group-writable with the set-group-id
    bit, so files created in it keep the group): `dvc cache dir --local PATH`, and with `group`
    `dvc config --local cache.shared group`. What `factory team` (issue 34) or a user calls once per clone.
    Returns the new settings."""
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    values = {"dir": str(path)}
    if group:
        values["shared"] = "group"
        with contextlib.suppress(PermissionError):  # another user's directory: its owner set it up
            os.chmod(path, 0o2775)
    _edit_local(root, "cache", values)
    conf = read_config(root)
    if conf.types is None:
        _edit_local(root, "cache", {"type": ",".join(link_types(root, conf)[0])})
    return read_config(root)


def writable(directory: Path) -> str | None:
    """None when a file can be created in `directory` (or it can be created), else the reason (the OS error:
    a read-only mount, permissions). A real create-and-remove: `os.access` says yes to root on a read-only
    file system."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        fd, name = tempfile.mkstemp(prefix=".pfactory-write-probe.", dir=d)
    except OSError as e:
        return f"{e.strerror or e} ({d})"
    os.close(fd)
    os.unlink(name)
    return None


def link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """Put `src` at `dst` without a second copy where that is safe: a symlink (DVC's link into the cache) is
    recreated pointing at the same target; a read-only file (DVC's protected link into its cache) is
    hard-linked (the same inode: read-only, as DVC protects it); a writable file (an uncached metrics file, a
    reflink clone) must not share its inode, so it is cloned where the file system can (reflink), else
    copied. A copy also when a link is refused (another file system, protected_hardlinks, the link limit).
    `shutil.copytree(copy_function=...)`-compatible; returns `dst`."""
    import shutil

    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return str(dst)
    if not os.stat(src).st_mode & 0o222:
        with contextlib.suppress(OSError):  # EXDEV, EPERM (protected_hardlinks), EMLINK, no hardlinks
            os.link(src, dst)
            return str(dst)
    try:
        from dvc_objects.fs.system import reflink

        reflink(src, dst)
        shutil.copystat(src, dst)
    except (OSError, ImportError):
        shutil.copy2(src, dst)
    return str(dst)


def state_dir(cache_dir: Path, *parts: str) -> Path:
    """`<cache>/pfactory/<parts>`, made group-writable with the set-group-id bit (as DVC makes a
    `cache.shared group` cache's directories), so every clone sharing the cache can add to it."""
    d = Path(cache_dir) / "pfactory"
    for part in ("", *parts):
        d = d / part if part else d
        if not d.is_dir():
            d.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(d, 0o2775)
    return d


def producer_path(cache_dir: Path, md5: str) -> Path:
    return Path(cache_dir) / "pfactory" / "producers" / f"{md5}.json"


def write_producer(cache_dir: Path, md5: str, info: dict) -> None:
    """Record who computed object `md5` (a run id, the stage, the project) with user, host and time; the
    first record wins (the run that computed it, not one that restored it). Never raises."""
    import json
    import socket
    import time

    path = producer_path(cache_dir, md5)
    if path.exists():
        return
    record = {**info, "user": _current_user(), "host": socket.gethostname(), "at": time.time()}
    with contextlib.suppress(OSError):
        state_dir(cache_dir, "producers")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.chmod(tmp, 0o664)
        os.replace(tmp, path)


def read_producer(cache_dir: Path, md5: str) -> dict | None:
    """The record `write_producer` left for `md5`, or None."""
    import json

    try:
        return json.loads(producer_path(cache_dir, md5).read_text())
    except (OSError, ValueError):
        return None


def _current_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
