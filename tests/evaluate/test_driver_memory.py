"""The evaluate driver keeps no detections while the units land (issue 50): once every unit of both models
has come back, no `FrameDetections` is alive in the driver, what it keeps per unit holds no boxes, and the
scoring, which reads the boxes back from the parts, gives the stage's KPIs. A real Dask run of the tiny
setup (tests/evaluate/helpers.py, ~30 s); the KPIs themselves are checked against `factory kpi` and across
worker counts by tests/tasks/test_evaluate.py."""

from __future__ import annotations

import gc
import json

from pfactory.evaluate import evaluation
from pfactory.evaluate.params import EvaluateParams
from pfactory.metrics.detection import FrameDetections
from tests.evaluate.helpers import build_eval_setup


def _alive() -> int:
    gc.collect()
    return sum(type(o) is FrameDetections for o in gc.get_objects())


def test_no_detections_are_held_in_the_driver_once_the_units_land(tmp_path, monkeypatch) -> None:
    setup = build_eval_setup(tmp_path / "setup")
    monkeypatch.chdir(tmp_path)  # Dask's scratch
    seen: dict = {}
    score_and_report = evaluation._score_and_report

    def observed(ev, inputs, results, *args, **kw):  # the real step, observed as it starts
        seen["alive"] = _alive()
        seen["records"] = [r for by_unit in results.values() for r in by_unit.values()]
        seen["units"] = len(inputs.units)
        return score_and_report(ev, inputs, results, *args, **kw)

    monkeypatch.setattr(evaluation, "_score_and_report", observed)
    before = _alive()
    ev = EvaluateParams(slice_frames=2, batch_size=2, worst_frames=2)
    out = tmp_path / "eval"
    metrics = evaluation.evaluate(
        ev,
        setup["optimized"],
        setup["model"],
        setup["prepared"],
        out,
        "local:1",
        False,
        None,
        raw=setup["raw"],
    )

    assert seen["alive"] == before, "the driver holds detections after the units landed"
    assert len(seen["records"]) == 2 * seen["units"] > 2  # both models, several units
    for r in seen["records"]:
        assert not hasattr(r, "gt") and not hasattr(r, "pred")
        assert all(isinstance(f, str) for f in r.frame_ids)
    doc = json.loads((out / "kpis.json").read_text())
    assert doc["mAP"] == metrics["mAP"] and doc["data"]["frames"] == metrics["frames"]
    assert doc["reference"] is not None and not (out / "report" / ".parts").exists()
