"""Shared test fixtures: the real KITTI / nuScenes sample files and tmp datasets built from them.

The real files live outside the repo in `../shared/data/real/` (see its SOURCES.md; they are
CC BY-NC-SA and are never copied into the repo). `PFACTORY_REAL_DATA` points elsewhere.
Tests that need them skip with the reason when they are absent. Tests that modify data work
on copies in `tmp_path` (copies, never symlinks: a write through a symlink would corrupt the
shared originals).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

REAL_DATA_ENV = "PFACTORY_REAL_DATA"


def real_data_root() -> Path:
    """`$PFACTORY_REAL_DATA`, else `<repo>/../shared/data/real`."""
    env = os.environ.get(REAL_DATA_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared/data/real"


@pytest.fixture(scope="session")
def real_kitti_dir() -> Path:
    """Root of the 6 real KITTI frames (`<root>/training/{velodyne,image_2,calib,label_2}`)."""
    d = real_data_root() / "kitti"
    if not (d / "training" / "velodyne").is_dir():
        pytest.skip(f"real KITTI frames not found at {d} (set {REAL_DATA_ENV} to the data/real folder)")
    return d


@pytest.fixture(scope="session")
def real_nuscenes_dir() -> Path:
    """Root of the real nuScenes files (`samples/`, `sweeps/`, `mmdet3d_derived/`; no tables)."""
    d = real_data_root() / "nuscenes"
    if not (d / "samples" / "LIDAR_TOP").is_dir() or not (d / "mmdet3d_derived").is_dir():
        pytest.skip(f"real nuScenes files not found at {d} (set {REAL_DATA_ENV} to the data/real folder)")
    return d


@pytest.fixture
def kitti_copy(real_kitti_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the real KITTI frames: returns the dataset root (`.../kitti`)."""
    dst = tmp_path / "kitti"
    for part in ("velodyne", "image_2", "calib", "label_2"):
        shutil.copytree(real_kitti_dir / "training" / part, dst / "training" / part)
    return dst


# ---------------------------------------------------------------------------------------------
# A nuScenes table set around the real files.
#
# The real folder has sensor files but no tables. Two samples are written:
# - sample "demo" (log n015-2018-07-24, mmdetection3d's demo): the full 34,688-point sweep and
#   the six camera images taken with it;
# - sample "mono3d" (log n015-2018-07-18, mmdetection3d's nus_infos_mono3d.coco.json): its
#   CAM_BACK_LEFT image with the exact calibration, ego pose and annotations of that JSON. The
#   JSON's other five images are not in the real folder: those channels reuse the demo's image
#   of the same channel as a stand-in (only their size, 1600x900, matters to the geometry), and
#   the lidar file is the real 40-point stub (a different log: the JSON has no lidar).
# Camera calibration (intrinsics, cam->ego) comes from the JSON for every channel and both
# samples: the same vehicle (n015), six days apart. The lidar calibration is the LIDAR_TOP
# record of this vehicle in nuScenes v1.0-mini; ego poses of the demo sample are plausible
# made-up values (the camera and lidar poses differ by a few cm, as the ego moves between
# their timestamps).

