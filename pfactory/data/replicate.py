"""Large raw datasets made quickly from a few real frames, for benchmarks and memory tests.

`replicate_kitti(src, out, n)`: a KITTI layout with frames `000000..n-1`, frame i being
source frame `i % len(src)`: every part file is a *symlink* to the source file, so 2000 frames
cost 8000 symlinks and no copies. `replicate_nuscenes(src, out, n)`: a nuScenes layout whose
`samples/` is a symlink to the source's and whose tables hold n samples, sample i cloning
every record of source sample `i % len(src)` under new tokens (the sensor files are shared).

What stays realistic: every frame is decoded, cropped and written in full (the readers and
prepare cannot tell a symlink from a file); the page cache serves the repeated files, so the
*read* part is optimistic compared with a cold disk -- benchmarks say so when they report it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pfactory.sensors.datasets import open_dataset
from pfactory.sensors.kitti import KITTI_PARTS


def replicate_kitti(src: str | Path, out: str | Path, n: int) -> Path:
    """`n` KITTI frames under `out/training` symlinked round-robin to the frames of `src`."""
    ds = open_dataset(src)
    if ds.layout != "kitti":
        raise ValueError(f"{src}: expected a KITTI layout, got {ds.layout}")
    ids = ds.frame_ids()
    root = Path(out) / "training"
    for part, ext in KITTI_PARTS.items():
        (root / part).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            target = ds.part_path(part, ids[i % len(ids)]).resolve()
            link = root / part / f"{i:06d}{ext}"
            if not link.is_symlink():
                os.symlink(target, link)
    return Path(out)


def replicate_nuscenes(src: str | Path, out: str | Path, n: int, samples: list[str] | None = None) -> Path:
    """`n` nuScenes samples under `out`, cloned round-robin from `samples` (default: all) of `src`."""
    ds = open_dataset(src)
    if ds.layout != "nuscenes":
        raise ValueError(f"{src}: expected a nuScenes layout, got {ds.layout}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "samples").exists():
        os.symlink(Path(ds.root).resolve() / "samples", out / "samples")
    base = samples or ds.frame_ids()
    t = ds.tables
    rows: dict[str, list[dict]] = {
        "sensor": list(t["sensor"].values()),
        "category": list(t["category"].values()),
        "calibrated_sensor": list(t["calibrated_sensor"].values()),
    }
    for name in ("sample", "sample_data", "ego_pose", "sample_annotation", "instance"):
        rows[name] = []
    for i in range(n):
        src_tok = base[i % len(base)]
        tag = f"-r{i:06d}"
        s = dict(t["sample"][src_tok])
        s["token"] = src_tok + tag
        s["timestamp"] = int(s.get("timestamp", 0)) + i  # distinct, ordered by i
        rows["sample"].append(s)
        for sd in ds.sample_data(src_tok).values():
            ep = dict(t["ego_pose"][sd["ego_pose_token"]])
            ep["token"] = ep["token"] + tag
            rows["ego_pose"].append(ep)
            rec = dict(sd, token=sd["token"] + tag, sample_token=s["token"], ego_pose_token=ep["token"])
            rows["sample_data"].append(rec)
        for ann in ds.annotations(src_tok):
            inst = dict(t["instance"][ann["instance_token"]])
            inst["token"] = inst["token"] + tag
            rows["instance"].append(inst)
            rows["sample_annotation"].append(
                dict(ann, token=ann["token"] + tag, sample_token=s["token"], instance_token=inst["token"])
            )
    table_dir = out / ds.version
    table_dir.mkdir(parents=True, exist_ok=True)
    for name, recs in rows.items():
        (table_dir / f"{name}.json").write_text(json.dumps(recs))
    return out
