"""The evaluate stage on nuScenes data: report/results_nusc.json (the optimized model's detections in the
global frame) that the devkit's loader accepts, named in kpis.json; a raw dataset that is not the data's
nuScenes tables is refused before any work. Heavy tier (a tiny 2-camera setup and a Dask run, ~40 s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`, not tests/'s namespace packages
    sys.path.insert(0, str(ROOT))

from flows.params import Params  # noqa: E402
from pfactory.evaluate.params import EvaluateParams  # noqa: E402
from tests.evaluate.helpers import build_eval_setup  # noqa: E402

pytestmark = pytest.mark.full


def _params() -> Params:
    return Params(evaluate=EvaluateParams(slice_frames=2, batch_size=2, worst_frames=1, reference=False))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    return build_eval_setup(tmp_path_factory.mktemp("evaluate_nusc"), frames=8, cameras=2)


def test_stage_writes_a_submission_the_devkit_loads(setup, tmp_path, monkeypatch) -> None:
    pytest.importorskip("nuscenes", reason="nuscenes-devkit not installed (requirements/devkit.txt)")
    import pyarrow.parquet as pq
    from nuscenes.eval.common.loaders import load_prediction
    from nuscenes.eval.detection.data_classes import DetectionBox

    import tasks.evaluate
    from pfactory.evaluate.nusc_submission import DETECTION_NAME, load_poses

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval"
    tasks.evaluate.run(_params(), setup["optimized"], None, setup["prepared"], out, "local:1", track=False,
                       raw=setup["raw"])  # fmt: skip
    doc = json.loads((out / "kpis.json").read_text())
    # The stage's KITTI outputs (declared DVC outs) exist for every dataset: empty for nuScenes data.
    assert "kitti" not in doc and (out / "kitti_frames.txt").read_text() == ""
    assert list((out / "kitti_results").iterdir()) == []
    info = doc["nusc_results"]
    assert info["file"] == "report/results_nusc.json" and info["samples"] == doc["data"]["frames"]
    path = out / info["file"]
    boxes, meta = load_prediction(str(path), 500, DetectionBox)
    assert len(boxes.sample_tokens) == doc["data"]["frames"] and meta["use_camera"] is True
    rows = [
        r
        for r in pq.read_table(out / "report" / "predictions.parquet").to_pylist()
        if r["kind"] == "optimized"
    ]
    assert info["boxes"] == len(rows) == sum(c["num_pred"] for c in doc["classes"].values()) > 0
    # Box by box: the file holds the predictions table's boxes moved by the sample's global pose.
    poses = load_poses(setup["raw"], sorted({r["frame_id"] for r in rows}), "ego_axes").T_global_from_ref
    for r in rows[:50]:
        got = [b for b in boxes[r["frame_id"]] if b.detection_score == r["score"]]
        T = poses[r["frame_id"]]
        want = T[:3, :3] @ [r["x"], r["y"], r["z"]] + T[:3, 3]
        assert any(
            np.allclose(b.translation, want, atol=1e-9) and b.size == (r["w"], r["l"], r["h"]) for b in got
        )
        assert all(
            b.detection_name == DETECTION_NAME[r["name"]] for b in got if np.allclose(b.translation, want)
        )


def test_a_raw_dataset_without_the_samples_is_refused_before_any_work(setup, tmp_path, monkeypatch) -> None:
    import tasks.evaluate
    from pfactory.evaluate.inputs import EvaluateInputError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(EvaluateInputError, match="raw nuScenes dataset"):
        tasks.evaluate.run(_params(), setup["optimized"], None, setup["prepared"], tmp_path / "eval", "local:1",
                           track=False, raw=tmp_path / "nowhere")  # fmt: skip
    assert not (tmp_path / "eval").exists()
