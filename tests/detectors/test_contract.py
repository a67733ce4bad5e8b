"""The detector contract (pfactory/detectors): the factory knows an architecture only through it.

- Outside an architecture's own package, no library module (pfactory/, flows/, tasks/) imports a concrete
  detector or its loss/decode, and none knows the default head's output names (`heatmap`, `reg`): the
  trainer, export, INT8, parity, evaluate and promotion use the contract's `Detections`.
- `check_detector` / `check_architecture` refuse what breaks the contract, naming the part.
- The registry resolves built-ins by entry point, lazily, and says in one line what is wrong with a plugin.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import ROOT, _entry_point_modules, imports_of, modules

LIBRARY = ("pfactory", "flows", "tasks")
# The default architecture's own modules that nothing outside its package may import (its building
# blocks -- layers, pillars, painting, variants, targets' Gaussian helpers -- other architectures may reuse).
DETECTOR_INTERNALS = ("pfactory.archs.painted_pillars.detector", "pfactory.archs.painted_pillars.decode", "pfactory.archs.painted_pillars.loss", "pfactory.archs.painted_pillars.arch")


def _arch_packages() -> set[str]:
    """The packages of the built-in architectures (pyproject.toml's `pfactory.models` entry points)."""
    return {m.rsplit(".", 1)[0] for m in _entry_point_modules("pfactory.models")}


def _inside(module: str, packages: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_nothing_outside_an_architecture_imports_its_detector() -> None:
    packages = _arch_packages()
    assert "pfactory.archs.painted_pillars" in packages and len(packages) >= 2, packages  # the default and a second one
    bad = [
        f"{m} -> {t}"
        for m in sorted(modules())
        if m.split(".")[0] in LIBRARY and not _inside(m, packages) and m != "pfactory.detectors.registry"
        for t in sorted(imports_of(m))
        if t in DETECTOR_INTERNALS or (_inside(t, packages - {"pfactory.archs.painted_pillars"}) and not _inside(m, packages))
    ]
    assert not bad, "library modules importing an architecture's internals (use pfactory.detectors):\n" + "\n".join(bad)


def _head_name_uses(path: Path) -> list[str]:
    """`"heatmap"` / `"reg"` used as a key (subscript or dict key) in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
        for k in keys:
            if isinstance(k, ast.Constant) and k.value in ("heatmap", "reg"):
                found.append(f"{path.relative_to(ROOT)}:{k.lineno}: {k.value!r}")
    return found


def test_no_library_module_outside_an_architecture_knows_its_head_outputs() -> None:
    packages = _arch_packages()
    bad = [
        use
        for name, path in sorted(modules().items())
        if name.split(".")[0] in LIBRARY and not _inside(name, packages)
        for use in _head_name_uses(path)
    ]
    assert not bad, "the default head's output names used outside its architecture:\n" + "\n".join(bad)


def test_the_scan_sees_head_names(tmp_path: Path) -> None:
    """The check above can fail: it finds a subscript and a dict key."""
    f = ROOT / "pfactory" / "archs" / "painted_pillars" / "detector.py"
    assert _head_name_uses(f), "the default detector uses out['heatmap']: the scan must see it"


def test_check_detector_names_the_missing_part() -> None:
    import torch

    from pfactory.detectors.contract import ContractError, DataSpec, check_detector

    class Half(torch.nn.Module):
        inputs = ("points", "num_points")
        deploy_inputs = ("points", "num_points")
        spec = DataSpec(("Car",), (0.0, -8.0, -3.0, 16.0, 8.0, 1.0))
        params = None
        max_detections = 10

        def forward(self, points, num_points):
            return points

        def loss(self, out, batch, ctx):
            return {"loss": out.sum()}

        def forward_export(self, points, num_points):
            return points, points, points

    with pytest.raises(ContractError, match="lacks decode"):
        check_detector(Half())
    Half.decode = lambda self, out: out
    check_detector(Half())
    Half.deploy_inputs = ("points", "images")
    with pytest.raises(ContractError, match="deploy_inputs"):
        check_detector(Half())
    Half.deploy_inputs = ("points", "num_points")
    Half.inputs = ("points", "lidar_bev")
    with pytest.raises(ContractError, match=r"inputs = .*lidar_bev"):
        check_detector(Half())
    Half.inputs = ("points", "num_points")
    Half.int8_float_modules = "head"  # a string, not a tuple of module paths
    with pytest.raises(ContractError, match="int8_float_modules must be a tuple of module paths"):
        check_detector(Half())


def test_an_architectures_int8_float_modules_join_the_excluded_nodes() -> None:
    """centerpoint_lidar names its point heading (centimetre-scale moments), a module it has; a detector
    without the hook names nothing."""
    from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams
    from pfactory.detectors.contract import DataSpec, int8_float_modules
    from pfactory.detectors.registry import build

    spec = DataSpec(("Car", "Pedestrian"), (0.0, -8.0, -3.0, 16.0, 8.0, 1.0))
    model = build("centerpoint_lidar", CenterPointLidarParams(), spec)
    assert int8_float_modules(model) == ("point_heading",)
    assert any(name.startswith("point_heading.") for name, _ in model.named_modules())
    assert int8_float_modules(object()) == ()


def test_architecture_params_may_not_declare_data_facts() -> None:
    from pfactory.archs.painted_pillars.params import ModelParams, PaintedPillarsParams
    from pfactory.detectors.contract import Architecture, ContractError, check_architecture

    check_architecture(Architecture(PaintedPillarsParams, lambda p, s: None))
    with pytest.raises(ContractError, match="classes"):
        check_architecture(Architecture(ModelParams, lambda p, s: None))
    with pytest.raises(ContractError, match=r"not a pfactory\.detectors\.contract\.Architecture"):
        check_architecture(object())


def test_the_default_architecture_builds_through_the_registry() -> None:
    from pfactory.detectors import registry
    from pfactory.detectors.contract import DataSpec

    spec = DataSpec(("Car", "Pedestrian"), (0.0, -8.0, -3.0, 16.0, 8.0, 1.0), (64, 32), ("image_2",))
    model = registry.build("painted_pillars", {"image_channels": 8, "point_channels": 16,
                                               "bev_channels": [16, 16, 32], "up_channels": 16, "head_channels": 16}, spec)  # fmt: skip
    assert type(model).__name__ == "PaintedPillarDetector" and model.spec == spec
    assert list(model.params.classes) == ["Car", "Pedestrian"] and list(model.params.pc_range) == list(spec.pc_range)


def test_listing_imports_nothing_heavy_and_an_unknown_name_is_one_line() -> None:
    """`factory models` lists without importing torch for the registry itself; an unknown architecture is
    one line with exit 2 and the installed names."""
    code = (
        "import sys; from pfactory.config import plugins; e = plugins.entries(plugins.MODELS); "
        "print(sorted(e)); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    names, torch_loaded = out.stdout.splitlines()
    assert "painted_pillars" in names and torch_loaded == "False"
    r = subprocess.run([sys.executable, "-m", "factory.cli", "models", "no_such_arch"], capture_output=True,
                       text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no model plugin named 'no_such_arch'" in r.stderr and "painted_pillars" in r.stderr


def test_params_pin_the_plugin_and_a_stage_refuses_another_version(tmp_path: Path) -> None:
    """A record in `model.plugin` that differs from the installed plugin is refused by a stage (one line,
    exit 2): the run-cache key must never mix plugin versions. The built-in needs no record."""
    from flows.params import load_params
    from pfactory.config.plugins import PluginError

    assert load_params(None).model.plugin is None
    f = tmp_path / "params.yaml"
    f.write_text("model:\n  arch: painted_pillars\n  plugin: {name: painted_pillars, source: other 0.0, files_sha256: abc}\n")
    from pfactory.config.params_file import load_sections
    from pfactory.detectors.params import ModelSection

    with pytest.raises(PluginError, match="another version of the plugin"):
        load_sections(f, [], {"model": ModelSection})
    assert load_params(f).model.plugin is None  # the flow re-pins what is installed (nothing, for a built-in)
