"""The evaluate stage on a tiny synthetic setup: a real Dask run with its files, KPIs that `factory kpi`
reproduces from the KITTI files, MLflow, identical results with 1 worker, 2 workers and a worker killed
mid-run, and bad inputs refused with clear errors and exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`, not tests/'s namespace packages
    sys.path.insert(0, str(ROOT))

from flows.params import Params  # noqa: E402
from pfactory.evaluate.params import EvaluateParams  # noqa: E402
from tests.evaluate.helpers import build_eval_setup  # noqa: E402

# Row groups of 2 frames (tests/evaluate/helpers.py): one row group per task, several tasks per model.
EVAL = {"slice_frames": 2, "batch_size": 2, "worst_frames": 2}


def _params(**over) -> Params:
    return Params(evaluate=EvaluateParams(**{**EVAL, **over}))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    return build_eval_setup(tmp_path_factory.mktemp("evaluate"))


@pytest.fixture(scope="module")
def baseline(setup, tmp_path_factory) -> dict:
    """The undisturbed run: a LocalCluster of 2 workers, the PyTorch reference, tracked in a fresh MLflow."""
    import tasks.evaluate

    root = tmp_path_factory.mktemp("baseline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.chdir(root)  # configure_environment keeps Dask/MLflow scratch under the cwd's project
        metrics = tasks.evaluate.run(
            _params(),
            setup["optimized"],
            setup["model"],
            setup["prepared"],
            root / "eval",
            "local:2",
            track=True,
            raw=setup["raw"],
        )
    return {"metrics": metrics, "out": root / "eval", "mlflow_uri": f"sqlite:///{root / 'mlflow.db'}"}


def _same_numbers(a, b, path="") -> None:
    """Nested KPI dicts equal; floats to 1e-9 (the KITTI round trip of yaw costs ~1e-16 rad)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same_numbers(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-9, nan_ok=True), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a} != {b}"


