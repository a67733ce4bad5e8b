"""The out-of-tree example plugin (`examples/detector-plugin`, DESIGN.md §5b) installed as a real package.

Every test installs the package with pip into a temporary target folder (its copy: the example's own folder
stays clean) and runs the factory in a subprocess with that folder on PYTHONPATH, so the entry point is found
the way a user's `pip install` makes it found: from the installed metadata, nothing registered in-process.

- the contract, in-process: the example's detector trains (loss falls), decodes, and its deployable forward
  exports to ONNX (opset 18, dynamic batch) and runs in ONNX Runtime with the PyTorch outputs;
- `factory models` lists it with its distribution and version beside the built-ins;
- broken plugins (a missing module, an object that is not an architecture, a detector without `decode`): one
  line naming the plugin and its distribution, exit 2, no traceback; `factory models` still lists the rest;
- end to end (`factory run -S model.arch=tiny_bev` in a throw-away project copy): exit 0, the plugin record
  in model_config.json, the MLflow run and the registered model version; then an edited plugin with a bumped
  version, reinstalled into the same target: train is recomputed, not restored from the run-cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import plugin_install
from tests.flows.pipeline_project import clean_env, factory, make_project, tiny_args, write_tiny_params

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "detector-plugin"
DIST, VERSION, NAME = "pfactory-tiny-detector", "0.1.0", "tiny_bev"

# A second, broken distribution: one entry point to a module that does not exist, one to an object that is
# not an architecture (no build), one to an architecture whose built detector lacks `decode`.
BROKEN_DIST = "pfactory-broken-models"
BROKEN_PYPROJECT = f"""
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{BROKEN_DIST}"
version = "0.0.1"

[project.entry-points."pfactory.models"]
ghost = "no_such_module:ARCH"
hollow = "pfactory_broken_models:NOT_AN_ARCH"
nodecode = "pfactory_broken_models:NO_DECODE"

