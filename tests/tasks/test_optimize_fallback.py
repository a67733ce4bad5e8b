"""The optimize stage ships what passed parity: an INT8 artifact outside its gate is refused and removed, the
FP32 artifact that passed becomes the primary, and the stage says so (stderr, backend.json "selection",
parity.json "refused"/"fallback", MLflow tags); it exits 0. The stage fails only when no artifact passes
(tests/tasks/test_optimize.py::test_failed_parity_exits_1_writes_nothing_and_keeps_the_report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.tasks.test_optimize import _params, dataset  # noqa: F401 (the module-scoped fixture)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def test_int8_refused_by_parity_ships_fp32_and_says_so(dataset, tmp_path, monkeypatch, capsys) -> None:  # noqa: F811
    import mlflow
    import yaml

    import tasks.optimize

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "optimized"
    # A real INT8 artifact is never bit-identical to PyTorch: a zero score tolerance refuses it, FP32 passes.
    opt = _params(precision="int8", parity={"int8": {"scores_atol": 0.0}}, latency={"eager": False})
    params_file = tmp_path / "params.yaml"
    paths = {"model": str(dataset["model"]), "prepared": str(dataset["prepared"]), "optimized": str(out)}
    params_file.write_text(yaml.safe_dump({"paths": paths, "optimize": opt.model_dump(mode="json")}))
    tasks.optimize.main(["--params", str(params_file)])  # a stage that succeeds returns (a failure exits)
    err = capsys.readouterr().err
    assert "onnxruntime/int8 failed parity (onnxruntime/int8: scores: max |diff|" in err, err[-2000:]
    assert "shipping what passed: onnxruntime/fp32" in err

    manifest = json.loads((out / "backend.json").read_text())
    assert manifest["primary"] == {"backend": "onnxruntime", "precision": "fp32"}
    assert [a["precision"] for a in manifest["artifacts"]] == ["fp32"]
    assert not (out / "onnxruntime" / "model.int8.onnx").exists()  # the refused artifact is not shipped
    sel = manifest["selection"]
    assert sel["fallback"]["asked"] == "onnxruntime/int8" and sel["fallback"]["primary"] == "onnxruntime/fp32"
    assert sel["why"].startswith("primary onnxruntime/fp32 because onnxruntime/int8 failed parity")
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and set(parity["artifacts"]) == {"onnxruntime/fp32"}
    assert not parity["refused"]["onnxruntime/int8"]["passed"] and parity["fallback"]["shipped"] == [
        "onnxruntime/fp32"
    ]
    assert "Wilson" in parity["rate_rule"]  # the rate gates state their bound
    latency = json.loads((out / "latency.json").read_text())
    assert set(latency["batch_1"]) == {"onnxruntime/fp32"}

    from pfactory.optimize.runtime import load_runner

    assert load_runner(out).name == "onnxruntime/fp32"  # what serves is what passed

    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    tags = next(r.data.tags for r in runs if "optimize.shipped" in r.data.tags)
    assert tags["optimize.shipped"] == "onnxruntime/fp32"
    assert tags["optimize.fallback"].startswith("primary onnxruntime/fp32 because onnxruntime/int8 failed")
    assert not (tmp_path / "optimized.parity-failed.json").exists()