def test_stage_writes_kpis_reports_predictions_and_mlflow(setup, baseline) -> None:
    from pfactory.evaluate.inputs import split_hash
    from pfactory.metrics.kpi_cli import run_kpi

    out, metrics = baseline["out"], baseline["metrics"]
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"kpis.json", "pr/Car.csv", "pr/Pedestrian.csv", "pr/Cyclist.csv", "report/predictions.parquet",
            "report/per_frame.json", "report/pr_curves.json", "report/pr.png", "report/timings.json",
            "report/report.html"} <= files  # fmt: skip
    assert any(f.startswith("report/worst/") and f.endswith("_bev.png") for f in files)
    assert doc_errors_keys(out) == {"Car", "Pedestrian", "Cyclist"}
    assert not any("/.parts/" in f or f.endswith(".tmp") for f in files)
    assert not list(out.parent.glob(".eval.*")), "the temporary build directory must be gone"

    doc = json.loads((out / "kpis.json").read_text())
    manifest = json.loads((setup["prepared"] / "manifest.json").read_text())
    n_val = manifest["counts"]["val"]
    assert metrics["frames"] == doc["data"]["frames"] == n_val >= 3
    assert (
        metrics["data_hash"]
        == doc["data"]["prepared_hash"]
        == split_hash(manifest["splits"]["val"]["shards"])
    )
    assert metrics["kpis_path"] == str(out / "kpis.json")
    assert set(doc["classes"]) == {"Car", "Pedestrian", "Cyclist"}
    assert set(doc["classes"]["Car"]["ap"]) == {"0.5", "1.0", "2.0", "4.0"}
    assert set(doc["by_range"]) == {"0-20", "20-40", "40+"}
    assert doc["mAP"] == metrics["mAP"] and doc["NDS"] == metrics["NDS"]
    backend = json.loads((setup["optimized"] / "backend.json").read_text())
    assert doc["model"]["onnx_sha256"] == backend["onnx"]["sha256"]
    assert doc["model"]["artifact"] == doc["latency"]["runner"] == "onnxruntime/fp32"
    assert set(doc["latency"]["batch_1"]) == {"onnxruntime/fp32", "pytorch/eager"}
    # The delta is optimized - reference, class by class; FP32 ORT computes what PyTorch computes.
    assert metrics["delta_mAP"] == pytest.approx(doc["mAP"] - doc["reference"]["mAP"], abs=1e-12)
    car = doc["delta"]["classes"]["Car"]
    assert car["ap"]["4.0"] == pytest.approx(
        doc["classes"]["Car"]["ap"]["4.0"] - doc["reference"]["classes"]["Car"]["ap"]["4.0"]
    )
    assert abs(metrics["delta_mAP"]) < 0.02

    # `factory kpi` on the KITTI files gives the stage's numbers, for both models.
    kitti = out / "report" / "kitti"
    buckets = tuple(EvaluateParams().range_buckets_m)
    for kind, expected in (("optimized", doc), ("reference", doc["reference"])):
        got = run_kpi(kitti / "ground_truth", kitti / kind, range_buckets_m=buckets, frame_score_threshold=0.3)
        for key in ("mAP", "NDS", "tp_errors", "classes", "by_range"):
            _same_numbers(got[key], expected[key], f"{kind}.{key}")
    assert doc["classes"]["Car"]["num_pred"] > 0 and max(c["mean_ap"] for c in doc["classes"].values()) > 0

    import pyarrow.parquet as pq

    table = pq.read_table(out / "report" / "predictions.parquet").to_pylist()
    kinds = [r["kind"] for r in table]
    assert kinds == sorted(kinds, key=["ground_truth", "optimized", "reference"].index)
    opt = [r for r in table if r["kind"] == "optimized"]
    assert len(opt) == sum(c["num_pred"] for c in doc["classes"].values())
    assert min(r["score"] for r in opt) >= EvaluateParams().score_threshold
    keys = [(r["frame_id"], r["rank"]) for r in opt]
    assert keys == sorted(keys)
    assert len([r for r in table if r["kind"] == "ground_truth"]) == doc["data"]["ground_truth_boxes"]
    pr = (out / "pr" / "Car.csv").read_text().splitlines()
    assert pr[0] == "recall,precision,confidence" and len(pr) == 102
    worst = sorted((out / "report" / "worst").glob("*.png"))  # 2 frames x (camera, BEV)
    assert 2 <= len(worst) <= 4 and all(p.read_bytes()[:4] == b"\x89PNG" for p in worst)

    timings = json.loads((out / "report" / "timings.json").read_text())
    n_units = len({u["unit"] for u in timings["units"]})
    assert n_units >= 3 and len(timings["units"]) == 2 * n_units  # optimized + reference, one task each
    assert (
        timings["runs"]["optimized"]["frames"] == n_val and timings["runs"]["optimized"]["tasks"] == n_units
    )

    import mlflow

    mlflow.set_tracking_uri(baseline["mlflow_uri"])
    run = mlflow.get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "evaluate"
    assert run.data.params["evaluate.slice_frames"] == "2"
    for name in ("eval/mAP", "eval/Car/ap_2.0", "eval/40-inf/mAP", "eval/reference/mAP", "eval/delta/mAP",
                 "eval/throughput_fps", "eval/optimized/overhead_per_task_ms", "time/optimized_s", "time/total_s"):  # fmt: skip
        assert name in run.data.metrics, name
    assert run.data.metrics["eval/mAP"] == pytest.approx(doc["mAP"])
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "eval")}
    assert {"eval/kpis.json", "eval/pr", "eval/report"} <= logged
    report = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "eval/report")}
    assert {"eval/report/report.html", "eval/report/worst"} <= report
    # No pipeline run around it: the report goes to the stage run itself (under a pipeline the flow logs
    # it to the parent: tests/report/test_run.py, tests/flows/test_pipeline.py).
    shown = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "report")}
    assert {"report/report.html", "report/pr.png", "report/worst"} <= shown, shown
    for cls, block in doc["errors"].items():  # the error breakdown as scalars
        assert run.data.metrics[f"eval/{cls}/errors/background"] == block["background"], cls


def doc_errors_keys(out: Path) -> set[str]:
    """The classes of kpis.json's error breakdown, which every range bucket carries too."""
    doc = json.loads((out / "kpis.json").read_text())
    assert all(set(b["errors"]) == set(doc["errors"]) for b in doc["by_range"].values())
    return set(doc["errors"])