[tool.setuptools]
packages = ["pfactory_broken_models"]
"""
BROKEN_INIT = '''
"""Broken on purpose (tests/test_detector_plugin.py)."""
from pfactory.detectors.contract import Architecture
from pfactory_tiny_detector import TinyBevParams
from pfactory_tiny_detector import build as _build


class _NotAnArchitecture:
    params = TinyBevParams  # and no build


def _build_without_decode(params, spec):
    import torch

    inner = _build(params, spec)

    class NoDecodeDetector(torch.nn.Module):  # every part of the contract but decode
        inputs, deploy_inputs = inner.inputs, inner.deploy_inputs

        def __init__(self):
            super().__init__()
            self.inner, self.spec, self.params = inner, inner.spec, inner.params
            self.max_detections = inner.max_detections

        def forward(self, *args):
            return self.inner(*args)

        def loss(self, *args):
            return self.inner.loss(*args)

        def forward_export(self, *args):
            return self.inner.forward_export(*args)

    return NoDecodeDetector()


NOT_AN_ARCH = _NotAnArchitecture()
NO_DECODE = Architecture(params=TinyBevParams, build=_build_without_decode, description="no decode")
'''


def install_plugin(src: Path, target: Path) -> dict[str, str]:
    """`tests.plugin_install.install_plugin`, keeping only its `PYTHONPATH`: the subprocesses here start from
    `clean_env` (no inherited MLflow/Prefect/DVC settings)."""
    return {"PYTHONPATH": plugin_install.install_plugin(src, target)["PYTHONPATH"]}


def _cli(cwd: Path, *args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`factory <args>` (this checkout's factory.cli) in `cwd` with the plugin environment `env`."""
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *args],
        cwd=cwd, env={**clean_env(cwd), "PYTHONPATH": os.pathsep.join([str(REPO), env["PYTHONPATH"]])},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The example plugin installed into a temporary target: the environment for subprocesses."""
    return install_plugin(EXAMPLE, tmp_path_factory.mktemp("plugin") / "site")


@pytest.fixture(scope="module")
def broken_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The example plugin and the broken distribution, installed into one temporary target."""
    root = tmp_path_factory.mktemp("broken")
    src = root / "broken-src"
    (src / "pfactory_broken_models").mkdir(parents=True)
    (src / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (src / "pfactory_broken_models" / "__init__.py").write_text(BROKEN_INIT)
    target = root / "site"
    install_plugin(EXAMPLE, target)
    return install_plugin(src, target)


def _one_line_error(r: subprocess.CompletedProcess, *names: str) -> str:
    """Assert `r` failed with exit 2 and one stderr line naming every one of `names`; returns that line."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    hits = [ln for ln in lines if all(n in ln for n in names)]
    assert hits, (names, r.stderr[-3000:])
    return hits[0]


# --- the contract, in-process -------------------------------------------------------------------------------


def test_example_trains_decodes_and_exports(tmp_path: Path) -> None:
    """The example's detector through the contract as the factory drives it: contract check, a few steps of
    training that lower the loss, decode's shapes, and `forward_export` -> ONNX (the factory's exporter,
    opset 18) -> ONNX Runtime with the PyTorch outputs."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from pfactory.detectors.contract import DataSpec, LossContext, check_architecture, check_detector
    from pfactory.optimize.export import export_onnx

    sys.path.insert(0, str(EXAMPLE))
    try:
        from pfactory_tiny_detector import ARCH
    finally:
        sys.path.remove(str(EXAMPLE))
    arch = check_architecture(ARCH)
    spec = DataSpec(("Car", "Pedestrian", "Cyclist"), (0.0, -40.0, -3.0, 70.4, 40.0, 1.0))
    torch.manual_seed(0)
    model = arch.build(arch.params(), spec)
    check_detector(model)
    assert model.grid_hw == (100, 88)

    g = torch.Generator().manual_seed(0)
    points = torch.rand(2, 2000, 4, generator=g) * torch.tensor([70.4, 80.0, 4.0, 1.0]) + torch.tensor(
        [0, -40, -3, 0]
    )
    num_points = torch.tensor([2000, 900])
    boxes = torch.tensor([[[10.0, 0.0, -1.0, 4.0, 1.8, 1.5, 0.3], [20.0, 5.0, -0.9, 0.8, 0.6, 1.7, -2.0]],
                          [[30.0, -10.0, -1.0, 1.8, 0.6, 1.7, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])  # fmt: skip
    labels = torch.tensor([[0, 1], [2, -1]])
    batch = {"points": points, "num_points": num_points, "boxes": boxes, "labels": labels}
    ctx = LossContext(all_reduce_sum=lambda t: t)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        terms = model.loss(model(points, num_points), batch, ctx)
        assert set(terms) == {"loss", "heatmap", "reg"} and all(t.dim() == 0 for t in terms.values())
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
        losses.append(float(terms["loss"].detach()))
    assert losses[-1] < 0.5 * losses[0], losses

    model.eval()
    with torch.no_grad():
        det = model.decode(model(points, num_points))
        ref = model.forward_export(points, num_points)
    d = model.max_detections
    assert det.boxes.shape == (2, d, 7) and det.scores.shape == (2, d) and det.labels.dtype == torch.int64
    assert bool((det.scores[:, :-1] >= det.scores[:, 1:]).all())

    result = export_onnx(model, tmp_path / "model.onnx", cameras=0, opset=18)
    assert result.dynamic_batch, result.fallback_reason
    assert [t.name for t in result.inputs] == ["points", "num_points"]
    assert "ScatterElements" in result.checks["op_types"]
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"points": points.numpy(), "num_points": num_points.numpy()})
    np.testing.assert_allclose(got[0], ref[0].numpy(), atol=1e-3)
    np.testing.assert_allclose(got[1], ref[1].numpy(), atol=1e-5)
    np.testing.assert_array_equal(got[2], ref[2].numpy())


# --- factory models ----------------------------------------------------------------------------------------


