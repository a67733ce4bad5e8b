"""Large raw datasets made quickly from a few real frames, for benchmarks and memory tests.

`replicate(src, out, n)`: a dataset of `src`'s layout with `n` frames cloned round-robin from `src`'s, made by
the layout's reader (`DatasetReader.replicate`). KITTI: frames `000000..n-1`, every part file a *symlink* to
the source file, so 2000 frames cost 8000 symlinks and no copies. nuScenes: `samples/` a symlink to the
source's and tables holding n samples, sample i cloning every record of source sample `i % len(src)` under
new tokens (the sensor files are shared). `replicate_kitti` / `replicate_nuscenes` force the layout.

What stays realistic: every frame is decoded, cropped and written in full (the readers and
prepare cannot tell a symlink from a file); the page cache serves the repeated files, so the
*read* part is optimistic compared with a cold disk -- benchmarks say so when they report it.
"""

from __future__ import annotations

from pathlib import Path

from pfactory.sensors.datasets import open_dataset


def replicate(
    src: str | Path, out: str | Path, n: int, samples: list[str] | None = None, layout: str | None = None
) -> Path:
    """`n` frames under `out` cloned round-robin from `samples` (default: all) of the dataset `src`, in its
    layout (`layout` forces one: DatasetError when `src` does not hold it). Returns `out`."""
    ds = open_dataset(src, layout=layout)
    return ds.replicate(Path(out), n, samples)


def replicate_kitti(src: str | Path, out: str | Path, n: int) -> Path:
    """`n` KITTI frames under `out/training` symlinked round-robin to the frames of `src` (a KITTI layout)."""
    return replicate(src, out, n, layout="kitti")


def replicate_nuscenes(src: str | Path, out: str | Path, n: int, samples: list[str] | None = None) -> Path:
    """`n` nuScenes samples under `out`, cloned round-robin from `samples` (default: all) of `src`."""
    return replicate(src, out, n, samples, layout="nuscenes")
