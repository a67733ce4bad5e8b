"""The project's structure, computed statically from the code (tests/import_graph.py):

- no import cycle between the project's modules (lazy imports count: a cycle is a design knot even
  when it does not fail at import time);
- every import points down the layers: cli (flows/cli.py) -> flows -> tasks -> pfactory -> kernels;
- every task module stays a thin stage (its params, `run`, `main`): under 150 lines.
"""

from __future__ import annotations

from tests.import_graph import ROOT, cycles, imports_of, modules

LAYERS = ("kernels", "pfactory", "tasks", "flows", "cli")  # bottom to top


def layer(module: str) -> int:
    if module == "flows.cli":
        return LAYERS.index("cli")
    return LAYERS.index(module.split(".")[0])


def test_no_import_cycle() -> None:
    found = cycles()
    assert not found, "import cycles (each a set of modules importing each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
        for m in sorted(modules())
        for t in sorted(imports_of(m))
        if layer(t) > layer(m)
    ]
    assert not upward, (
        "imports pointing up a layer (cli -> flows -> tasks -> pfactory -> kernels):\n" + "\n".join(upward)
    )


def test_task_modules_stay_thin() -> None:
    long = {
        p.name: n
        for p in sorted((ROOT / "tasks").glob("*.py"))
        if (n := len(p.read_text().splitlines())) >= 150
    }
    assert not long, f"tasks/*.py over 150 lines (move the work into pfactory/): {long}"


def test_the_graph_sees_imports() -> None:
    """The checks above are only as good as the graph: it must see module-level, lazy and relative
    imports, and the kernels' run-time (by name) imports."""
    assert "pfactory.params_file" in imports_of("tasks._stage")  # lazy, inside stage_main
    assert "pfactory.sensors.datasets" in imports_of("pfactory.data.prepare")  # module level
    assert "kernels._pillar_scatter_triton" in imports_of("kernels._dispatch")  # importlib by name
    assert "tasks.train" in imports_of("flows.cli")
