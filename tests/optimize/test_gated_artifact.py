"""The artifact that runs is the artifact that was gated: evaluate and promote refuse an optimized directory
whose `model.onnx` (or any file backend.json lists) was replaced by other bytes under the same name, with
one line on stderr naming the file. Uses the registry suite's promotion bench (the real optimize stage on
a tiny detector, built once per session and shared with tests/promote and tests/tasks)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.promote import helpers as H

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def bench(tmp_path_factory) -> dict[str, Path]:
    return H.build_bench(tmp_path_factory.getbasetemp() / "promote-bench")


def _planted(bench: dict[str, Path], root: Path, relpath: str) -> Path:
    """A copy of the bench's optimized directory with `relpath` replaced by a valid ONNX model of other bytes
    (the same graph, one more metadata entry): it would load and run, but it is not what was gated."""
    import onnx

    optimized = root / "optimized"
    shutil.copytree(bench["optimized"], optimized)
    model = onnx.load(str(optimized / relpath))
    onnx.helper.set_model_props(model, {"planted": "yes"})
    onnx.save(model, str(optimized / relpath))
    return optimized


def _one_line_naming(err: str, stage: str, path: Path) -> None:
    # MLflow's own INFO log lines (creating the sqlite store) aside, the refusal is one line, no traceback.
    lines = [line for line in err.splitlines() if line.strip() and " INFO mlflow" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{stage}: {path}: sha256 ") and "does not match backend.json" in lines[0]
    assert "not the file the optimize stage gated" in lines[0]


@pytest.mark.parametrize("relpath", ["model.onnx", "onnxruntime/model.fp32.onnx"])
def test_evaluate_refuses_a_replaced_file(bench, tmp_path, relpath, capsys) -> None:
    import tasks.evaluate

    optimized = _planted(bench, tmp_path, relpath)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"paths": {"optimized": str(optimized), "prepared": str(bench["prepared_a"]),
                                                "eval": str(tmp_path / "eval"), "model": str(bench["model"])}}))  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        tasks.evaluate.main(["--params", str(params), "--no-track", "--no-reference"])
    assert exit_info.value.code == 2
    _one_line_naming(capsys.readouterr().err, "evaluate", optimized / relpath)
    assert not (tmp_path / "eval").exists()


def test_promote_refuses_a_replaced_model_onnx(bench, tmp_path, capsys, monkeypatch) -> None:
    import tasks.promote

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.delenv("PFACTORY_PARENT_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    cand = H.candidate(tmp_path, bench, "c1", 0.0)  # the bench's optimized dir + a real kpis.json
    planted = tmp_path / "planted"
    optimized = _planted({"optimized": cand["optimized"]}, planted, "model.onnx")
    params = tmp_path / "params.yaml"
    paths = {"optimized": str(optimized), "eval": str(cand["eval"]), "prepared": str(bench["prepared_a"]),
             "release": str(tmp_path / "release")}  # fmt: skip
    params.write_text(yaml.safe_dump({"paths": paths, "promote": H.promote_params().model_dump(mode="json")}))
    with pytest.raises(SystemExit) as exit_info:
        tasks.promote.main(["--params", str(params), "--dry-run"])
    assert exit_info.value.code == 1
    _one_line_naming(capsys.readouterr().err, "promote", optimized / "model.onnx")
    assert not (tmp_path / "release").exists()
    # The untouched candidate passes the same check (the refusal is the replaced file, nothing else).
    from pfactory.promote.evidence import read_evidence

    assert read_evidence(cand["optimized"], cand["eval"] / "kpis.json").backend["files"]


def test_load_runner_refuses_a_replaced_model_onnx_and_serves_the_gated_one(bench, tmp_path) -> None:
    from pfactory.optimize.errors import ArtifactError
    from pfactory.optimize.runtime import load_runner

    assert load_runner(bench["optimized"]).path.is_file()
    optimized = _planted(bench, tmp_path, "model.onnx")
    with pytest.raises(ArtifactError, match=r"model\.onnx: sha256 .* does not match backend\.json"):
        load_runner(optimized)
