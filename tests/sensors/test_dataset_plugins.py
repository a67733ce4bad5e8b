"""Dataset layouts as plugins (DESIGN.md §5b, docs/DATASETS.md): the entry-point group `pfactory.datasets`.

- no code outside the reader modules compares a layout name (an `ast` scan of pfactory/, flows/, tasks/);
- the built-in layouts are entry points, offered a root in a stable order; a forced layout is used or refused;
- the prepared manifest records where its raw data came from (root, layout plugin, content hash), and
  evaluate reopens it without `--raw`: a gone or changed raw dataset is said in one line;
- examples/dataset-plugin, pip-installed into a folder of its own (tests/plugin_install.py) and seen by a
  subprocess only: listed with its distribution and version, a dataset converted to its layout from the
  synthetic data is read and prepared into shards with the same points and boxes as the KITTI original;
- a plugin whose module is missing: one line, exit 2, and the listing still lists the rest.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_install import broken_plugin, install_plugin
from tests.prepare.conftest import small_params

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dataset-plugin"
LAYOUT_NAMES = {"kitti", "nuscenes"}
# The modules that may name their own layout: the readers.
READER_MODULES = {"pfactory/sensors/kitti.py", "pfactory/sensors/nuscenes.py"}
# Comparisons with these literals that are not about dataset layouts: (file, the compared expression).
NOT_LAYOUTS = {
    # `factory kpi --metrics kitti|nuscenes|all|auto`: which metric definitions to score, any data.
    ("pfactory/metrics/kpi_cli.py", "metrics"),
}


def _literals(node: ast.expr) -> set[str]:
    """The lower-cased string constants of `node` (a constant, or a tuple / list / set of them)."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value.lower() for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def layout_comparisons(path: Path, rel: str) -> list[str]:
    """`file:line: expression` of every `==`, `!=`, `in`, `not in` comparison and `match` case against the
    literal "kitti" / "nuscenes" in one source file, except `NOT_LAYOUTS`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                continue
            hits = [s for s in sides if _literals(s) & LAYOUT_NAMES]
            others = {ast.unparse(s) for s in sides if s not in hits}
            if hits and not any((rel, o) in NOT_LAYOUTS for o in others):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.match_case)
            and isinstance(node.pattern, ast.MatchValue)
            and _literals(node.pattern.value) & LAYOUT_NAMES
        ):
            found.append(f"{rel}:{node.pattern.lineno}: case {ast.unparse(node.pattern.value)}")
    return found


def test_no_layout_name_is_compared_outside_the_readers() -> None:
    offenders = []
    for top in ("pfactory", "flows", "tasks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in READER_MODULES:
                offenders += layout_comparisons(path, rel)
    assert not offenders, (
        "layout names compared outside the readers (put the fact behind pfactory.sensors.reader.DatasetReader):\n"
        + "\n".join(offenders)
    )


def test_the_scan_sees_comparisons(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text(
        'a = ds.layout == "kitti"\nb = "nuscenes" != x\nc = y in ("KITTI", "other")\nmatch z:\n'
        '    case "kitti":\n        pass\nd = metrics == "kitti"\ne = ds.layout == "folder"\n'
    )
    lines = [s.split(": ", 1)[0] for s in layout_comparisons(src, "pfactory/metrics/kpi_cli.py")]
    assert lines == ["pfactory/metrics/kpi_cli.py:1", "pfactory/metrics/kpi_cli.py:2", "pfactory/metrics/kpi_cli.py:3",
                     "pfactory/metrics/kpi_cli.py:5"]  # fmt: skip


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """6 synthetic frames in the KITTI layout (208x64 images)."""
    from pfactory.synth.dataset import generate_dataset

    out = tmp_path_factory.mktemp("raw") / "synth"
    generate_dataset(out, frames=6, seed=11, cameras=1, image_size=(208, 64), workers=1)
    return out


@pytest.fixture(scope="module")
def prepared(raw: Path, tmp_path_factory) -> Path:
    from pfactory.prepare.stage import prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "kitti"
    prepare_dataset(raw, out, small_params())
    return out


def test_builtin_layouts_are_entry_points_offered_in_order(raw: Path, tmp_path: Path) -> None:
    from pfactory.config.plugins import PluginError
    from pfactory.sensors.datasets import listing, open_dataset
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.kitti import KittiDataset

    rows = [(r.name, r.source, r.status) for r in listing()]
    assert rows[:2] == [("kitti", "built-in", "ok"), ("nuscenes", "built-in", "ok")]
    assert isinstance(open_dataset(raw), KittiDataset)
    assert isinstance(open_dataset(raw, layout="kitti"), KittiDataset)
    with pytest.raises(DatasetError, match="nuScenes layout"):
        open_dataset(raw, layout="nuscenes")
    with pytest.raises(PluginError, match="no dataset plugin named 'nope'"):
        open_dataset(raw, layout="nope")
    with pytest.raises(DatasetError, match=r"KITTI object layout .* or a nuScenes layout"):
        open_dataset(tmp_path)


def test_manifest_records_the_raw_origin_and_evaluate_reopens_it(raw: Path, prepared: Path, tmp_path, capsys):
    import shutil

    from pfactory.evaluate.evaluation import open_raw, results_writer
    from pfactory.evaluate.inputs import EvaluateInputError
    from pfactory.evaluate.kitti_results import KittiResults
    from pfactory.prepare.stage import prepare_dataset

    source = json.loads((prepared / "manifest.json").read_text())["source"]
    assert source["root"] == raw.as_posix() and source["layout"] == "kitti" and source["frames"] == 6
    assert source["plugin"]["name"] == "kitti" and source["plugin"]["source"] == "built-in"
    assert "files_sha256" not in source["plugin"]  # a built-in's code is the project's (DVC deps)

    dataset, note = open_raw(prepared, None)  # what `factory evaluate --data PREPARED` does without --raw
    assert note is None and dataset.root == raw / "training"
    assert isinstance(results_writer(prepared, "val", None), KittiResults)
    assert open_raw(prepared, False) == (None, None)  # a champion's re-evaluation: no raw data

    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    prepare_dataset(copy, tmp_path / "prepared", small_params())
    label = copy / "training" / "label_2" / "000003.txt"
    label.write_text(label.read_text() + "DontCare -1 -1 -10 0 0 1 1 -1 -1 -1 -1000 -1000 -1000 -10\n")
    dataset, note = open_raw(tmp_path / "prepared", None)
    assert dataset is None and "has changed since" in note and "\n" not in note
    assert results_writer(tmp_path / "prepared", "val", None) is None
    assert "evaluate: the raw data" in capsys.readouterr().err
    dataset, note = open_raw(tmp_path / "prepared", copy)  # --raw: the user's word, with a note
    assert dataset is not None and "differs from" in note

    shutil.rmtree(copy)
    dataset, note = open_raw(tmp_path / "prepared", None)
    assert dataset is None and "is gone" in note and "\n" not in note
    with pytest.raises(EvaluateInputError, match="raw KITTI dataset the data was prepared from"):
        open_raw(tmp_path / "prepared", tmp_path / "nowhere")


# --- the example plugin, installed for subprocesses only -------------------------------------------------

PLUGIN_SCRIPT = r"""
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
from pfactory_folder_dataset import FolderDataset
from pfactory_folder_dataset.convert import convert
from pfactory.prepare.stage import prepare_dataset
from pfactory.evaluate.evaluation import open_raw, results_writer
from pfactory.sensors.datasets import listing, open_dataset
from pfactory.sensors.validate import check_dataset
from tests.prepare.conftest import small_params

