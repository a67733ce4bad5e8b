"""The registered champion is a real MLflow model: pyfunc-loadable from `models:/<name>@champion`, with a
signature, an input example and pinned requirements; its predictions equal the optimize stage's runner on a
val frame, in process and through `mlflow models serve` (a real server on 127.0.0.1, started and stopped
here)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.flows.conftest import _start, _stop, free_port
from tests.promote import helpers as H


def _promote_champion(bench, tmp_path) -> dict:
    import tasks.promote

    cand = H.candidate(tmp_path, bench, "c1", 0.3)
    result = tasks.promote.run(
        H.promote_params(), cand["optimized"], cand["eval"], bench["prepared_a"], tmp_path / "release"
    )
    assert result["decision"] == "promoted", result["reason"]
    return cand


def _val_feed(prepared: Path) -> dict[str, np.ndarray]:
    from pfactory.optimize.calibration import load_feeds

    return load_feeds(prepared, "val", batch_size=1, max_frames=1, num_threads=1).feeds[0]


def _runner_out(optimized: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from pfactory.optimize.runtime import load_runner

    return load_runner(optimized)(**feed)


def test_champion_loads_as_pyfunc_and_predicts_like_the_runner(bench, tmp_path, registry) -> None:
    import mlflow
    from mlflow.models import Model

    cand = _promote_champion(bench, tmp_path)
    uri = "models:/test-detector@champion"
    model = mlflow.pyfunc.load_model(uri)
    sig = model.metadata.get_input_schema()
    assert [s.name for s in sig.inputs] == ["points", "num_points", "images", "proj"]
    assert [s.name for s in model.metadata.get_output_schema().inputs] == ["boxes", "scores", "labels"]
    assert sig.inputs[0].type == np.dtype("float32") and sig.inputs[1].type == np.dtype("int64")
    assert model.metadata.metadata["served_artifact"] == "onnxruntime/model.fp32.onnx"

    feed = _val_feed(bench["prepared_a"])
    got = model.predict(feed)
    want = _runner_out(cand["optimized"], feed)
    assert set(got) == {"boxes", "scores", "labels"}
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert (want["scores"] > 0.0).any()  # a frame with detections, not an all-padding comparison

    # The model directory: MLmodel with the onnx flavor, an input example, pinned requirements, evidence.
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "dl")))
    mlmodel = Model.load(str(local / "MLmodel"))
    assert {"onnx", "python_function"} <= set(mlmodel.flavors)
    assert mlmodel.saved_input_example_info is not None
    example = json.loads((local / mlmodel.saved_input_example_info["artifact_path"]).read_text())
    assert set(example) == {"points", "num_points", "images", "proj"}
    serving = json.loads((local / "serving_input_example.json").read_text())  # a ready REST body
    assert set(serving["inputs"]) == set(example)
    reqs = (local / "requirements.txt").read_text()
    for pkg in ("onnxruntime==", "onnx==", "numpy=="):
        assert pkg in reqs, reqs
    assert (local / "optimized" / "backend.json").is_file() and (local / "eval" / "kpis.json").is_file()
    mv = registry.get_model_version("test-detector", "1")
    assert mv.source.startswith("models:/m-") and mv.run_id  # the LoggedModel of the run


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_rest_request(bench, tmp_path, registry) -> None:
    cand = _promote_champion(bench, tmp_path)
    port = free_port()
    log = tmp_path / "serve.log"
    bindir = Path(sys.executable).parent  # `mlflow models serve` execs `uvicorn` from PATH: the venv's
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    mlflow_exe = bindir / "mlflow"
    cmd = [str(mlflow_exe), "models", "serve", "-m", "models:/test-detector@champion", "--env-manager", "local",
           "-h", "127.0.0.1", "-p", str(port), "-w", "1"]  # fmt: skip
    server = _start("mlflow models serve", cmd, env, f"http://127.0.0.1:{port}/ping", f"http://127.0.0.1:{port}", log)
    try:
        feed = _val_feed(bench["prepared_a"])
        body = json.dumps({"inputs": {k: v.tolist() for k, v in feed.items()}}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            answer = json.loads(r.read())["predictions"]
        want = _runner_out(cand["optimized"], feed)
        assert set(answer) == {"boxes", "scores", "labels"}
        np.testing.assert_array_equal(np.asarray(answer["labels"]), want["labels"])
        # JSON carries the float32 values as decimal text: equal to float32 precision.
        np.testing.assert_allclose(np.asarray(answer["scores"], np.float32), want["scores"], rtol=0, atol=0)
        np.testing.assert_allclose(np.asarray(answer["boxes"], np.float32), want["boxes"], rtol=0, atol=0)
    finally:
        _stop(server)  # SIGTERM to the server's process group (uvicorn worker too), SIGKILL after 15 s
