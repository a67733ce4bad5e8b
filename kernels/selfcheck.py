"""Self-checks of the accelerated paths: each one proves itself against its reference before it is trusted.

    register(Check(path, run, fingerprint, types))   a path and how to check it (at import of its module)
    trusted(path, device) -> bool   first use on a device: the recorded verdict, else run the check and record
                                    it; False (the caller takes the reference / CPU path) when it failed
    verify(path, device, rerun) -> Verdict                  run (or read) one check: `factory doctor`
    checks() -> dict[str, Check]                            every registered path
    used(), used_json() -> this process's verdicts          (a stage's MLflow param `selfcheck`)
    private_dir(candidates, what) -> Path | None            the first folder this user owns that no one else
                                                            can write (created 0700), each refusal said once

A *path* is a named fast implementation that this machine built or runs for the first time: a Triton
kernel on a GPU (`triton.<op>`), a C kernel compiled here (`native.<op>`), DALI's GPU decoder, a
TensorRT engine, a CUDA bf16 training step. Its check runs it and its reference on small inputs (forward
and backward where there is one, each dtype the factory uses) and returns figures (`<dtype> <fwd|bwd>
max|err|` against a tolerance); a figure over its tolerance raises `Mismatch`, a check that cannot run
here raises `Skip`. The verdict (verified / failed / skipped, the reason, the figures) is recorded under a
key made of the path, the device's name, the driver, CUDA, torch and Triton versions and the path's source
fingerprint (a hash of the code that runs), so the check runs once per machine and code version, not
once per process. A failed path is bypassed: one warning line per process names it and its figures
(logger `pfk.selfcheck`; with no logging set up Python prints it alone on stderr).

Store: one JSON file per verdict, `<dir>/<path>-<key>.json`, written to a temp name and renamed (0600)
in a 0700 folder: `$PFK_SELFCHECK_DIR`, else `selfcheck/` beside `$PFK_NATIVE_CACHE_DIR` (the factory
sets `artifacts/.state/native`), else the checkout's `artifacts/.state/selfcheck`, else the user's
cache folder. A folder owned by someone else or writable by others is refused with one line, as the C
kernels' build cache is (`private_dir`). No usable folder: verdicts are kept in memory only.

This module imports no other kernel module (the op modules register their checks here) and imports
torch only to describe a device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("pfk.selfcheck")

VERIFIED, FAILED, SKIPPED = "verified", "failed", "skipped"
Figures = dict[str, float]


class Mismatch(Exception):
    """A check's figures exceed their tolerances: `figures` (all of them) and `worst` (the summary)."""

    def __init__(self, worst: str, figures: Figures) -> None:
        super().__init__(worst)
        self.worst = worst
        self.figures = figures


class Skip(Exception):
    """A check that cannot run here (no GPU, the package missing): the reason."""


@dataclass(frozen=True)
class Check:
    """One path: `run(device) -> figures` (raises Mismatch / Skip), `fingerprint() -> str` (the code that
    runs: a hash of its sources), `device_types` ("cuda", "cpu": the devices it applies to)."""

    path: str
    run: Callable[[Any], Figures]
    fingerprint: Callable[[], str]
    device_types: tuple[str, ...]
    what: str = ""  # one line for the doctor's table: what is compared with what


@dataclass
class Verdict:
    """A check's outcome on one device: status (verified / failed / skipped), why, figures, the key."""

    path: str
    status: str
    reason: str = ""
    figures: Figures = field(default_factory=dict)
    key: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    recorded: str = ""  # the file it is stored in ("" when kept in memory only)

    def line(self) -> str:
        """The one warning line of a failed path."""
        device = self.key.get("device", "?")
        return f"pfk self-check: {self.path} on {device} FAILED ({self.reason}); using the reference path"


_CHECKS: dict[str, Check] = {}
_VERDICTS: dict[tuple[str, str], Verdict] = {}  # (path, device) -> this process's verdict
_WARNED: set[str] = set()
_LOCK = threading.RLock()
_RUNNING = threading.local()


def register(check: Check) -> Check:
    """Add (or replace) a path's check; returns it."""
    _CHECKS[check.path] = check
    return check


def checks() -> dict[str, Check]:
    """Every registered path, by name."""
    return dict(_CHECKS)


def used() -> list[Verdict]:
    """The verdicts this process has taken (first uses and `verify` calls), in order."""
    return list(_VERDICTS.values())


