"""The stage DAG's one declaration: the stages `dvc.yaml` declares, in its order.

Read with PyYAML alone (its C loader when present: the pure-Python one takes ~20 ms on dvc.yaml), so that the
`factory` command line can list them (`factory run --until`) without importing anything heavy. Used by
`flows.cli`, `flows.pipeline` and `pfactory.compare`.
"""

from __future__ import annotations

from pathlib import Path

INSTALLED_DVC_YAML = Path(__file__).resolve().parents[1] / "dvc.yaml"


def stage_names(project: Path | None = None) -> tuple[str, ...]:
    """The stages of `<project>/dvc.yaml` (default: the installed project's), in order; FileNotFoundError when
    that file is missing (the DAG is declared there)."""
    import yaml

    path = Path(project) / "dvc.yaml" if project is not None else INSTALLED_DVC_YAML
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the stage DAG is declared there")
    text = path.read_text()
    doc = yaml.load(text, Loader=yaml.CSafeLoader) if hasattr(yaml, "CSafeLoader") else yaml.safe_load(text)
    return tuple((doc or {}).get("stages") or {})
