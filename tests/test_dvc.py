"""dvc.yaml agrees with the code: each stage's deps cover every file its command may execute, and the
stages, the params.yaml sections and the tasks/ modules are the same set of names.

The code deps are generated from the import closure (`python -m tests.import_graph` rewrites them);
this test fails when they drift, e.g. after an import is added without its dep: DVC would then serve
a stale output from its run-cache after a change to that file.
"""

from __future__ import annotations

import yaml

from pfactory.config import Params
from tests.import_graph import ROOT, covered, path_to, stage_files

DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
# Sections that are not stages: read by several (model: train, optimize, evaluate through
# model_config.json) or by all (paths).
NOT_STAGES = {"model", "paths", "gc"}


def test_every_stage_runs_its_task_module() -> None:
    for name, stage in DVC.items():
        assert stage["cmd"] == f"python -m tasks.{name}", f"dvc.yaml stage {name}: cmd {stage['cmd']!r}"


def test_stage_deps_cover_the_import_closure() -> None:
    missing = []
    for name, stage in DVC.items():
        deps = [d for d in stage.get("deps", []) if not d.startswith("${")]
        for f in sorted(stage_files(name)):
            if not covered(f, deps):
                module = f.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                missing.append(f"{name}: {f}  (" + " -> ".join(path_to(f"tasks.{name}", module)) + ")")
    assert not missing, (
        "dvc.yaml deps miss files their stage imports (DVC would reuse stale outputs when they change); "
        "run `python -m tests.import_graph` to regenerate:\n" + "\n".join(missing)
    )


def test_stage_deps_exist() -> None:
    for name, stage in DVC.items():
        for d in stage.get("deps", []):
            if not d.startswith("${"):
                assert (ROOT / d).exists(), f"dvc.yaml stage {name}: dep {d} does not exist"


def test_stages_sections_and_task_modules_agree() -> None:
    stages = set(DVC)
    tasks = {p.stem for p in (ROOT / "tasks").glob("*.py") if not p.stem.startswith("_")}
    sections = set(Params.model_fields) - NOT_STAGES
    assert stages == tasks == sections, (
        f"dvc.yaml {sorted(stages)}, tasks/ {sorted(tasks)}, params {sorted(sections)}"
    )
    for name, stage in DVC.items():
        declared = [p.split(".")[0] for p in stage.get("params", [])]
        assert name in declared, f"dvc.yaml stage {name} does not depend on its own params section"
        unknown = set(declared) - set(Params.model_fields)
        assert not unknown, f"dvc.yaml stage {name}: params {sorted(unknown)} are not params.yaml sections"