def used_json(limit: int = 6000) -> str:
    """`used()` as compact JSON {"path@device": "verified" | "failed: why" | "skipped: why"}, at most
    `limit` characters (MLflow's param size): what a stage's run records as its param `selfcheck`."""
    out = {
        f"{v.path}@{v.key.get('device', '?')}": v.status + (f": {v.reason}" if v.reason else "")
        for v in used()
    }
    text = json.dumps(out, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def forget() -> None:
    """Drop this process's verdicts and warnings (the stored ones stay): the next use re-reads the store."""
    with _LOCK:
        _VERDICTS.clear()
        _WARNED.clear()


# --------------------------------------------------------------------------------------------------
# private folders (the verdict store here, the C kernels' build cache in kernels/native.py)
# --------------------------------------------------------------------------------------------------
_REFUSED: set[str] = set()


def folder_problem(path: Path) -> str | None:
    """Why `path` (an existing folder) must not hold code or verdicts: not a folder, owned by another user,
    or writable by its group or others; None when it is private to this user."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w` it if it is yours)"
    return None


def private_dir(candidates: Iterable[Path], what: str) -> Path | None:
    """The first of `candidates` that is, or can be created as, a folder of this user's that no one else can
    write (created with mode 0700); each refused one is said once per process on the `pfk.selfcheck` logger
    ("<what>: refusing <path>: <why>"). None when none qualifies."""
    for path in candidates:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue  # cannot be created here (read-only, no permission): the next candidate
        problem = folder_problem(path)
        if problem is None:
            return path
        note = f"{what}: refusing {path}: {problem}"
        if note not in _REFUSED:
            _REFUSED.add(note)
            log.warning(note)
    return None


def project_state_dir() -> Path | None:
    """`artifacts/.state` of the checkout this package lives in (a folder with dvc.yaml and params.yaml
    above kernels/), or None for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    if (root / "dvc.yaml").is_file() and (root / "params.yaml").is_file():
        return root / "artifacts" / ".state"
    return None


def cache_candidates(name: str, env: str) -> list[Path]:
    """Where a cache called `name` may live, best first: `$<env>` alone when set; else beside the factory's
    `$PFK_NATIVE_CACHE_DIR`, the checkout's `artifacts/.state/<name>`, the user's cache folder
    (`$XDG_CACHE_HOME` or ~/.cache, `pfactory/<name>`), the temp folder (`pfk-<name>-<uid>`)."""
    given = os.environ.get(env)
    if given:
        return [Path(given)]
    out: list[Path] = []
    native = os.environ.get("PFK_NATIVE_CACHE_DIR")
    if native and env != "PFK_NATIVE_CACHE_DIR":
        out.append(Path(native).parent / name)
    state = project_state_dir()
    if state is not None:
        out.append(state / name)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if not xdg:
        with contextlib.suppress(RuntimeError, KeyError):  # no home folder
            xdg = str(Path.home() / ".cache")
    if xdg:
        out.append(Path(xdg) / "pfactory" / name)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    out.append(Path(tempfile.gettempdir()) / f"pfk-{name}-{uid}")
    return out


def store_dir() -> Path | None:
    """The verdict store's folder (module docstring), or None: verdicts in memory only."""
    return private_dir(cache_candidates("selfcheck", "PFK_SELFCHECK_DIR"), "self-check verdicts")


# --------------------------------------------------------------------------------------------------
# keys and the store
# --------------------------------------------------------------------------------------------------
def sources_hash(files: Iterable[str | Path], extra: str = "") -> str:
    """sha256 (16 hex) of the files' bytes (in the order given) and `extra`: a path's source fingerprint."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
        h.update(b"\0")
    h.update(extra.encode())
    return h.hexdigest()[:16]


def environment(device: Any) -> dict[str, str]:
    """What a verdict holds for: the device's name (+ compute capability), the driver, CUDA, torch and
    Triton versions (empty where there is none)."""
    import torch

    dev = torch.device(device)
    env = {"torch": torch.__version__, "cuda": str(torch.version.cuda or ""), "driver": "", "triton": ""}
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        env["device"] = f"{torch.cuda.get_device_name(idx)} (sm_{major}{minor})"
        getter = getattr(torch._C, "_cuda_getDriverVersion", None)
        with contextlib.suppress(Exception):
            env["driver"] = str(getter()) if getter else ""
    else:
        env["device"] = f"{dev.type}: {_cpu_model()}"
    with contextlib.suppress(Exception):
        import importlib.metadata

        env["triton"] = importlib.metadata.version("triton")
    return env


def _cpu_model() -> str:
    import platform

    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


_CHECKER = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _key(check: Check, device: Any) -> dict[str, str]:
    # The checks' own code is part of the key: a mended check runs again instead of reusing an old verdict.
    return {"path": check.path, **environment(device), "source": check.fingerprint(), "checker": _CHECKER}


def _key_id(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read(folder: Path | None, path: str, key: dict[str, str]) -> Verdict | None:
    if folder is None:
        return None
    file = folder / f"{path}-{_key_id(key)}.json"
    try:
        data = json.loads(file.read_text())
        verdict = Verdict(**data)
    except (OSError, ValueError, TypeError):
        return None
    if verdict.key != key or verdict.status not in (VERIFIED, FAILED, SKIPPED):
        return None  # another key's file under a colliding name, or damaged: check again
    verdict.recorded = str(file)
    return verdict


def _write(folder: Path | None, verdict: Verdict) -> None:
    """Atomic (temp + rename), 0600."""
    if folder is None:
        return
    file = folder / f"{verdict.path}-{_key_id(verdict.key)}.json"
    data = {k: v for k, v in asdict(verdict).items() if k != "recorded"}
    fd, tmp = tempfile.mkstemp(prefix=file.name, suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, file)
        verdict.recorded = str(file)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# --------------------------------------------------------------------------------------------------
# running and trusting
# --------------------------------------------------------------------------------------------------
def _run(check: Check, device: Any, key: dict[str, str]) -> Verdict:
    t0 = time.perf_counter()
    running = getattr(_RUNNING, "paths", set())
    _RUNNING.paths = running | {check.path}
    try:
        import torch

        # The first use may come inside a caller's no_grad/inference_mode (evaluation) or autocast (AMP
        # training): the check compares each dtype it names against a float64 reference, with autograd,
        # whatever the caller's modes (under autocast the reference itself ran in bfloat16: a right kernel
        # failed its float32 check and training silently took the reference path).
        with contextlib.ExitStack() as modes:
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
            for kind in ("cpu", "cuda"):
                if kind == "cpu" or torch.cuda.is_available():
                    modes.enter_context(torch.autocast(kind, enabled=False))
            figures = check.run(device)
        verdict = Verdict(check.path, VERIFIED, "", figures, key)
    except Mismatch as e:
        verdict = Verdict(check.path, FAILED, e.worst, e.figures, key)
    except Skip as e:
        verdict = Verdict(check.path, SKIPPED, str(e), {}, key)
    except Exception as e:  # an error of the fast path is a failed check, never a crash of the caller
        text = " ".join(str(e).split())[:200]
        verdict = Verdict(check.path, FAILED, f"error: {type(e).__name__}: {text}", {}, key)
    finally:
        _RUNNING.paths = running
    verdict.seconds = round(time.perf_counter() - t0, 3)
    return verdict


def verify(path: str, device: Any = "cpu", rerun: bool = False) -> Verdict:
    """The verdict of `path` on `device`: the stored one (unless `rerun`), else the check's, recorded.
    Skipped (not recorded) when the path does not apply to the device's type."""
    import torch

    check = _CHECKS[path]
    dev = torch.device(device)
    if dev.type not in check.device_types:
        kinds = "/".join(check.device_types)
        return Verdict(path, SKIPPED, f"runs on {kinds} only, not on {dev.type}", {}, {"path": path})
    with _LOCK:
        try:
            key = _key(check, dev)
        except Exception as e:  # the fingerprint itself failed (the path's module does not import)
            return Verdict(path, FAILED, f"error: {type(e).__name__}: {e}"[:200], {}, {"path": path})
        folder = store_dir()
        verdict = None if rerun else _read(folder, path, key)
        if verdict is None:
            verdict = _run(check, dev, key)
            _write(folder, verdict)
        _VERDICTS[(path, str(dev))] = verdict
        return verdict


def trusted(path: str, device: Any) -> bool:
    """Whether `path` may run on `device` (first use: the check, see `verify`). A failed path says so in
    one warning line, once per process; a skipped one is not trusted either. Inside its own check a path
    is trusted (the check runs it)."""
    if path in getattr(_RUNNING, "paths", ()):
        return True
    verdict = _VERDICTS.get((path, str(device)))
    if verdict is None:
        verdict = verify(path, device)
    if verdict.status == FAILED:
        warn_once(path, verdict.line())
    return verdict.status == VERIFIED


def warn_once(key: str, line: str) -> None:
    """`line` as one warning of the `pfk.selfcheck` logger, the first time this process warns about `key`
    (a path, or a path and the engine it checked); `forget()` starts over."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(line)


# --------------------------------------------------------------------------------------------------
# comparing (what the checks share)
# --------------------------------------------------------------------------------------------------
def compare(figures: Figures, name: str, got: Any, want: Any, tol: float, rel: bool = False) -> None:
    """figures[name] = max |got - want| (relative to max |want| when `rel`), compared as float64; a shape
    mismatch or a NaN where the reference has none is infinite. Raises Mismatch (all figures so far) when it
    exceeds `tol`."""
    import torch

    got_t, want_t = torch.as_tensor(got).double().cpu(), torch.as_tensor(want).double().cpu()
    if got_t.shape != want_t.shape:
        err = float("inf")
    else:
        same_nan = torch.isnan(got_t) & torch.isnan(want_t)
        diff = torch.where(same_nan, 0.0, (got_t - want_t).abs())
        diff = torch.where(torch.isnan(diff), float("inf"), diff)
        err = float(diff.max()) if diff.numel() else 0.0
        if rel and err:
            err /= max(float(want_t.abs().max()), 1e-30)
    figures[name] = err
    if not err <= tol:
        label = "rel" if rel else "max"
        raise Mismatch(f"{name}: {label}|err| {err:.3g} > tol {tol:.3g}", figures)


def format_figures(figures: Figures, limit: int = 4) -> str:
    """`name err, ...` of the largest figures, for a table cell."""
    worst = sorted(figures.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{k} {v:.2g}" for k, v in worst)