LIDAR_CS = {  # n015 LIDAR_TOP calibrated_sensor (nuScenes v1.0-mini, scene-0061)
    "translation": [0.943713, 0.0, 1.84023],
    "rotation": [0.7077955119163518, -0.006492242056004365, 0.010646214713995808, -0.7063073142877817],
}
DEMO_FILES = {
    "LIDAR_TOP": "samples/LIDAR_TOP/n015-2018-07-24-11-22-45+0800__LIDAR_TOP__1532402927647951.pcd.bin",
    "CAM_FRONT": "samples/CAM_FRONT/n015-2018-07-24-11-22-45+0800__CAM_FRONT__1532402927612460.jpg",
    "CAM_FRONT_RIGHT": "samples/CAM_FRONT_RIGHT/n015-2018-07-24-11-22-45+0800__CAM_FRONT_RIGHT__1532402927620339.jpg",
    "CAM_BACK_RIGHT": "samples/CAM_BACK_RIGHT/n015-2018-07-24-11-22-45+0800__CAM_BACK_RIGHT__1532402927627893.jpg",
    "CAM_BACK": "samples/CAM_BACK/n015-2018-07-24-11-22-45+0800__CAM_BACK__1532402927637525.jpg",
    "CAM_BACK_LEFT": "samples/CAM_BACK_LEFT/n015-2018-07-24-11-22-45+0800__CAM_BACK_LEFT__1532402927647423.jpg",
    "CAM_FRONT_LEFT": "samples/CAM_FRONT_LEFT/n015-2018-07-24-11-22-45+0800__CAM_FRONT_LEFT__1532402927604844.jpg",
}
MONO3D_LIDAR = "samples/LIDAR_TOP/n015-2018-08-02-17-16-37+0800__LIDAR_TOP__1533201470948018.pcd.bin"
MONO3D_CAM = "samples/CAM_BACK_LEFT/n015-2018-07-18-11-07-57+0800__CAM_BACK_LEFT__1531883530447423.jpg"
DEMO_TOKEN = "demo0000000000000000000000000000"
MONO3D_TOKEN = "e93e98b63d3b40209056d129dc53ceee"  # the JSON's sample token


@dataclass
class NuScenesFixture:
    """A tmp nuScenes root and what was written into it."""

    root: Path
    version: str
    demo_token: str
    mono3d_token: str
    # annotation token -> (channel, center2d [3] (u, v, depth), bbox [4] x1 y1 x2 y2 from the JSON)
    expected: dict[str, tuple[str, np.ndarray, np.ndarray]] = field(default_factory=dict)

    def table_path(self, name: str) -> Path:
        return self.root / self.version / f"{name}.json"

    def load(self, name: str) -> list[dict]:
        return json.loads(self.table_path(name).read_text())

    def save(self, name: str, rows: list[dict]) -> None:
        self.table_path(name).write_text(json.dumps(rows, indent=1))


def _quat_z(yaw: float) -> list[float]:
    return [float(np.cos(yaw / 2)), 0.0, 0.0, float(np.sin(yaw / 2))]


