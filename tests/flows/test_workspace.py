"""`flows.workspace.Workspace.upstream_reproduced`: `dvc repro --single-item` only when every stage before
the one asked for (in dvc.yaml's order, the DAG's: tests/test_dvc.py) was reproduced through the workspace."""

from __future__ import annotations

from pathlib import Path

from flows.workspace import Workspace

DVC_YAML = """stages:
  a: {cmd: python -m tasks.a}
  b: {cmd: python -m tasks.b}
  c: {cmd: python -m tasks.c}
"""


def test_single_item_only_after_every_upstream_stage_was_reproduced_here(tmp_path: Path) -> None:
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    ws = Workspace(root=tmp_path, path=tmp_path, run_id="r", params=None)
    assert ws.upstream_reproduced("a")  # nothing upstream
    assert not ws.upstream_reproduced("b")  # a not reproduced here: DVC checks it
    ws.reproduced.append("a")
    assert ws.upstream_reproduced("b") and not ws.upstream_reproduced("c")
    ws.reproduced.append("b")
    assert ws.upstream_reproduced("c")
    resumed = Workspace(root=tmp_path, path=tmp_path, run_id="r", params=None, reproduced=["b"])
    assert not resumed.upstream_reproduced("c")  # a was done by an earlier process: checked again
    assert not ws.upstream_reproduced("z")  # not declared: DVC says so itself
