"""Install a plugin package (examples/dataset-plugin, examples/detector-plugin, ...) for a test, the way a user
would, into a folder of its own: `install_plugin(src, target)` -> the environment variables a subprocess needs
to see it (its entry points included).

`pip install --no-deps --no-build-isolation --target` from a copy of the source (so no build/ or egg-info is
left in the checkout): fast and offline -- the build backend (setuptools) and the plugin's dependencies come
from this venv. The plugin is visible only to processes started with the returned `PYTHONPATH`, never to the
test process itself (whose entry points stay the project's), so tests stay independent of each other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def install_plugin(src: Path, target: Path) -> dict[str, str]:
    """Install the package at `src` (a folder with a pyproject.toml) into `target`; returns a copy of
    `os.environ` with `PYTHONPATH` = `target` first, then the project's root (so `pfactory`, `tasks` and
    `flows` import as from the checkout). Installing again into the same target replaces the package (an
    older version's dist-info is removed: `--target` would keep it beside the new one). Raises RuntimeError
    with pip's output when the install fails."""
    src, target = Path(src).resolve(), Path(target).resolve()
    if not (src / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{src}: a plugin package (pyproject.toml), got none")
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob(f"{_dist_name(src)}-*.dist-info"):
        shutil.rmtree(old)
    with tempfile.TemporaryDirectory(prefix="plugin-src-") as tmp:
        copy = Path(tmp) / src.name
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--disable-pip-version-check", "--upgrade", "-q", "--target", str(target), str(copy)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"pip install of {src} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _dist_name(src: Path) -> str:
    """The distribution name of a source folder's pyproject.toml, normalized as a dist-info folder is."""
    found = re.search(r'^name = "([^"]+)"', (src / "pyproject.toml").read_text(), re.MULTILINE)
    if not found:
        raise ValueError(f"{src / 'pyproject.toml'}: no [project] name")
    return re.sub(r"[-_.]+", "_", found.group(1)).lower()


def broken_plugin(target: Path, group: str, name: str, target_spec: str, dist: str = "broken-plugin") -> None:
    """A distribution in `target` (found through `PYTHONPATH`) that declares the entry point `name` of `group`
    pointing at `target_spec` ("module:attr"), with no code: a plugin whose module is missing."""
    info = Path(target) / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target_spec}\n")