def build_nuscenes_tables(real: Path, root: Path, version: str = "v1.0-mini") -> NuScenesFixture:
    """Copy the real files into `root` and write the 8 tables (see the comment above)."""
    from pfactory.sensors.geometry import make_transform, quaternion_to_matrix

    mono = json.loads((real / "mmdet3d_derived/nus_infos_mono3d.coco.json").read_text())
    images = {im["file_name"].split("__")[1]: im for im in mono["images"]}  # channel -> image info
    for rel in [*DEMO_FILES.values(), MONO3D_LIDAR, MONO3D_CAM]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real / rel, root / rel)

    rows: dict[str, list[dict]] = {
        t: []
        for t in ("sample", "sample_data", "calibrated_sensor", "ego_pose", "sensor", "sample_annotation")
    }
    rows["instance"], rows["category"] = [], []
    for ch in ("LIDAR_TOP", *images):
        modality = "lidar" if ch == "LIDAR_TOP" else "camera"
        rows["sensor"].append({"token": f"sensor-{ch}", "channel": ch, "modality": modality})

    def ts_of(rel: str) -> int:
        return int(Path(rel).name.split("__")[-1].split(".")[0])

    def add_sd(sample: str, ch: str, rel: str, ego: dict, log: str) -> None:
        cs_tok = f"cs-{log}-{ch}"
        if not any(r["token"] == cs_tok for r in rows["calibrated_sensor"]):
            if ch == "LIDAR_TOP":
                cs = {**LIDAR_CS, "camera_intrinsic": []}
            else:
                im = images[ch]
                cs = {
                    "translation": im["cam2ego_translation"],
                    "rotation": im["cam2ego_rotation"],
                    "camera_intrinsic": im["cam_intrinsic"],
                }
            rows["calibrated_sensor"].append({"token": cs_tok, "sensor_token": f"sensor-{ch}", **cs})
        ep_tok = f"ep-{sample[:6]}-{ch}"
        rows["ego_pose"].append({"token": ep_tok, "timestamp": ts_of(rel), **ego})
        rec = {
            "token": f"sd-{sample[:6]}-{ch}",
            "sample_token": sample,
            "ego_pose_token": ep_tok,
            "calibrated_sensor_token": cs_tok,
            "filename": rel,
            "fileformat": "pcd" if ch == "LIDAR_TOP" else "jpg",
            "timestamp": ts_of(rel),
            "is_key_frame": True,
            "prev": "",
            "next": "",
        }
        if ch != "LIDAR_TOP":
            rec["width"], rec["height"] = 1600, 900
        rows["sample_data"].append(rec)

    # Sample "demo": plausible ego poses, the camera ones a few cm along the heading.
    yaw = -1.93
    for ch, rel in DEMO_FILES.items():
        dt_s = (ts_of(rel) - ts_of(DEMO_FILES["LIDAR_TOP"])) * 1e-6
        t = np.array([411.3, 1180.9, 0.0]) + 5.0 * dt_s * np.array([np.cos(yaw), np.sin(yaw), 0])
        add_sd(DEMO_TOKEN, ch, rel, {"translation": t.tolist(), "rotation": _quat_z(yaw)}, "0724")
    rows["sample"].append(
        {
            "token": DEMO_TOKEN,
            "timestamp": ts_of(DEMO_FILES["LIDAR_TOP"]),
            "scene_token": "scene-0724",
            "prev": "",
            "next": "",
        }
    )

    # Sample "mono3d": the JSON's ego pose for the cameras; the lidar 0.2 m behind.
    cam_ego = {
        "translation": images["CAM_BACK_LEFT"]["ego2global_translation"],
        "rotation": images["CAM_BACK_LEFT"]["ego2global_rotation"],
    }
    R_ego = quaternion_to_matrix(cam_ego["rotation"])
    lidar_ego = {
        "translation": (np.asarray(cam_ego["translation"]) - R_ego @ [0.2, 0.0, 0.0]).tolist(),
        "rotation": cam_ego["rotation"],
    }
    add_sd(MONO3D_TOKEN, "LIDAR_TOP", MONO3D_LIDAR, lidar_ego, "0718")
    for ch in images:
        rel = MONO3D_CAM if ch == "CAM_BACK_LEFT" else DEMO_FILES[ch]
        ego = {
            "translation": images[ch]["ego2global_translation"],
            "rotation": images[ch]["ego2global_rotation"],
        }
        add_sd(MONO3D_TOKEN, ch, rel, ego, "0718")
    rows["sample"].append(
        {
            "token": MONO3D_TOKEN,
            "timestamp": 1531883530447423,
            "scene_token": "scene-0718",
            "prev": "",
            "next": "",
        }
    )

    # Annotations: the JSON's camera-frame boxes -> global frame. bbox_cam3d is (x, y, z) the
    # box centre in the camera frame, then nuScenes' (w, l, h) and a yaw r about the camera's
    # y axis with the length axis along (cos r, 0, sin r) in the camera frame (fitted: that
    # convention puts every projected box within ~6 px of the JSON's 2D boxes).
    expected = {}
    for a in mono["annotations"]:
        ch = a["file_name"].split("__")[1]
        im = images[ch]
        T_ego_from_cam = make_transform(
            quaternion_to_matrix(im["cam2ego_rotation"]), im["cam2ego_translation"]
        )
        T_global_from_ego = make_transform(
            quaternion_to_matrix(im["ego2global_rotation"]), im["ego2global_translation"]
        )
        T = T_global_from_ego @ T_ego_from_cam
        x, y, z, w, l, h, r = a["bbox_cam3d"]
        centre = T[:3, :3] @ [x, y, z] + T[:3, 3]
        heading = T[:3, :3] @ [np.cos(r), 0.0, np.sin(r)]
        yaw_g = float(np.arctan2(heading[1], heading[0]))
        cat_tok = f"cat-{a['category_name']}"
        if not any(c["token"] == cat_tok for c in rows["category"]):
            rows["category"].append({"token": cat_tok, "name": a["category_name"], "description": ""})
        tok = f"ann-{a['id']:02d}"
        rows["instance"].append(
            {"token": f"inst-{a['id']:02d}", "category_token": cat_tok, "nbr_annotations": 1}
        )
        rows["sample_annotation"].append(
            {
                "token": tok,
                "sample_token": MONO3D_TOKEN,
                "instance_token": f"inst-{a['id']:02d}",
                "translation": centre.tolist(),
                "size": [w, l, h],
                "rotation": _quat_z(yaw_g),
                "num_lidar_pts": -1,
                "num_radar_pts": 0,
                "attribute_tokens": [],
                "visibility_token": "",
                "prev": "",
                "next": "",
            }
        )
        bx, by, bw, bh = a["bbox"]
        expected[tok] = (ch, np.asarray(a["center2d"]), np.array([bx, by, bx + bw, by + bh]))

    (root / version).mkdir(parents=True, exist_ok=True)
    for name, recs in rows.items():
        (root / version / f"{name}.json").write_text(json.dumps(recs, indent=1))
    return NuScenesFixture(root, version, DEMO_TOKEN, MONO3D_TOKEN, expected)