def _tree(out: Path) -> dict[str, bytes]:
    """Every file a rerun must reproduce byte for byte (timings.json and the PNGs' timestamps excepted; the
    report names its baseline, which a tracked run looks up in the registry: compared between untracked runs)."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.suffix != ".png" and p.name not in ("timings.json", "report.html")
    }


def test_one_worker_and_a_killed_worker_reproduce_the_files(setup, baseline, tmp_path, monkeypatch) -> None:
    """1 worker (through `factory evaluate`), and 2 workers with one SIGKILLed while it runs a unit: the same
    kpis.json, predictions and KITTI files (kitti_results/ too) as the undisturbed 2-worker run; the killed
    unit ran elsewhere."""
    import yaml
    from typer.testing import CliRunner

    import tasks.evaluate
    from factory.cli import app
    from tests.cluster_helpers import killing_a_worker, local_cluster

    monkeypatch.chdir(tmp_path)
    expected = _tree(baseline["out"])

    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"evaluate": _params().evaluate.model_dump(mode="json")}))
    args = ["evaluate", "--model", str(setup["optimized"]), "--data", str(setup["prepared"]), "--out",
            str(tmp_path / "one"), "--reference", str(setup["model"]), "--dask", "local:1", "--no-track",
            "--params", str(params_file), "--raw", str(setup["raw"])]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert '"mAP"' in res.output
    assert _tree(tmp_path / "one") == expected

    # SIGKILL a worker while it executes an optimized-model unit (its first one spends seconds importing and
    # loading the model, so the unit is surely unfinished when the signal lands).
    with (
        local_cluster(tmp_path / "dask") as (cluster, client),
        killing_a_worker(client, lambda k: "optimized" in k) as killed,
    ):
        tasks.evaluate.run(
            _params(), setup["optimized"], setup["model"], setup["prepared"], tmp_path / "killed",
            dask_address=cluster.scheduler_address, track=False, raw=setup["raw"],
        )  # fmt: skip
    assert killed.get("keys"), "the victim never ran a unit: the kill did not happen mid-run"
    assert _tree(tmp_path / "killed") == expected
    report = "report/report.html"
    assert (tmp_path / "killed" / report).read_bytes() == (tmp_path / "one" / report).read_bytes()
    units = json.loads((tmp_path / "killed" / "report" / "timings.json").read_text())["units"]
    redone = {int(k.rsplit("-", 1)[1]) for k in killed["keys"]}
    for u in units:
        if u["kind"] == "optimized" and u["unit"] in redone:
            assert u["worker"] != killed["victim"] and u["pid"] != killed["pid"], u


def test_bad_inputs_are_refused_before_any_work(setup, tmp_path, monkeypatch) -> None:
    import shutil

    import yaml
    from typer.testing import CliRunner

    import tasks.evaluate
    from factory.cli import app
    from pfactory.evaluate.inputs import EvaluateInputError

    monkeypatch.chdir(tmp_path)
    opt, model, data = setup["optimized"], setup["model"], setup["prepared"]

    def refused(match: str, **kw) -> None:
        args = {"optimized": opt, "model": model, "data": data, **kw}
        with pytest.raises(EvaluateInputError, match=match):
            tasks.evaluate.run(_params(**kw.pop("ev", {})), args["optimized"], args["model"], args["data"],
                               tmp_path / "out", "local:1", track=False)  # fmt: skip
        assert not (tmp_path / "out").exists()

    refused(r"nowhere: optimized model directory: an existing directory", optimized=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    refused(r"empty/backend.json: no manifest", optimized=tmp_path / "empty")
    refused(
        r"manifest.json: splits: a split 'test' \(evaluate.split\); has \['train', 'val'\]",
        ev={"split": "test"},
    )
    refused(r"model.pt: the PyTorch reference needs it", model=tmp_path / "empty")
    tampered = tmp_path / "prepared"
    shutil.copytree(data, tampered)
    shard = sorted((tampered / "val").glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes() + b"\0")
    refused(r"shard-00000.parquet: sha256 .* does not match .*manifest.json", data=tampered)

    import dask
    import distributed  # noqa: F401  (its defaults must exist before config.set, which drops what it created)

    with (
        dask.config.set({"distributed.comm.timeouts.connect": "1s"}),
        pytest.raises(ConnectionError, match="no Dask scheduler answered"),
    ):
        tasks.evaluate.run(_params(), opt, None, data, tmp_path / "out", "tcp://127.0.0.1:9", track=False)
    assert not (tmp_path / "out").exists()

    res = CliRunner().invoke(app, ["evaluate", "--model", str(tmp_path / "nowhere"), "--data", str(data),
                                   "--out", str(tmp_path / "o"), "--no-track", "--no-reference"])  # fmt: skip
    assert res.exit_code == 2 and "optimized model directory" in res.output

    # The DVC entry (`python -m tasks.evaluate`): exit 2 with the message.
    paths = {"optimized": str(opt), "model": str(model), "prepared": str(data), "eval": str(tmp_path / "e")}
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"paths": paths, "evaluate": {"split": "test"}}))
    with pytest.raises(SystemExit) as exit_info:
        tasks.evaluate.main(["--params", str(params_file)])
    assert exit_info.value.code == 2


def test_a_unit_failing_on_a_worker_exits_1_names_the_unit_and_writes_nothing(
    setup, tmp_path, monkeypatch, capsys
):
    """A checkpoint whose weights do not fit its config loads only on the workers: exit 1 (it ran, it failed)."""
    import shutil

    import torch
    import yaml

    import tasks.evaluate

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(setup["model"], model)
    torch.save({"not_a_weight": torch.zeros(1)}, model / "model.pt")
    out = tmp_path / "eval"
    paths = {
        "optimized": str(setup["optimized"]),
        "model": str(model),
        "prepared": str(setup["prepared"]),
        "eval": str(out),
    }
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"paths": paths, "evaluate": {**EVAL, "dask_address": "local:1"}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(SystemExit) as exit_info:
        tasks.evaluate.main(["--params", str(params_file)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "pytorch/eager on val/shard-" in err and "row groups [" in err and "state_dict" in err, err[-2000:]
    assert not out.exists() and not list(tmp_path.glob(".eval.*"))


def test_kitti_metric_and_result_files_the_benchmark_accepts(setup, baseline) -> None:
    """KITTI data: kpis.json carries KITTI's official metric, scored from result files with real 2D boxes; the
    same files re-scored by `factory kpi` against the dataset's own label_2 give the same numbers."""
    import mlflow

    from pfactory.metrics.kpi_cli import run_kpi

    out = baseline["out"]
    doc = json.loads((out / "kpis.json").read_text())
    assert doc["kitti_results"] == "kitti_results"
    t = doc["kitti"]
    assert set(t) == {"Car", "Pedestrian", "Cyclist"}
    assert {m: set(v) for m, v in t["Car"].items()} == {m: {"easy", "moderate", "hard"} for m in ("bbox", "bev", "3d", "aos")}
    assert all(0.0 <= v <= 1.0 for c in t.values() for m in c.values() for v in m.values() if v is not None)
    assert {"kitti_R11", "kitti_loose", "kitti_loose_R11", "kitti_info"} <= set(doc)
    info = doc["kitti_info"]
    frames = (out / "kitti_frames.txt").read_text().split()
    assert len(frames) == doc["data"]["frames"]
    files = sorted((out / "kitti_results").glob("*.txt"))
    assert [p.stem for p in files] == sorted(frames)
    lines = [line.split() for p in files for line in p.read_text().splitlines()]
    assert len(lines) == info["results"]["written"]
    for cols in lines:  # 16 columns; a real 2D box inside the 208 x 64 image; -1 -1 for trunc / occ
        assert len(cols) == 16 and cols[1:3] == ["-1", "-1"]
        x1, y1, x2, y2 = map(float, cols[4:8])
        assert 0 <= x1 < x2 <= 207 and 0 <= y1 < y2 <= 63
    assert lines, "the tiny detector made no detection at all"
    # Re-scoring the stage's files against the dataset's own labels: identical numbers.
    label_2 = setup["raw"] / "training" / "label_2"
    again = run_kpi(label_2, out / "kitti_results", frames=out / "kitti_frames.txt", metrics="kitti")
    for key in ("kitti", "kitti_R11", "kitti_loose", "kitti_loose_R11"):
        assert again[key] == doc[key], key
    # MLflow: kitti/<Class>/<metric>/<difficulty> on the stage's run.
    mlflow.set_tracking_uri(baseline["mlflow_uri"])
    run = mlflow.get_run(baseline["metrics"]["mlflow_run_id"])
    if t["Car"]["3d"]["moderate"] is not None:
        assert run.data.metrics["kitti/Car/3d/moderate"] == pytest.approx(t["Car"]["3d"]["moderate"])
    assert any(k.startswith("kitti/") for k in run.data.metrics)
    assert '<section id="kitti">' in (out / "report" / "report.html").read_text()  # the run report's table
