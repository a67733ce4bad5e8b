"""The project's import graph, computed statically (ast; nothing is imported or run).

A node is a module of the repository's own packages (`factory`, `flows`, `tasks`, `pfactory`, `kernels`) or one of its
benchmark scripts (`benchmarks/`, which import each other by bare name); an
edge `a -> b` is an `import` / `from ... import` in `a` of `b`, wherever it stands (module level,
inside a function, under TYPE_CHECKING): a lazy import still makes `b` part of what `a` may run.
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.

Used by tests/test_structure.py (no cycle, no import pointing up a layer) and tests/test_dvc.py
(each dvc.yaml stage's deps cover the import closure of its task module).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("factory", "flows", "tasks", "pfactory", "kernels")
# Folders of scripts (no package): a script imports its siblings by bare name (its folder is first on
# sys.path), so `import prepare_scaleout` in benchmarks/ is the node `benchmarks.prepare_scaleout`.
SCRIPT_DIRS = ("benchmarks",)
# Imports made by name at run time, which ast cannot see: module -> the modules it may import.
# `kernels._dispatch.triton_module(name)` imports `kernels.<name>`, the Triton kernels.
# The plugin registries load the built-in plugins by entry point (pyproject.toml's `pfactory.models` and
# `pfactory.datasets` groups): what a stage may run (its DVC deps, `closure`) includes them, but they are no
# import edge of the structure (a registry does not depend on its plugins; the plugins depend on the contract).


def _entry_point_modules(group: str) -> set[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    targets = doc.get("project", {}).get("entry-points", {}).get(group, {})
    return {t.partition(":")[0].strip() for t in targets.values()}


DYNAMIC = {
    "kernels._dispatch": lambda mods: {m for m in mods if m.startswith("kernels._") and m.endswith("_triton")},
}
PLUGIN_LOADS = {
    "pfactory.detectors.registry": "pfactory.models",
    "pfactory.sensors.datasets": "pfactory.datasets",
}


def plugin_loads(name: str) -> set[str]:
    """The built-in plugin modules that registry module `name` loads by entry point (none for others)."""
    group = PLUGIN_LOADS.get(name)
    return _entry_point_modules(group) & set(modules()) if group else set()


@cache
def modules() -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file (`pkg/__init__.py` for a package)."""
    out: dict[str, Path] = {}
    for pkg in (*PACKAGES, *SCRIPT_DIRS):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


@cache
def imports_of(name: str) -> frozenset[str]:
    """The project modules that module `name` imports (edges out of it)."""
    mods = modules()
    path = mods[name]
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, is_package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        scripts = name.split(".")[0] if name.split(".")[0] in SCRIPT_DIRS else None
        for target in targets:
            if scripts and f"{scripts}.{target.split('.')[0]}" in mods:  # a sibling script, by bare name
                target = f"{scripts}.{target}"
            # `import a.b.c` names a.b.c; a name outside the project (numpy, torch, ...) is no node
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    if name in DYNAMIC:
        found |= DYNAMIC[name](mods)
    return frozenset(found)


def parents(name: str) -> list[str]:
    """The packages Python initialises before `name` (`a.b.c` -> `a`, `a.b`), those of the project."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules()]


def closure(start: str) -> set[str]:
    """Every project module importing `start` may execute: its imports, theirs, and the `__init__` of
    each package on the way (importing `a.b` runs `a/__init__.py` first)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imports_of(name))
        todo.extend(plugin_loads(name))
        todo.extend(parents(name))
    return seen


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in imports_of(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return out


def path_to(start: str, goal: str) -> list[str]:
    """One chain of imports (and package inits) from `start` to `goal`, for error messages; [] if none."""
    prev: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        name = todo.pop(0)
        if name == goal:
            chain = [name]
            while prev[chain[-1]] is not None:
                chain.append(prev[chain[-1]])  # type: ignore[arg-type]
            return chain[::-1]
        for nxt in sorted(imports_of(name) | set(parents(name))):
            if nxt not in prev:
                prev[nxt] = name
                todo.append(nxt)
    return []


# --- dvc.yaml code deps ----------------------------------------------------------------------------


# Non-Python sources a module builds and runs at run time: module -> repository-relative files.
RUNTIME_SOURCES = {"kernels.native": ("kernels/_native.c",)}


def stage_files(stage: str) -> set[str]:
    """Repository-relative files `python -m tasks.<stage>` may execute (the import closure, and the C
    sources its modules compile at run time)."""
    mods = modules()
    reach = closure(f"tasks.{stage}")
    files = {mods[m].relative_to(ROOT).as_posix() for m in reach}
    return files | {f for m in reach for f in RUNTIME_SOURCES.get(m, ())}


def minimal_cover(files: set[str]) -> list[str]:
    """`files` with each folder whose every .py file is among them written as the folder (fewer deps,
    same coverage: DVC hashes a folder dep as a whole)."""
    out = set(files)
    folders = sorted({str(Path(f).parent) for f in files if "/" in f}, key=lambda d: (-d.count("/"), d))
    for folder in folders:
        if folder in PACKAGES:  # a whole top-level package as one dep would hide what a stage uses
            continue
        every = {q.relative_to(ROOT).as_posix() for q in (ROOT / folder).rglob("*.py")}
        if every and every <= files:
            out = {f for f in out if not f.startswith(folder + "/")} | {folder}
    return sorted(out)


def covered(path: str, deps: list[str]) -> bool:
    """Whether a dep (a file, or a folder holding it) covers `path`."""
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


CODE_ROOTS = tuple(f"{p}/" for p in PACKAGES) + PACKAGES


def write_dvc_deps(dvc_yaml: Path = ROOT / "dvc.yaml") -> None:
    """Rewrite each stage's code deps in dvc.yaml as the minimal cover of its import closure, keeping
    its other deps (data, `${paths.*}`) and the comments: `python -m tests.import_graph`."""
    import yaml

    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    lines = dvc_yaml.read_text().splitlines()
    out: list[str] = []
    stage = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("  ") and not line.startswith("   ") and line.strip().endswith(":"):
            stage = line.strip()[:-1]
        out.append(line)
        if stage in stages and line.strip() == "deps:":
            indent = line[: len(line) - len(line.lstrip())] + "  "
            i += 1
            kept = []
            while i < len(lines) and lines[i].startswith(indent + "- "):
                dep = lines[i].strip()[2:]
                if not dep.startswith(CODE_ROOTS):
                    kept.append(lines[i])
                i += 1
            out.extend(kept)
            out.extend(f"{indent}- {d}" for d in minimal_cover(stage_files(stage)))
            continue
        i += 1
    dvc_yaml.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    write_dvc_deps()