@pytest.fixture
def nuscenes_tables(real_nuscenes_dir: Path, tmp_path: Path) -> NuScenesFixture:
    """A writable nuScenes root in tmp_path with two samples (see `build_nuscenes_tables`)."""
    return build_nuscenes_tables(real_nuscenes_dir, tmp_path / "nuscenes")


@pytest.fixture(scope="session")
def int8_bench(tmp_path_factory):
    """tests/optimize/helpers.py `int8_bench`, once per session (the INT8 parity and promotion gate tests)."""
    from tests.optimize.helpers import int8_bench as build

    return build(tmp_path_factory.mktemp("int8-bench"))


# ---------------------------------------------------------------------------------------------
# Test tiers (docs/TESTING.md). The default tier is what CI and the README's test command run; tests
# marked `full` (heavy checks that add little regression power per minute: realistic-size end-to-end
# runs, the whole fault matrix, long benchmarks) run only with `--full` (`bash scripts/test.sh --full`).


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=False,
        help="also run the tests marked `full` (the heavy tier; docs/TESTING.md)",
    )


EXPORT_CACHE_ENV = "PFACTORY_EXPORT_CACHE_DIR"  # pfactory.optimize.export_cache.CACHE_ENV


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--full"):
        # The fault suite's own switch (tests/faults/conftest.py reads it at import, after this hook):
        # every kill point, 3 trials each, the concurrent runs with training.
        os.environ.setdefault("PFACTORY_FAULTS_FULL", "1")
    config._pf_t0 = time.monotonic()  # type: ignore[attr-defined]
    if not hasattr(config, "workerinput") and EXPORT_CACHE_ENV not in os.environ:
        # One folder of traced export graphs for the whole run (the xdist workers inherit the variable): the
        # optimize stages of the tests' projects trace each architecture once, as a project's runs do
        # (pfactory/optimize/export_cache.py). Projects of the pipeline tests start without it (clean_env).
        folder = tempfile.mkdtemp(prefix="pf-test-export-cache-")
        os.environ[EXPORT_CACHE_ENV] = folder
        config._pf_export_cache = folder  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_pf_export_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(EXPORT_CACHE_ENV, None)


# Session fixtures that take tens of seconds to build (a tracked evaluation, the gate bench's models, an exported
# graph). Each pytest-xdist worker builds its own copy of a session fixture, so the test modules that use one of
# these, directly or through another fixture, must run on one worker. scripts/test.sh runs `--dist loadfile`,
# and `pytest_xdist_make_scheduler` below keeps XDIST_GROUPS' modules together (one work unit per group; every
# other module is a unit of its own, as with plain loadfile). (pytest-xdist's own `--dist loadgroup` does not
# group under pytest 9.2: it renames `item._nodeid`, which pytest no longer reads.)
SHARED_SESSION_FIXTURES = frozenset({"tracked_eval", "bench", "exported"})
XDIST_GROUPS = {  # path prefix -> work unit (the longest prefix wins); checked at collection against the fixtures
    "tests/report/": "tracked_eval",
    "tests/promote/": "bench",
    "tests/tasks/test_promote.py": "bench",
    "tests/faults/test_concurrency.py": "bench",
    "tests/optimize/test_gated_artifact.py": "bench",
    "tests/optimize/test_int8_gates.py": "bench",
    "tests/optimize/": "exported",
}


