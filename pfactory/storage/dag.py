"""The stage DAG's one declaration: the stages `dvc.yaml` declares, in its order.

Read with PyYAML alone (`load_yaml`: its C loader when present; the pure-Python one takes ~20 ms on dvc.yaml), so that the
`factory` command line can list them (`factory run --until`) without importing anything heavy. Used by
`factory.cli`, `flows.pipeline` and `pfactory.report.compare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALLED_DVC_YAML = Path(__file__).resolve().parents[2] / "dvc.yaml"


def stage_names(project: Path | None = None) -> tuple[str, ...]:
    """The stages of `<project>/dvc.yaml` (default: the installed project's), in order; FileNotFoundError when
    that file is missing (the DAG is declared there)."""
    path = Path(project) / "dvc.yaml" if project is not None else INSTALLED_DVC_YAML
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the stage DAG is declared there")
    doc = load_yaml(path.read_text())
    return tuple((doc or {}).get("stages") or {})


def load_yaml(text: str) -> Any:
    """YAML text -> Python objects with PyYAML's safe C loader when libyaml is there (the pure-Python loader
    takes ~0.1 s on a run's 2,000-line `dvc.lock`, read several times per run), else its safe Python loader.
    For files the factory writes (`dvc.yaml`, `dvc.lock`); params files keep `params_file`'s own reader."""
    import yaml

    if hasattr(yaml, "CSafeLoader"):
        return yaml.load(text, Loader=yaml.CSafeLoader)
    return yaml.safe_load(text)
