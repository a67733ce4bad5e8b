"""The `factory` CLI: fast help, meaningful exit codes, parameter errors naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("data", "prepare", "kpi", "params"):
        assert cmd in res.output


def test_cli_module_imports_nothing_heavy():
    # `factory --help` speed comes from lazy imports; guard the import graph, not a timing.
    code = "import sys, factory.cli; heavy = [m for m in ('torch', 'numpy', 'mlflow', 'prefect', 'dvc', 'nvidia.dali', 'pyarrow') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_params_override_error_exits_2_and_names_the_key():
    res = runner.invoke(app, ["params", "-S", "prepare.val_fraction=7"])
    assert res.exit_code == 2
    assert "prepare.val_fraction" in res.output


def test_params_prints_resolved_values():
    res = runner.invoke(app, ["params", "-S", "synth.seed=42", "--params", str(ROOT / "params.yaml")])
    assert res.exit_code == 0, res.output
    assert "seed: 42" in res.output


def test_data_check_clean_real_kitti_exits_0(real_kitti_dir, tmp_path):
    res = runner.invoke(app, ["data", "check", str(real_kitti_dir), "--json"])  # like every other --json
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.stdout)
    assert data["problems"] == [] and len(data["frames_ok"]) == 6


def test_rollback_and_bench_help_and_until(tmp_path):
    assert "--json" in runner.invoke(app, ["rollback", "--help"]).output
    import subprocess
    import sys

    res = subprocess.run(  # the benchmark's own help (its subprocess prints it), not the wrapper's
        [sys.executable, "-m", "factory.cli", "bench", "kpi", "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and "usage: bench_kpi.py" in res.stdout, res.stdout + res.stderr
    res = runner.invoke(app, ["run", "--until", "trian"])  # a choice list: refused before anything starts
    assert res.exit_code == 2 and "train" in res.output and "--until" in res.output


def test_data_show_without_arguments_names_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a folder with no project and no dataset
    res = runner.invoke(app, ["data", "show"])
    assert res.exit_code == 2 and "paths.raw" in res.output and "DIR [FRAME_ID]" in res.output


def test_data_check_corrupt_copy_exits_1_naming_the_file(kitti_copy):
    (kitti_copy / "training" / "velodyne" / "000003.bin").write_bytes(b"\x00" * 10)  # not float32 x4
    res = runner.invoke(app, ["data", "check", str(kitti_copy)])
    assert res.exit_code == 1
    assert "velodyne/000003.bin" in res.output


def test_data_show_writes_a_png(real_kitti_dir, tmp_path):
    out = tmp_path / "f.png"
    res = runner.invoke(app, ["data", "show", str(real_kitti_dir), "000001", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_show_unknown_frame_exits_1(real_kitti_dir, tmp_path):
    res = runner.invoke(app, ["data", "show", str(real_kitti_dir), "999999", "--out", str(tmp_path / "f.png")])
    assert res.exit_code == 1
    assert "999999" in res.output


@pytest.mark.parametrize("stage", ["prepare", "train", "optimize", "evaluate", "promote"])
def test_factory_stage_and_python_m_stage_take_the_same_options(stage: str) -> None:
    """`factory <stage>` and `python -m tasks.<stage>` are both built from `tasks.<stage>.COMMAND`: the same
    option names, flags, defaults and help; and a value given to either reaches the stage body the same way."""
    import importlib

    import typer.main

    from tasks._stage import parser

    command = importlib.import_module(f"tasks.{stage}").COMMAND
    argp = {a.dest: a for a in parser(command)._actions if a.dest != "help"}
    click_cmd = typer.main.get_command(app).commands[stage]
    typer_params = {p.name: p for p in click_cmd.params}
    assert set(argp) - {"params"} == set(typer_params) - {"params_file"}
    for o in command.options:
        a, t = argp[o.name], typer_params[o.name]
        assert a.help == o.help == t.help
        assert a.default == o.default and (t.default == o.default or (o.default is None and t.default is None))
        if not o.positional:
            assert set(a.option_strings) == set(t.opts) | set(t.secondary_opts), o.name
    assert click_cmd.help == command.help


def test_a_stage_option_value_reaches_the_body_the_same_way_from_both_entries(monkeypatch, tmp_path) -> None:
    import tasks.optimize

    seen: list[tuple] = []
    monkeypatch.setattr(tasks.optimize, "run", lambda *a, **kw: seen.append((a[1:], kw)) or {})
    args = ["--out", str(tmp_path / "o"), "--precision", "int8", "--backend", "onnxruntime", "--params",
            str(ROOT / "params.yaml")]  # fmt: skip
    res = runner.invoke(app, ["optimize", *args])
    assert res.exit_code == 0, res.output
    tasks.optimize.main(args)
    assert len(seen) == 2 and seen[0] == seen[1], seen
    (model, _data, out), options = seen[0]
    assert out == tmp_path / "o" and Path(model).resolve() == ROOT / "artifacts" / "model"  # paths.model
    assert options == {"backend": "onnxruntime", "precision": "int8"}
