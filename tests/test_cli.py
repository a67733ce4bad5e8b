"""The `factory` CLI: fast help, meaningful exit codes, parameter errors naming the key."""

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from pfactory.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_the_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("data", "prepare", "kpi", "params"):
        assert cmd in res.output


def test_cli_module_imports_nothing_heavy():
    # `factory --help` speed comes from lazy imports; guard the import graph, not a timing.
    code = "import sys, pfactory.cli; heavy = [m for m in ('torch', 'numpy', 'mlflow', 'prefect', 'dvc', 'nvidia.dali', 'pyarrow') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_params_override_error_exits_2_and_names_the_key():
    res = runner.invoke(app, ["params", "-S", "prepare.val_fraction=7"])
    assert res.exit_code == 2
    assert "prepare.val_fraction" in res.output


def test_params_prints_resolved_values():
    res = runner.invoke(app, ["params", "-S", "data.seed=42", "--params", str(ROOT / "params.yaml")])
    assert res.exit_code == 0, res.output
    assert "seed: 42" in res.output