def xdist_unit(module: str) -> str:
    """The xdist work unit of a test module path (`tests/x/test_y.py`): its XDIST_GROUPS group, else itself."""
    prefixes = [p for p in XDIST_GROUPS if module.startswith(p)]
    return XDIST_GROUPS[max(prefixes, key=len)] if prefixes else module


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs without pytest-xdist: then the hook is unknown
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # pytest-xdist's hook (controller only)
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadFileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid.split("::", 1)[0])

    return LoadFileGroups(config, log)


def _check_xdist_groups(items: list[pytest.Item]) -> None:
    """Every module that uses a SHARED_SESSION_FIXTURES fixture is in the same XDIST_GROUPS unit as the other
    modules using it; else a usage error naming the module (the table cannot go stale silently)."""
    users: dict[str, set[str]] = {}
    for item in items:
        for name in SHARED_SESSION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            users.setdefault(name, set()).add(item.nodeid.split("::", 1)[0])
    for name, modules in users.items():
        units = {m: xdist_unit(m) for m in modules}
        if len(set(units.values())) > 1:
            raise pytest.UsageError(
                f"tests/conftest.py XDIST_GROUPS: the modules using the session fixture {name!r} must be in one "
                f"group (one pytest-xdist worker builds it once); now: {dict(sorted(units.items()))}"
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--full"):
        heavy = [item for item in items if item.get_closest_marker("full") is not None]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item.get_closest_marker("full") is None]
    _check_xdist_groups(items)


# The suite's wall-time guard. `bash scripts/test.sh` with no arguments (what CI runs) sets
# PFACTORY_TEST_BUDGET_S: a default tier that outgrows it fails the run the day it happens, with the time.
BUDGET_ENV = "PFACTORY_TEST_BUDGET_S"
SLOWEST = 25  # the summary lists this many slowest tests: where the next minute of budget goes


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _is_xdist_worker(config):
        return
    wall = time.monotonic() - config._pf_t0  # type: ignore[attr-defined]
    tier = "full" if config.getoption("--full") else "default"
    budget = os.environ.get(BUDGET_ENV)
    limit = f", budget {float(budget):.0f} s ({BUDGET_ENV})" if budget else ""
    # Seconds per test folder (setup + call + teardown of its tests, summed over the workers): the table
    # docs/TESTING.md keeps, so growth shows where it happens.
    per_folder: dict[str, float] = {}
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid, duration = getattr(rep, "nodeid", ""), getattr(rep, "duration", None)
            if nodeid and isinstance(duration, float):
                folder = nodeid.split("::")[0].rsplit("/", 1)[0] + "/"
                per_folder[folder] = per_folder.get(folder, 0.0) + duration
                per_test[nodeid] = per_test.get(nodeid, 0.0) + duration
    if per_folder:
        terminalreporter.write_line(
            "test seconds per folder: "
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per_folder.items(), key=lambda kv: -kv[1]))
        )
        slowest = sorted(per_test.items(), key=lambda kv: -kv[1])[:SLOWEST]
        terminalreporter.write_line(f"the {len(slowest)} slowest tests (setup + call + teardown, seconds):")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"  {seconds:6.1f}  {nodeid}")
    terminalreporter.write_line(f"test suite wall time: {wall:.0f} s, {tier} tier{limit}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    budget = os.environ.get(BUDGET_ENV)
    if _is_xdist_worker(config) or not budget or config.getoption("--full"):
        return
    wall = time.monotonic() - config._pf_t0  # type: ignore[attr-defined]
    if wall > float(budget) and session.exitstatus == 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"FAILED: the default test tier took {wall:.0f} s, over its budget of {float(budget):.0f} s "
                f"({BUDGET_ENV}; docs/TESTING.md): move heavy checks to the full tier or make them cheaper",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def selfcheck_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh self-check verdict store for the test (`PFK_SELFCHECK_DIR`), and this process's verdicts
    forgotten before and after (`kernels.selfcheck.forget`)."""
    from kernels import selfcheck

    folder = tmp_path / "selfcheck"
    monkeypatch.setenv("PFK_SELFCHECK_DIR", str(folder))
    selfcheck.forget()
    yield folder
    selfcheck.forget()