def test_models_lists_the_installed_plugin(plugin_env: dict[str, str], tmp_path: Path) -> None:
    """`factory models` lists tiny_bev with its entry point and `pfactory-tiny-detector 0.1.0`, beside the
    built-in painted_pillars; `factory models tiny_bev` prints its section's defaults from its own schema."""
    r = _cli(tmp_path, "models", env=plugin_env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert NAME in rows and "painted_pillars" in rows, r.stdout
    assert "pfactory_tiny_detector:ARCH" in rows[NAME] and rows[NAME].rstrip().endswith(f"{DIST} {VERSION}")
    assert rows["painted_pillars"].rstrip().endswith("built-in")
    assert "BROKEN" not in r.stdout

    listed = json.loads(_cli(tmp_path, "models", "--json", env=plugin_env).stdout)
    mine = next(row for row in listed if row["name"] == NAME)
    assert mine["source"] == f"{DIST} {VERSION}" and mine["status"] == "ok"

    r = _cli(tmp_path, "models", NAME, env=plugin_env)
    assert r.returncode == 0, r.stderr[-2000:]
    section = yaml.safe_load(r.stdout)["model"]
    assert (
        section["arch"] == NAME and section[NAME]["cell_m"] == 0.8 and section[NAME]["max_detections"] == 50
    )


# --- bad plugins ------------------------------------------------------------------------------------------


def test_broken_plugins_are_one_line_and_break_nothing_else(
    broken_env: dict[str, str], tmp_path: Path
) -> None:
    """A plugin whose module is missing and one whose object is not an architecture: `factory run` selecting
    it exits 2 with one line naming the plugin and its distribution (no traceback, nothing run); `factory
    models` still lists every other architecture, the broken ones marked with their error."""
    project = make_project(tmp_path / "project", first_start=True)

    r = _cli(tmp_path, "models", env=broken_env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "BROKEN" not in rows["painted_pillars"] and "BROKEN" not in rows[NAME], r.stdout
    assert "BROKEN" in rows["ghost"] and "no_such_module" in rows["ghost"], rows["ghost"]
    assert "BROKEN" in rows["hollow"] and "build" in rows["hollow"], rows["hollow"]
    assert f"{BROKEN_DIST} 0.0.1" in rows["ghost"]

    for name, what in (("ghost", "no_such_module"), ("hollow", "build")):
        r = _cli(project, "run", "-S", f"model.arch={name}", env=broken_env, timeout=300)
        line = _one_line_error(r, repr(name), BROKEN_DIST, what)
        assert len(line) < 600, line
        runs = project / "artifacts" / "runs"
        assert not runs.exists() or not any(runs.iterdir()), "a run workspace was made for a broken plugin"
        # `factory models NAME` says the same in one line
        r = _cli(tmp_path, "models", name, env=broken_env)
        _one_line_error(r, repr(name), BROKEN_DIST)

    # The plugin's own schema refuses an unknown key of its section, naming it (exit 2, one line).
    r = _cli(project, "run", "-S", f"model.arch={NAME}", "-S", f"model.{NAME}.cel_m=0.4", env=broken_env)
    _one_line_error(r, f"model.{NAME}.cel_m", "unknown key")

    # Selecting the installed good plugin from the same environment still resolves (the broken ones do not
    # affect it): `factory params` validates model.tiny_bev with the plugin's schema and pins its record.
    r = _cli(project, "params", "-S", f"model.arch={NAME}", env=broken_env)
    assert r.returncode == 0, r.stderr[-2000:]
    model = yaml.safe_load(r.stdout)["model"]
    assert model["arch"] == NAME and model[NAME]["cell_m"] == 0.8


# --- the stages with the plugin (default tier) --------------------------------------------------------------


def _stage(project: Path, stage: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m tasks.<stage> <args>` in `project` (what dvc.yaml runs), with the plugin environment."""
    return subprocess.run(
        [sys.executable, "-m", f"tasks.{stage}", *args],
        cwd=project, env={**clean_env(project), **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_stages_run_the_plugin_and_record_it(broken_env: dict[str, str], tmp_path: Path) -> None:
    """The stage commands on a tiny synthetic set with `model.arch=tiny_bev`, the broken distribution
    installed beside it (it affects nothing else): train writes model_config.json with the plugin record,
    optimize exports its lidar-only graph (inputs points, num_points), quantizes it and passes parity, and
    its manifest carries the record; evaluate scores it. A detector without `decode` is refused by train in
    one line naming the plugin and its distribution (exit 2)."""
    project = make_project(tmp_path / "project", first_start=True)
    write_tiny_params(project)
    for stage in ("synth", "prepare"):
        r = _stage(project, stage, env=broken_env)
        assert r.returncode == 0, (stage, r.stderr[-3000:])
    r = _stage(project, "train", "--no-track", "-S", f"model.arch={NAME}", env=broken_env)
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((project / "artifacts" / "model" / "model_config.json").read_text())
    assert config["arch"] == NAME and config["model"]["cell_m"] == 0.8
    plugin = config["plugin"]
    assert (plugin["dist"], plugin["version"], plugin["source"]) == (DIST, VERSION, f"{DIST} {VERSION}")
    assert len(plugin["files_sha256"]) == 64

    r = _stage(project, "optimize", env=broken_env)
    assert r.returncode == 0, r.stderr[-3000:]
    optimized = project / "artifacts" / "optimized"
    manifest = json.loads((optimized / "backend.json").read_text())
    assert manifest["model"]["arch"] == NAME and manifest["model"]["plugin"] == plugin
    assert manifest["model"]["inputs"] == ["points", "num_points"]
    assert json.loads((optimized / "parity.json").read_text())["passed"] is True

    r = _stage(project, "evaluate", "--no-track", env=broken_env)
    assert r.returncode == 0, r.stderr[-3000:]
    kpis = json.loads((project / "artifacts" / "eval" / "kpis.json").read_text())
    assert 0.0 <= kpis["mAP"] <= 1.0

    r = _stage(project, "train", "--no-track", "--out", str(tmp_path / "nodecode"), "-S", "model.arch=nodecode",
               env=broken_env)  # fmt: skip
    _one_line_error(r, "'nodecode'", BROKEN_DIST, "decode")
    assert not (tmp_path / "nodecode" / "model.pt").exists()


# --- end to end: factory run, then an edited plugin (full tier) ---------------------------------------------


def _run(project: Path, name: str, env: dict[str, str]) -> dict:
    """`factory run` (tiny) with tiny_bev selected; its --json result."""
    args = [*tiny_args(), "-S", f"model.arch={NAME}", "-S", "promote.min_map=0", "--name", name, "--json"]
    r = factory(project, "run", *args, env=env, timeout=1500)
    assert r.returncode == 0, f"factory run {name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout[r.stdout.index("{") :])


def _version_tags(project: Path, run_id: str) -> dict[str, str]:
    """Tags of the registered model version made from the pipeline run `run_id` (MLflow registry)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'artifacts' / 'mlflow' / 'mlflow.db'}")
    versions = [
        v
        for rm in client.search_registered_models()
        for v in client.search_model_versions(f"name='{rm.name}'")
    ]
    mine = [v for v in versions if v.run_id == run_id or v.tags.get("run_id") == run_id]
    assert mine, f"no registered model version of run {run_id}: {[(v.version, v.run_id) for v in versions]}"
    return dict(mine[0].tags)


@pytest.mark.slow
@pytest.mark.full
def test_factory_run_end_to_end_and_a_new_plugin_version_retrains(tmp_path: Path) -> None:
    """`factory run -S model.arch=tiny_bev` in a throw-away project: exit 0, every stage ran, the registered
    model version, its model card and model_config.json name pfactory-tiny-detector 0.1.0. Then the plugin's
    code is edited (a default) and its version bumped to 0.1.1, reinstalled into the same target: the next
    run restores synth and prepare from the run-cache but trains anew, and records 0.1.1."""
    project = make_project(tmp_path / "project")
    target = tmp_path / "site"
    env = install_plugin(EXAMPLE, target)

    first = _run(project, "tiny-1", env)
    assert all(first["stages"][s]["ran"] for s in ("synth", "prepare", "train", "optimize", "evaluate")), (
        first["stages"]
    )
    ws = Path(first["workspace"])
    config = json.loads((ws / "artifacts" / "model" / "model_config.json").read_text())
    assert config["arch"] == NAME and (config["plugin"]["dist"], config["plugin"]["version"]) == (
        DIST,
        VERSION,
    )
    tags = _version_tags(project, first["mlflow_run_id"])
    assert tags.get("model.arch") == NAME, tags
    assert (tags.get("model.plugin.dist"), tags.get("model.plugin.version")) == (DIST, VERSION), tags
    assert tags.get("model.plugin.files_sha256") == config["plugin"]["files_sha256"]
    card = (ws / "artifacts" / "release" / "MODEL_CARD.md").read_text()
    assert f"{DIST} {VERSION}" in card and NAME in card

    # A new version of the plugin: a changed default (one more conv in the stride-2 stage) and version 0.1.1.
    edited = tmp_path / "detector-plugin-0.1.1"
    shutil.copytree(EXAMPLE, edited, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    params_py = edited / "pfactory_tiny_detector" / "params.py"
    text = params_py.read_text()
    assert "down_blocks: Annotated[int, Field(ge=0, le=4)] = 1" in text
    params_py.write_text(
        text.replace(
            "down_blocks: Annotated[int, Field(ge=0, le=4)] = 1",
            "down_blocks: Annotated[int, Field(ge=0, le=4)] = 2",
        )
    )
    pyproject = edited / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'version = "{VERSION}"', 'version = "0.1.1"'))
    env = install_plugin(edited, target)
    listed = _cli(tmp_path, "models", env=env).stdout
    assert f"{DIST} 0.1.1" in listed and f"{DIST} {VERSION}" not in listed, listed

    second = _run(project, "tiny-2", env)
    stages = second["stages"]
    assert stages["synth"]["restored_from_run_cache"] or stages["synth"]["unchanged"], stages["synth"]
    assert stages["prepare"]["restored_from_run_cache"] or stages["prepare"]["unchanged"], stages["prepare"]
    assert stages["train"]["ran"] and not stages["train"]["restored_from_run_cache"], stages["train"]
    assert stages["train"]["how"] == "ran", stages["train"]
    config2 = json.loads(
        (Path(second["workspace"]) / "artifacts" / "model" / "model_config.json").read_text()
    )
    assert config2["plugin"]["version"] == "0.1.1" and config2["model"]["down_blocks"] == 2
    assert config2["plugin"]["files_sha256"] != config["plugin"]["files_sha256"]
    tags2 = _version_tags(project, second["mlflow_run_id"])
    assert tags2.get("model.plugin.version") == "0.1.1", tags2
