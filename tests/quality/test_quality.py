"""Model quality regression benchmark (full tier): train each built-in architecture at the default size on a
seed nobody tunes on, and fail below its floor.

The data and training seeds here (`QUALITY_SEED`) are not the default run's (0) nor any seed a tuning run
used; the floors sit under what the default size reaches (docs/MODELS.md, "Quality floors") with margin for
the 2-3x CPU differences between machines (the figures are KPIs, not timings: they do not depend on speed).
The scores are those of train's last validation (`val_curves.json`): the val split's nuScenes-definition KPIs
computed by the same function as the evaluate stage (`pfactory.detectors.inference.evaluate_kpis`).
`scripts/mutation_check.py --only quality` plants a quality bug (the box regression term dropped from the
default's loss) that this test catches.

    bash scripts/test.sh tests/quality -m full    # ~6-10 min per architecture on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUALITY_SEED = 101
# arch -> (overrides, floors): "mAP", "<class>/ap_<m>" and "<class>/mean_ap" are minimums, "<class>/aoe" and
# "<class>/ate" maximums. Measured on QUALITY_SEED (docs/MODELS.md, "Quality floors"): painted_pillars mAP 0.749,
# Car AP@2m 0.923, Car mean AP 0.843, Car AOE 0.330, ATE 0.243; centerpoint_lidar (with its point heading,
# 2026-12-05) mAP 0.780, Car AP@2m 0.920, mean AP 0.857, AOE 0.178, ATE 0.197, Pedestrian AOE 0.503, Cyclist
# AOE 0.405 (1.92 / 1.37 before the point heading and the refiner). Car mean AP (over 0.5-4 m) >= 0.85 would
# fail on this seed by noise (0.876 on seed 0): the Car floor is at the 2 m threshold, the mean AP's a margin
# under the measured. The heading floors are issue 46's target (0.8 rad).
ARCHS = {
    "painted_pillars": ([], {"mAP": 0.70, "Car/ap_2.0": 0.85, "Car/mean_ap": 0.80, "Car/aoe": 0.5, "Car/ate": 0.35}),
    "centerpoint_lidar": ([], {"mAP": 0.70, "Car/ap_2.0": 0.85, "Car/mean_ap": 0.80, "Car/aoe": 0.4,
                               "Car/ate": 0.30, "Pedestrian/aoe": 0.8, "Cyclist/aoe": 0.8}),
}


def _stage(stage: str, *args: str, env: dict[str, str]) -> dict:
    """`python -m tasks.<stage> --params <tmp>/params.yaml ...`: every path relative to the temp project."""
    params = Path(env["QUALITY_ROOT"]) / "params.yaml"
    r = subprocess.run([sys.executable, "-m", f"tasks.{stage}", "--params", str(params), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert r.returncode == 0, f"{stage} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout[r.stdout.index("{"):]) if "{" in r.stdout else {}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The default-size synthetic dataset on QUALITY_SEED, prepared (shared by both architectures)."""
    root = tmp_path_factory.mktemp("quality")
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())  # paths relative to `root`
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "QUALITY_ROOT": str(root)}
    _stage("synth", "-S", f"synth.seed={QUALITY_SEED}", "-S", f"paths.synth={root / 'raw'}", env=env)
    _stage("prepare", "--raw", str(root / "raw"), "--out", str(root / "prepared"), env=env)
    return root, env


def _check_floors(scores: dict[str, float], floors: dict[str, float]) -> list[str]:
    bad = []
    for key, floor in floors.items():
        value = scores.get(key)
        upper = key.endswith(("/aoe", "/ate"))
        if value is None or (value > floor if upper else value < floor):
            bad.append(f"{key} = {value} ({'>' if upper else '<'} floor {floor})")
    return bad


def test_floors_can_fail() -> None:
    """The check itself: a score under a minimum or over a maximum fails, a missing one fails."""
    floors = ARCHS["painted_pillars"][1]
    good = {"mAP": 0.8, "Car/ap_2.0": 0.9, "Car/mean_ap": 0.9, "Car/aoe": 0.2, "Car/ate": 0.1}
    assert _check_floors(good, floors) == []
    assert _check_floors({**good, "mAP": 0.5}, floors) == ["mAP = 0.5 (< floor 0.7)"]
    assert _check_floors({**good, "Car/aoe": 1.2}, floors) == ["Car/aoe = 1.2 (> floor 0.5)"]
    assert len(_check_floors({}, floors)) == len(floors)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_quality_floor(arch: str, prepared: tuple[Path, dict[str, str]]) -> None:
    root, env = prepared
    overrides, floors = ARCHS[arch]
    sets = [x for o in [f"model.arch={arch}", f"train.seed={QUALITY_SEED}", *overrides] for x in ("-S", o)]
    out = root / f"model-{arch}"
    _stage("train", "--data", str(root / "prepared"), "--out", str(out), "--no-track", *sets, env=env)
    scores = json.loads((out / "val_curves.json").read_text())[-1]
    figures = {k: scores.get(k) for k in ("mAP", "NDS", *(f"{c}/{m}" for c in ("Car", "Pedestrian", "Cyclist")
                                                        for m in ("ap_2.0", "mean_ap", "aoe", "ate")))}  # fmt: skip
    print(f"quality {arch} seed {QUALITY_SEED}: {json.dumps(figures)}")
    bad = _check_floors(scores, floors)
    assert not bad, f"{arch} below its quality floor on seed {QUALITY_SEED}: " + "; ".join(bad)
