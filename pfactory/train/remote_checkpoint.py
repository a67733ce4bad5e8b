"""Checkpoints that travel with the run: a copy of each checkpoint on the project's default DVC remote, so an
interrupted run resumes on another machine (`factory run --resume NAME` in a clone without the workspace).

The remote is reached through DVC's own file-system layer (`dvc.config.Config` + `dvc.fs.get_cloud_fs`: the
remote's URL, credentials and options as `dvc push` reads them), so any DVC remote type works: a local or NFS
directory, S3 (and S3-compatible), GCS, Azure, SSH, ...

Layout, under the remote's URL:

    pfactory-runs/<run id>/run.json                    the marker, replaced last (temporary key, then a move):
                                                       {"format", "run_id", "record" (the run's record),
                                                        "params_yaml" (the run's params.yaml), "updated_at",
                                                        "checkpoint": {"key", "path", "step", "bytes",
                                                        "sha256", "uploaded_at"} (absent: none uploaded)}
    pfactory-runs/<run id>/checkpoint-<step>-<hex>.pt  the checkpoint it names: a key of its own, uploaded in
                                                       full before the marker names it; older ones are removed
                                                       after the marker moved on

A reader (`RunRemote.get_checkpoint`) reads the marker, then the key it names, and checks its sha256: it never
sees a half-written checkpoint or a marker naming one; when a writer moved on in between (the key gone), it
reads the marker again.

Who writes: the train process (`CheckpointUploader`, a background thread: the training loop only hard-links
the new checkpoint and queues it; a newer checkpoint replaces a queued one, so uploads never pile up behind a
slow network), when `$PFACTORY_CHECKPOINT_REMOTE` is set (the pipeline's workspace sets it when the project has
a default remote: `flows.workspace`). On SIGTERM the loop waits for the last checkpoint's upload before it exits
143 (`CheckpointUploader.flush`). The flow process updates the record (interrupted, finished) with
`RunRemote.write_record`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REMOTE_ENV = "PFACTORY_CHECKPOINT_REMOTE"
"""JSON `{"project", "run_id", "record", "params", "workspace"}`: the DVC project whose default remote takes the
checkpoints, the run id, the run's record and params.yaml (uploaded in the marker), the folder checkpoint paths
are recorded relative to."""
RUNS_PREFIX = "pfactory-runs"
MARKER = "run.json"
MARKER_FORMAT = 1
_CKPT_KEY = re.compile(r"^checkpoint-\d+-[0-9a-f]+\.pt$")
FLUSH_TIMEOUT_S = 120.0  # SIGTERM: how long the loop waits for the last upload (Kubernetes' grace is 30 s)


class RemoteRunError(RuntimeError):
    """The DVC remote has no such run, or it cannot be read (one line naming the run and the remote)."""


def _redact(url: str) -> str:
    """`url` without a user:password part."""
    return re.sub(r"(?<=://)[^/@]*@", "", url)


class RunRemote:
    """The run area (`pfactory-runs/`) of the default (or `remote`-named) DVC remote of the project at
    `project`. RemoteRunError when the project has no such remote or DVC cannot open it."""

    def __init__(self, project: str | os.PathLike[str], remote: str | None = None) -> None:
        from dvc.config import Config
        from dvc.fs import get_cloud_fs

        dvc_dir = Path(project) / ".dvc"
        try:
            config = Config(dvc_dir=str(dvc_dir))
            name = remote or config["core"].get("remote")
            if not name:
                raise RemoteRunError(f"{dvc_dir / 'config'}: no default DVC remote (dvc remote add -d NAME URL)")
            cls, fs_config, path = get_cloud_fs(config, name=name)
            url = str(config["remote"][name]["url"])
            fs = cls(**fs_config)
        except RemoteRunError:
            raise
        except Exception as e:  # an unknown remote, a missing plugin (dvc-s3 ...), a config error
            raise RemoteRunError(f"{dvc_dir / 'config'}: DVC remote {remote or '(default)'}: {e}") from None
        self.name, self.url, self.fs = name, _redact(url), fs
        self.base = fs.join(path, RUNS_PREFIX)

    def __str__(self) -> str:
        return f"DVC remote {self.name!r} ({self.url.rstrip('/')}/{RUNS_PREFIX})"

    def _path(self, run_id: str, key: str = "") -> str:
        return self.fs.join(self.base, run_id, key) if key else self.fs.join(self.base, run_id)

    def _forget_listings(self) -> None:
        """fsspec file systems cache directory listings per process: another machine's writes must show."""
        inner = getattr(self.fs, "fs", None)
        with contextlib.suppress(Exception):
            inner.invalidate_cache()  # type: ignore[union-attr]

    def _put_small(self, data: bytes, dest: str) -> None:
        """Write `data` at `dest` atomically from a reader's view: a temporary key next to it, then a move."""
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        fd, local = tempfile.mkstemp(prefix=".pfactory-remote-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.fs.makedirs(self.fs.parent(dest), exist_ok=True)
            self.fs.put_file(local, tmp)
            self.fs.mv(tmp, dest)
        finally:
            os.unlink(local)

    def read_marker(self, run_id: str) -> dict[str, Any] | None:
        """The run's marker (`run.json`, module docstring), None when the remote has none."""
        try:
            with self.fs.open(self._path(run_id, MARKER), "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise RemoteRunError(f"{self}: {run_id}/{MARKER} is not JSON ({e})") from None
        return data if isinstance(data, dict) else None

    def write_record(self, run_id: str, record: dict[str, Any], params_yaml: str | None = None,
                     checkpoint: dict[str, Any] | bool | None = True) -> dict[str, Any]:  # fmt: skip
        """Replace the marker's record (and params.yaml); `checkpoint`: True keeps the one the marker names,
        None/False drops it (and removes its key: a finished run), a dict names a new one. Returns the marker."""
        old = self.read_marker(run_id) or {}
        keep = old.get("checkpoint") if checkpoint is True else (checkpoint or None)
        marker = {
            "format": MARKER_FORMAT,
            "run_id": run_id,
            "record": record,
            "params_yaml": params_yaml if params_yaml is not None else old.get("params_yaml"),
            "updated_at": time.time(),
        }
        if keep:
            marker["checkpoint"] = keep
        self._put_small(json.dumps(marker, indent=1, default=str).encode(), self._path(run_id, MARKER))
        self._prune(run_id, keep["key"] if keep else None)
        return marker

    def _prune(self, run_id: str, current: str | None) -> None:
        """Remove the run's checkpoint keys other than `current` (best effort: a reader may still fetch one)."""
        self._forget_listings()
        try:
            names = [self.fs.name(p) for p in self.fs.ls(self._path(run_id), detail=False)]
        except FileNotFoundError:
            return
        for name in names:
            if _CKPT_KEY.match(name) and name != current:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._path(run_id, name))

    def put_checkpoint(self, run_id: str, local: Path, *, step: int, path: str, record: dict[str, Any],
                       params_yaml: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Upload the checkpoint file `local` (`path`: where it lives in the run's workspace, relative), then
        the marker naming it. Returns the marker's `checkpoint` entry."""
        sha = hashlib.sha256()
        with open(local, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
        key = f"checkpoint-{step:08d}-{uuid.uuid4().hex[:8]}.pt"
        self.fs.makedirs(self._path(run_id), exist_ok=True)
        self.fs.put_file(str(local), self._path(run_id, key))
        entry = {"key": key, "path": path, "step": step, "bytes": Path(local).stat().st_size,
                 "sha256": sha.hexdigest(), "uploaded_at": time.time()}  # fmt: skip
        self.write_record(run_id, record, params_yaml, checkpoint=entry)
        return entry

    def get_checkpoint(self, run_id: str, dest: Path, attempts: int = 5) -> dict[str, Any]:
        """Download the checkpoint the run's marker names to `dest` (atomically; its sha256 checked) and return
        the marker (without a `checkpoint` entry: only the record). RemoteRunError when there is no marker or
        the checkpoint cannot be read consistently after `attempts` tries (a writer moving on in between)."""
        from pfactory.storage.fsutil import sha256_file, temp_sibling

        problem = ""
        for i in range(attempts):
            marker = self.read_marker(run_id)
            if marker is None:
                raise RemoteRunError(f"{self}: no run {run_id}")
            entry = marker.get("checkpoint")
            if not entry:
                return marker
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_sibling(dest)
            try:
                self.fs.get_file(self._path(run_id, entry["key"]), str(tmp))
                if sha256_file(tmp) == entry["sha256"]:
                    os.replace(tmp, dest)
                    return marker
                problem = f"{entry['key']}: sha256 differs from the marker's"
            except FileNotFoundError:
                problem = f"{entry['key']}: gone (a newer checkpoint replaced it)"
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            time.sleep(0.2 * (i + 1))
        raise RemoteRunError(f"{self}: run {run_id}: could not read its checkpoint ({problem})")

    def find(self, name: str) -> str | None:
        """The run id on the remote for `name`: a run id, or a run name (`--name`; its newest run); None."""
        self._forget_listings()
        try:
            ids = sorted((self.fs.name(p.rstrip("/")) for p in self.fs.ls(self.base, detail=False)), reverse=True)
        except FileNotFoundError:
            return None
        if name in ids and self.read_marker(name) is not None:
            return name
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40]
        for run_id in ids:  # `<stamp>-<slug>-<hex>` (flows.workspace.new_run_id): only those can match
            if f"-{slug}-" in run_id:
                marker = self.read_marker(run_id)
                if marker is not None and (marker.get("record") or {}).get("name") == name:
                    return run_id
        return None


class CheckpointUploader:
    """Uploads a run's checkpoints in a background thread (module docstring). `target`: what `REMOTE_ENV` holds.

    `submit(path, step)` (the training thread, after the atomic local write): hard-links the file (a
    consistent snapshot, even when the next checkpoint replaces it) and queues it, replacing a queued one.
    `flush()` waits for the queue to empty; `close()` drops what is queued and waits for an upload in flight.
    `stats()`: uploads, seconds and bytes in the background, seconds the training thread spent (`blocking_s`),
    checkpoints superseded before their upload, errors."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.target = target
        self.run_id = str(target["run_id"])
        self._cond = threading.Condition()
        self._pending: tuple[Path, int, str] | None = None
        self._busy = self._closed = False
        self._remote: RunRemote | None = None
        self._stats = {"uploads": 0, "seconds": 0.0, "bytes": 0, "blocking_s": 0.0, "superseded": 0, "errors": 0}
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, path: Path, step: int) -> None:
        """Queue the checkpoint at `path` (written at `step`) for upload."""
        t0 = time.perf_counter()
        snap = path.with_name(f".upload-{path.name}-{step}-{uuid.uuid4().hex[:6]}")
        try:
            os.link(path, snap)
        except OSError:  # no hard links here: a copy (what a link saves is this copy)
            import shutil

            shutil.copy2(path, snap)
        rel = os.path.relpath(path, self.target.get("workspace") or path.parent)
        with self._cond:
            if self._pending is not None:
                self._pending[0].unlink(missing_ok=True)
                self._stats["superseded"] += 1
            self._pending = (snap, step, rel)
            self._cond.notify_all()
        self._stats["blocking_s"] += time.perf_counter() - t0

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until nothing is queued or uploading (True), at most `timeout` seconds (False)."""
        t0 = time.perf_counter()
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)
        self._stats["blocking_s"] += time.perf_counter() - t0
        if not done:
            print(f"train: the checkpoint upload to the DVC remote did not finish within {timeout:.0f} s",
                  file=sys.stderr)  # fmt: skip
        return done

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Drop what is queued (a finished run needs no resume copy) and wait for an upload in flight."""
        t0 = time.perf_counter()
        with self._cond:
            self._closed = True
            if self._pending is not None:
                self._pending[0].unlink(missing_ok=True)
                self._pending = None
                self._stats["superseded"] += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy, timeout)
        self._stats["blocking_s"] += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        """The upload figures (class docstring), rounded; `last_error` when one failed."""
        out: dict[str, Any] = {k: round(v, 4) if isinstance(v, float) else v for k, v in self._stats.items()}
        out["remote"] = str(self._remote) if self._remote is not None else None
        if self._last_error:
            out["last_error"] = self._last_error
        return out

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (snap, step, rel), self._pending = self._pending, None
                self._busy = True
            try:
                self._upload(snap, step, rel)
            finally:
                snap.unlink(missing_ok=True)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload(self, snap: Path, step: int, rel: str) -> None:
        t0 = time.perf_counter()
        try:
            if self._remote is None:
                self._remote = RunRemote(self.target["project"])
            record = _read_json(self.target.get("record"))
            params = self.target.get("params")
            params_yaml = Path(params).read_text() if params and Path(params).is_file() else None
            entry = self._remote.put_checkpoint(self.run_id, snap, step=step, path=rel, record=record,
                                                params_yaml=params_yaml)  # fmt: skip
        except Exception as e:  # never fails training: said once per distinct error
            self._stats["errors"] += 1
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if msg != self._last_error:
                print(f"train: checkpoint of step {step} not uploaded to the DVC remote ({msg})", file=sys.stderr)
            self._last_error = msg
            return
        self._stats["uploads"] += 1
        self._stats["bytes"] += int(entry["bytes"])
        self._stats["seconds"] += time.perf_counter() - t0


def _read_json(path: str | None) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def uploader_from_env() -> CheckpointUploader | None:
    """A `CheckpointUploader` for `$PFACTORY_CHECKPOINT_REMOTE` (module docstring), None when it is unset.
    ValueError naming the variable when it is not the JSON object expected."""
    raw = os.environ.get(REMOTE_ENV)
    if not raw:
        return None
    try:
        target = json.loads(raw)
        if not isinstance(target, dict) or not target.get("project") or not target.get("run_id"):
            raise ValueError("not an object with project and run_id")
    except ValueError as e:
        raise ValueError(f"${REMOTE_ENV}: expected JSON {{project, run_id, record, params, workspace}} ({e})") \
            from None  # fmt: skip
    return CheckpointUploader(target)


def target_env(project: Path, run_id: str, workspace: Path, record: Path, params: Path) -> str:
    """The value of `REMOTE_ENV` for a run (what `flows.workspace` sets for its stages)."""
    return json.dumps({"project": str(project), "run_id": run_id, "workspace": str(workspace),
                       "record": str(record), "params": str(params)})  # fmt: skip
