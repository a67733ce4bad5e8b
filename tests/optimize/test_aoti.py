"""AOTInductor, the second CPU backend: the export path without custom ops, the fastest-artifact choice of
`backend: auto`, what `load_runner` serves, and (full tier: a ~1 min compile) the package through the
real optimize stage, gated and timed beside ONNX Runtime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pfactory.optimize.aoti_backend import check_graph, export_path
from pfactory.optimize.errors import ArtifactError, BackendUnavailable
from pfactory.optimize.runtime import auto_backend
from pfactory.optimize.stage import _choose_primary, check_combination

from .helpers import make_feed

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`
    sys.path.insert(0, str(ROOT))

ARTS = [
    {"backend": "onnxruntime", "precision": "fp32"},
    {"backend": "onnxruntime", "precision": "int8"},
    {"backend": "aoti", "precision": "fp32"},
]


def _latency(p50: dict[str, float]) -> dict:
    return {
        "batch_1": {"pytorch/eager": {"p50_ms": 20.0}, **{k: {"p50_ms": v} for k, v in p50.items()}},
        "batch_4": {k: {"p50_ms": 4 * v} for k, v in p50.items()},
        "speedup_vs_eager": {},
    }


def test_auto_picks_the_fastest_artifact_at_the_smallest_batch_and_says_why() -> None:
    lat = _latency({"onnxruntime/fp32": 22.0, "onnxruntime/int8": 16.0, "aoti/fp32": 9.0})
    primary, sel = _choose_primary("onnxruntime", "int8", ARTS, lat, choose_fastest=True)
    assert primary == {"backend": "aoti", "precision": "fp32"} and sel["chosen"] == "aoti/fp32"
    assert sel["batch"] == 1 and sel["p50_ms"]["onnxruntime/int8"] == 16.0
    assert "aoti/fp32 9.00 ms (2.22x eager)" in sel["why"]
    # Ties keep build order; an explicit backend is served as asked.
    tie = _latency({"onnxruntime/fp32": 10.0, "onnxruntime/int8": 10.0, "aoti/fp32": 10.0})
    assert _choose_primary("onnxruntime", "int8", ARTS, tie, True)[0]["precision"] == "fp32"
    asked = _choose_primary("onnxruntime", "int8", ARTS, lat, choose_fastest=False)
    assert asked[0] == {"backend": "onnxruntime", "precision": "int8"} and asked[1]["rule"].startswith(
        "asked"
    )


def test_load_runner_auto_serves_the_primary_cpu_backend() -> None:
    manifest = {"primary": {"backend": "aoti", "precision": "fp32"}, "artifacts": ARTS}
    assert auto_backend(manifest, "cpu") == "aoti"
    manifest["primary"] = {"backend": "tensorrt", "precision": "int8"}  # engine built elsewhere, CPU here
    assert auto_backend(manifest, "cpu") == "onnxruntime"
    with pytest.raises(BackendUnavailable, match="fp32 only"):
        check_combination("aoti", "int8")


def test_the_export_path_has_no_custom_op(tiny_model) -> None:
    """What AOTInductor compiles is aten only (a pfk:: op would need pfactory at load time)."""
    from pfactory.optimize.export import ExportWrapper, example_inputs

    args = example_inputs(tiny_model, 2, 300, 1)
    with torch.no_grad(), export_path():
        ep = torch.export.export(ExportWrapper(tiny_model).eval(), args, strict=False)
    ops = check_graph(ep)
    assert "aten.scatter_reduce.two" in ops and not any("pfk" in o for o in ops)
    with torch.no_grad():  # outside export_path the eager model calls its custom ops
        eager_ep = torch.export.export(ExportWrapper(tiny_model).eval(), args, strict=False)
    if any("pfk" in str(n.target) for n in eager_ep.graph.nodes):
        with pytest.raises(ArtifactError, match="custom ops"):
            check_graph(eager_ep)


@pytest.mark.full
def test_aoti_through_the_optimize_stage(tmp_path) -> None:
    """backend auto + aoti.enabled: the package is built, gated like FP32 ORT (bit-repeatable), timed, the
    primary is the fastest, and `load_runner` serves it with the eager model's detections."""
    import tasks.optimize
    from pfactory.optimize.params import OptimizeParams
    from pfactory.optimize.runtime import TorchRunner, load_runner
    from tests.evaluate.helpers import build_eval_setup

    setup = build_eval_setup(tmp_path / "setup", frames=8)
    opt = OptimizeParams.model_validate(
        {"precision": "fp32", "intra_op_threads": 1, "export_points": 512, "aoti": {"enabled": True},
         "parity": {"frames": 2}, "latency": {"batch_sizes": [1, 2], "warmup": 1, "iterations": 3}}
    )  # fmt: skip
    out = tmp_path / "optimized"
    tasks.optimize.run(opt, setup["model"], setup["prepared"], out, "auto", "fp32", track=False)
    manifest = json.loads((out / "backend.json").read_text())
    names = {f"{a['backend']}/{a['precision']}" for a in manifest["artifacts"]}
    assert names == {"onnxruntime/fp32", "aoti/fp32"}
    parity = json.loads((out / "parity.json").read_text())
    assert parity["artifacts"]["aoti/fp32"]["passed"]
    sel = manifest["selection"]
    assert sel["chosen"] == min(sel["p50_ms"], key=sel["p50_ms"].get)
    assert f"{manifest['primary']['backend']}/{manifest['primary']['precision']}" == sel["chosen"]
    runner = load_runner(out, "aoti")
    feed = make_feed(TorchRunner(setup["model"]).model, 2, 700, seed=4)
    got = runner.run(feed)
    ref = TorchRunner(setup["model"]).run(feed)
    np.testing.assert_allclose(got["scores"], ref["scores"], atol=5e-5)
    assert (out / "aoti" / "model.fp32.pt2").stat().st_size == next(
        a["bytes"] for a in manifest["artifacts"] if a["backend"] == "aoti"
    )
