"""dvc.yaml agrees with the code: each stage's deps cover every file its command may execute, and the
stages, the params.yaml sections and the tasks/ modules are the same set of names.

The code deps are generated from the import closure (`python -m tests.import_graph` rewrites them);
this test fails when they drift, e.g. after an import is added without its dep: DVC would then serve
a stale output from its run-cache after a change to that file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.params import Params
from tests.import_graph import ROOT, covered, path_to, stage_files

DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
# Sections that are not stages: read by several (model: train, optimize, evaluate through
# model_config.json) or by all (paths).
NOT_STAGES = {"model", "paths", "gc"}


def test_every_stage_runs_its_task_module() -> None:
    """`python -m tasks.<stage>`, with nothing after it but options the stage declares (`COMMAND.options`)."""
    import importlib
    import shlex

    for name, stage in DVC.items():
        words = shlex.split(stage["cmd"])
        assert words[:3] == ["python", "-m", f"tasks.{name}"], f"dvc.yaml stage {name}: cmd {stage['cmd']!r}"
        declared = {f for o in importlib.import_module(f"tasks.{name}").COMMAND.options for f in o.flags}
        declared |= {"--no-" + f.removeprefix("--") for f in declared}
        assert set(words[3:]) <= declared, f"dvc.yaml stage {name}: {stage['cmd']!r} (flags without values only)"


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


def test_a_stage_depends_on_no_other_stage_s_params_module() -> None:
    """A stage reads only its own params sections (`tasks.<stage>.SECTIONS`, `pfactory.config.params_file`): the
    promotion gates' defaults (pfactory/promote/params.py) are code of promote alone, the generator's
    (pfactory/synth/params.py) of synth alone, so editing one reruns only that stage."""
    for module, owner in (("pfactory/promote/params.py", "promote"), ("pfactory/synth/params.py", "synth")):
        users = sorted(name for name in DVC if module in stage_files(name))
        assert users == [owner], f"{module} is a code dep of {users}, expected only {owner}"
    assert not any("flows/params.py" in stage_files(name) for name in DVC), "a stage imports every section"


@pytest.mark.slow
def test_dvc_status_after_a_promotion_default_changes_names_only_promote(tmp_path: Path) -> None:
    """Every stage recorded as up to date (`dvc commit` over placeholder outputs), then one promotion gate's
    default edited: `dvc status` lists promote alone (train is not retrained for a gate)."""
    from dvc.repo import Repo

    from tests.flows.pipeline_project import dvc, make_project

    project = make_project(tmp_path / "p")
    with Repo(str(project)) as repo:
        for stage in repo.index.stages:
            for out in stage.outs:
                path = Path(out.fs_path)
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(f"placeholder of {stage.name}\n")
            for dep in stage.deps:
                path = Path(dep.fs_path)
                if not path.exists():  # a data dep outside the DAG (the raw dataset): a placeholder too
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("placeholder\n")
    r = dvc(project, "commit", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    def status() -> dict:
        r = dvc(project, "status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    assert set(status()) <= {"promote"}, status()  # promote is `always_changed` (the registry moves)
    gates = project / "pfactory" / "promote" / "params.py"
    gates.write_text(gates.read_text().replace("min_map: Annotated[float, Field(ge=0, le=1)] = 0.3",
                                               "min_map: Annotated[float, Field(ge=0, le=1)] = 0.35"))  # fmt: skip
    after = status()
    # the file, or its folder when promote depends on every module in it (tests.import_graph folds those)
    assert set(after) == {"promote"} and "pfactory/promote" in json.dumps(after), after
    # The check can fail: a default of train's own section reruns train.
    train = project / "pfactory" / "train" / "params.py"
    train.write_text(train.read_text() + "\n# edited\n")
    assert "train" in status()


def test_dvc_parses_yaml_with_the_c_parser() -> None:
    """Every `dvc repro` parses dvc.yaml and dvc.lock (a ~2,000-line file) about 7 times with ruamel.yaml's
    "safe" loader; without ruamel.yaml.clib that loader is pure Python (~1 s per stage on a 2-core box, vs
    ~0.15 s). pyproject.toml requires the C parser; this fails when an install lacks it."""
    from dvc.utils.serialize._yaml import parse_yaml
    from ruamel.yaml import YAML
    from ruamel.yaml.main import CParser

    assert CParser is not None, "ruamel.yaml.clib is not installed: DVC parses YAML in pure Python"
    assert YAML(typ="safe").Parser is CParser
    text = (ROOT / "dvc.yaml").read_text()
    assert parse_yaml(text, "dvc.yaml")["stages"].keys() == DVC.keys()


def test_each_stage_comes_after_the_stages_it_reads_from() -> None:
    """dvc.yaml lists the stages in an order of the DAG: a stage reading another's output comes after it.
    `flows.workspace.Workspace.repro` relies on it (`--single-item` once every earlier stage was reproduced)."""
    import re

    paths = yaml.safe_load((ROOT / "params.yaml").read_text())["paths"]

    def resolved(entries: list) -> list[str]:
        out = []
        for e in entries or []:
            e = next(iter(e)) if isinstance(e, dict) else e  # `- path: {cache: false}` form
            out.append(re.sub(r"\$\{paths\.(\w+)\}", lambda m: str(paths[m.group(1)]), str(e)).rstrip("/"))
        return out

    order = list(DVC)
    outs = {name: resolved(stage.get("outs")) for name, stage in DVC.items()}
    for name, stage in DVC.items():
        for dep in resolved(stage.get("deps")):
            for producer, made in outs.items():
                if producer != name and any(dep == o or dep.startswith(o + "/") for o in made):
                    assert order.index(producer) < order.index(name), (
                        f"dvc.yaml: stage {name} reads {dep} (an output of {producer}) but is listed before it"
                    )