raw, work = Path(sys.argv[1]), Path(sys.argv[2])
folder = convert(raw, work / "folder", frames=5)
ds = open_dataset(folder)
report = check_dataset(folder)
result = prepare_dataset(folder, work / "prepared", small_params())
opened, note = open_raw(work / "prepared", None)

def rows(prepared):
    out = {}
    for split in ("train", "val"):
        for f in sorted((prepared / split).glob("*.parquet")):
            t = pq.read_table(f, columns=["frame_id", "points", "boxes", "names", "source"]).to_pylist()
            out.update({r["frame_id"]: r for r in t})
    return out

print(json.dumps({
    "listing": [[r.name, r.target, r.source, r.status] for r in listing()],
    "reader": type(ds).__name__, "ids": ds.frame_ids(), "check_ok": report.frames_ok,
    "manifest_source": result.manifest["source"], "counts": result.manifest["counts"],
    "reopened": type(opened).__name__, "note": note, "writer": results_writer(work / "prepared", "val", None),
    "rows": {k: [v["points"], v["boxes"], v["names"], v["source"]] for k, v in rows(work / "prepared").items()},
}))
"""


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> tuple[dict[str, str], Path]:
    target = tmp_path_factory.mktemp("site")
    return install_plugin(EXAMPLE, target), target


def test_the_example_plugin_is_listed_and_its_layout_prepares(plugin_env, raw, prepared, tmp_path) -> None:
    env, _ = plugin_env
    res = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT, str(raw), str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert ["folder", "pfactory_folder_dataset:FolderDataset", "pfactory-folder-dataset 0.1.0", "ok"] in got["listing"]
    assert [r[0] for r in got["listing"]][:2] == ["kitti", "nuscenes"]  # built-ins first
    assert got["reader"] == "FolderDataset" and got["ids"] == [f"{i:06d}" for i in range(5)]
    assert got["check_ok"] == got["ids"]  # `factory data check`'s strict checks pass on the converted data
    src = got["manifest_source"]
    assert src["layout"] == "folder" and src["root"] == (tmp_path / "folder").as_posix() and src["frames"] == 5
    assert src["plugin"]["dist"] == "pfactory-folder-dataset" and src["plugin"]["version"] == "0.1.0"
    assert len(src["plugin"]["files_sha256"]) == 64  # an installed plugin's code is an input of the data
    assert got["counts"]["total"] == 5 and got["counts"]["rejected"] == 0
    assert got["reopened"] == "FolderDataset" and got["note"] is None and got["writer"] is None

    # The same frames through the KITTI reader: the same points, boxes and names in the shards.
    import pyarrow.parquet as pq

    kitti = {}
    for f in sorted(prepared.glob("*/*.parquet")):
        for r in pq.read_table(f, columns=["frame_id", "points", "boxes", "names"]).to_pylist():
            kitti[r["frame_id"]] = [r["points"], r["boxes"], r["names"]]
    assert set(got["rows"]) == set(got["ids"])
    for fid, (points, boxes, names, source) in got["rows"].items():
        assert [points, boxes, names] == kitti[fid] and source == "folder", fid


def test_a_plugin_whose_module_is_missing_is_one_line_and_the_rest_still_list(plugin_env, raw, tmp_path) -> None:
    env, _ = plugin_env
    site = tmp_path / "site"
    site.mkdir()
    broken_plugin(site, "pfactory.datasets", "broken", "pfactory_no_such_module:Reader")
    env = dict(env, PYTHONPATH=f"{site}:{env['PYTHONPATH']}")
    run = [sys.executable, "-m", "pfactory.sensors.datasets"]

    res = subprocess.run([*run, "broken"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "dataset plugin 'broken' (broken-plugin 0.0.1" in res.stderr and "ModuleNotFoundError" in res.stderr

    res = subprocess.run(run, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert [x.split("\t")[0] for x in lines] == ["kitti", "nuscenes", "broken", "folder"]
    assert all("BROKEN" not in x for x in lines if not x.startswith("broken")) and "BROKEN" in lines[2]

    # Other layouts still open; a root no layout reads names the skipped plugin in its one-line error.
    code = ("import sys; from pfactory.sensors.datasets import open_dataset\n"
            "print(type(open_dataset(sys.argv[1])).__name__)\n"
            "try:\n    open_dataset(sys.argv[2])\nexcept Exception as e:\n    print(e)")  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code, str(raw), str(tmp_path / "site")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    out = res.stdout.strip().splitlines()
    assert res.returncode == 0 and out[0] == "KittiDataset", res.stderr
    assert "a folder per frame" in out[1] and "skipped: dataset plugin 'broken'" in out[1]


@pytest.mark.full
@pytest.mark.slow
def test_the_example_layout_runs_prepare_train_optimize_evaluate(plugin_env, raw, tmp_path) -> None:
    """The dataset plugin through the stages as a user runs them (`python -m tasks.<stage>`, what dvc.yaml
    calls): its folder layout prepares, a tiny detector trains on it, optimize gates it and evaluate scores
    it, reopening the raw data through the plugin (the manifest names it; no --raw)."""
    env, _ = plugin_env
    convert = ("from pfactory_folder_dataset.convert import convert; import sys; "
               "convert(__import__('pathlib').Path(sys.argv[1]), __import__('pathlib').Path(sys.argv[2]))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", convert, str(raw), str(tmp_path / "folder")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())  # paths relative to tmp_path
    tiny = ["prepare.image_size=[104,32]", "prepare.val_fraction=0.5", "train.epochs=2", "train.batch_size=2",
            "model.painted_pillars.image_channels=8", "model.painted_pillars.point_channels=16",
            "model.painted_pillars.bev_channels=[16,16,32]", "model.painted_pillars.up_channels=16",
            "model.painted_pillars.head_channels=16", "optimize.int8.calibration_frames=2",
            "optimize.parity.frames=2", "optimize.latency.iterations=3", "optimize.latency.warmup=1",
            "optimize.latency.batch_sizes=[1]", "evaluate.workers=1"]  # fmt: skip

    def stage(name: str, *args: str) -> subprocess.CompletedProcess:
        sections = {"prepare": ("prepare",), "train": ("model", "train"), "optimize": ("optimize",),
                    "evaluate": ("evaluate",)}[name]  # fmt: skip
        sets = [x for o in tiny if o.split(".")[0] in sections for x in ("-S", o)]
        res = subprocess.run([sys.executable, "-m", f"tasks.{name}", "--params", str(tmp_path / "params.yaml"),
                              *sets, *args], env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"},
                             cwd=ROOT, capture_output=True, text=True, timeout=1200)  # fmt: skip
        assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
        return res

    stage("prepare", "--raw", str(tmp_path / "folder"), "--out", str(tmp_path / "prepared"))
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["source"]["layout"] == "folder"
    stage("train", "--data", str(tmp_path / "prepared"), "--out", str(tmp_path / "model"), "--no-track")
    stage("optimize", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "prepared"),
          "--out", str(tmp_path / "optimized"))  # fmt: skip
    stage("evaluate", "--model", str(tmp_path / "optimized"), "--data", str(tmp_path / "prepared"),
            "--out", str(tmp_path / "eval"), "--reference", str(tmp_path / "model"), "--no-track")  # fmt: skip
    kpis = json.loads((tmp_path / "eval" / "kpis.json").read_text())
    assert 0.0 <= kpis["mAP"] <= 1.0 and set(kpis["classes"]) == {"Car", "Pedestrian", "Cyclist"}
    assert kpis.get("delta") is not None  # scored against the PyTorch reference too


def test_installed_dataset_plugins_are_pinned_params_of_prepare(tmp_path: Path) -> None:
    """`prepare.plugins` records the installed dataset plugins (DVC's `prepare` param: another version of one
    recomputes prepare); the flow re-pins what is installed, a stage refuses a stale record (exit 2)."""
    from flows.params import load_params
    from pfactory.config.params_file import load_sections
    from pfactory.config.plugins import PluginError
    from pfactory.prepare.params import PrepareParams

    assert load_params(None).prepare.plugins == []  # none installed in this process
    f = tmp_path / "params.yaml"
    f.write_text("prepare:\n  plugins: [{name: folder, source: pfactory-folder-dataset 0.0.9, files_sha256: abc}]\n")
    with pytest.raises(PluginError, match=r"prepare\.plugins pins the dataset plugins folder"):
        load_sections(f, [], {"prepare": PrepareParams})
    assert load_params(f).prepare.plugins == []  # `factory run` pins the installed ones
