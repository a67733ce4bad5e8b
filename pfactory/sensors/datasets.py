"""`open_dataset`: dataset layouts by name, from the entry-point group `pfactory.datasets` (DESIGN.md §5b).

Built-in layouts (`kitti`, `nuscenes`) are entry points of this project's own distribution (pyproject.toml),
installed plugins of theirs (examples/dataset-plugin/, docs/DATASETS.md); both are found the same way
(`pfactory.config.plugins`) and imported only when a root is offered to them. A root is offered to every reader
in a stable order -- built-ins first, then plugins by name -- and the first whose `detect` accepts it
reads it. A reader that fails to import (or is no `DatasetReader`) is skipped with its one-line reason,
which the "no layout matched" error lists; it never breaks the other layouts. `layout=` forces one.

In:  a dataset root (and optionally a layout name). Out: a `DatasetReader`; `DatasetError` naming what was
expected when no layout matches; `PluginError` (one line, exit 2) when a forced layout cannot be loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pfactory.config import plugins
from pfactory.sensors.errors import DatasetError
from pfactory.sensors.reader import DatasetReader


@dataclass(frozen=True)
class Layout:
    """One registered layout: its entry point, and its reader class or why it cannot be loaded."""

    info: plugins.PluginInfo
    reader: type[DatasetReader] | None
    error: str | None

    @property
    def name(self) -> str:
        return self.info.name


def _checked(obj: object, info: plugins.PluginInfo) -> type[DatasetReader]:
    """`obj` when it is a `DatasetReader` subclass whose `layout` is its entry point's name."""
    if not (isinstance(obj, type) and issubclass(obj, DatasetReader)):
        raise plugins.PluginError(
            f"{info.label} does not satisfy the reader contract: {obj!r} is not a subclass of "
            "pfactory.sensors.reader.DatasetReader"
        )
    if getattr(obj, "layout", None) != info.name:
        raise plugins.PluginError(
            f"{info.label} does not satisfy the reader contract: its class attribute `layout` is "
            f"{getattr(obj, 'layout', None)!r}, expected the entry point's name {info.name!r}"
        )
    return obj


def reader_class(layout: str) -> tuple[type[DatasetReader], plugins.PluginInfo]:
    """The reader class registered as `layout`, imported now; `PluginError` (one line) when it is not
    installed, fails to import or breaks the contract."""
    obj, info = plugins.load(plugins.DATASETS, layout)
    return _checked(obj, info), info


def layouts() -> list[Layout]:
    """Every registered layout in the order roots are offered to them: built-ins first, then plugins,
    each group by name. Each is imported; one that fails carries its one-line error instead."""
    found = plugins.entries(plugins.DATASETS)
    order = sorted(found.values(), key=lambda i: (not i.builtin, i.name))
    out = []
    for info in order:
        try:
            out.append(Layout(info, reader_class(info.name)[0], None))
        except plugins.PluginError as e:
            out.append(Layout(info, None, str(e)))
    return out


def expected_layouts(found: list[Layout] | None = None) -> str:
    """What a dataset root may hold: each loadable reader's `describe`, or-joined; then the plugins that
    could not be loaded, with their reasons (the "no layout matched" errors)."""
    found = layouts() if found is None else found
    kinds = " or ".join(x.reader.describe or f"a {x.name} layout" for x in found if x.reader is not None)
    broken = "; ".join(x.error for x in found if x.error)
    text = kinds or "a dataset layout (no reader is installed: entry-point group pfactory.datasets)"
    return f"{text} (skipped: {broken})" if broken else text


def listing() -> list[plugins.Row]:
    """Every registered layout in the order roots are offered to them, loaded to check it; a broken one is
    listed with its error (for a `factory datasets` command: name, `module:attr`, source, status)."""
    return [
        plugins.Row(x.name, x.info.target, x.info.source, x.error or "ok", x.reader.describe if x.reader else "")
        for x in layouts()
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m pfactory.sensors.datasets [NAME]`: the listing, one line a layout; with NAME, load that
    one: its description, or its one-line error on stderr with exit 2 (`PluginError`)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args:
        try:
            cls, info = reader_class(args[0])
        except plugins.PluginError as e:
            print(f"datasets: {e}", file=sys.stderr)
            return e.exit_code
        print(f"{info.name}\t{info.target}\t{info.source}\t{cls.describe}")
        return 0
    for r in listing():
        state = "" if r.status == "ok" else f"  BROKEN: {r.status}"
        print(f"{r.name}\t{r.target}\t{r.source}{state}")
    return 0


def open_dataset(root: str | Path, strict: bool = True, layout: str | None = None) -> DatasetReader:
    """Open a raw dataset directory, detecting its layout (module docstring) or forcing `layout`.

    KITTI object layout: `root/training/{velodyne,image_2,calib,label_2}` (or those folders directly
    under `root`). nuScenes layout: `root/samples/` plus a `v1.0-*` table folder. Installed plugins add
    theirs (`listing()`). Returns the reader; raises DatasetError naming what is missing, or PluginError
    when the forced `layout` cannot be loaded.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(root, "dataset root", "an existing directory")
    if layout is not None:
        cls, info = reader_class(layout)
        dataset = cls.detect(root)
        if dataset is None:
            raise DatasetError(root, "layout", cls.describe or f"a {info.name} layout (forced)")
        return dataset
    found = layouts()
    for x in found:
        if x.reader is None:
            continue
        dataset = x.reader.detect(root)
        if dataset is not None:
            return dataset
    raise DatasetError(root, "layout", expected_layouts(found))


if __name__ == "__main__":
    raise SystemExit(main())
