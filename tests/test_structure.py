"""The project's structure, computed statically from the code (tests/import_graph.py):

- no import cycle between the project's modules (lazy imports count: a cycle is a design knot even
  when it does not fail at import time);
- every import points down the layers: benchmarks -> factory (the `factory` command) -> flows -> tasks -> pfactory ->
  kernels (the benchmark scripts are in the graph too, their imports of each other by bare name included);
- every task module stays a thin stage (its params, `run`, `main`): under 150 lines.
"""

from __future__ import annotations

from tests.import_graph import ROOT, cycles, imports_of, modules

LAYERS = ("kernels", "pfactory", "tasks", "flows", "factory", "benchmarks")  # bottom to top


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_no_import_cycle() -> None:
    found = cycles()
    assert not found, "import cycles (each a set of modules importing each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )



def test_no_two_pfactory_packages_import_each_other() -> None:
    """Between the domain library's packages too (`pfactory.evaluate` <-> `pfactory.report` once did): a
    pair importing each other is one design knot, or one of the two points up."""

    def package(m: str) -> str | None:
        parts = m.split(".")
        return ".".join(parts[:2]) if parts[0] == "pfactory" and len(parts) > 2 else None

    edges = {(package(m), package(t)) for m in modules() for t in imports_of(m)}
    edges = {(a, b) for a, b in edges if a and b and a != b}
    mutual = sorted({" <-> ".join(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not mutual, f"pfactory packages importing each other: {mutual}"

def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
        for m in sorted(modules())
        for t in sorted(imports_of(m))
        if layer(t) > layer(m)
    ]
    assert not upward, (
        "imports pointing up a layer (factory -> flows -> tasks -> pfactory -> kernels):\n" + "\n".join(upward)
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
    assert "pfactory.config.params_file" in imports_of("tasks._stage")  # lazy, inside run_stage
    assert "pfactory.sensors.datasets" in imports_of("pfactory.prepare.stage")  # module level
    assert "kernels._pillar_scatter_triton" in imports_of("kernels._dispatch")  # importlib by name
    assert "tasks.train" in imports_of("factory.stage_cli")
    assert "benchmarks.raw_datasets" in imports_of("benchmarks.prepare_scaleout")  # a sibling, by bare name
    assert "benchmarks.prepare_scaleout" in imports_of("benchmarks.bench_prepare")  # lazy, inside main


def test_every_test_of_every_tier_finds_its_fixtures() -> None:
    """`pytest --full --setup-plan`: the fixtures of every test, the full tier's included (CI runs only the
    default tier), resolve -- a test moved to another folder once lost the conftest fixture it needs
    (`fixture 'team_servers' not found`) and nothing ran it to notice."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--full", "--setup-plan", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR ") or "not found" in ln]
    assert r.returncode in (0, 5) and not errors, "\n".join(errors[:20]) or r.stdout[-3000:]
