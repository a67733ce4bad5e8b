"""Random and adversarial KITTI scenes (label_2 and result lines) for the KITTI metric's tests.

`make_scenes(seed, frames)` -> `(gt, dt)`: `{frame_id: [line, ...]}` each, deterministic for a seed. What
they exercise: every difficulty edge (2D heights 24.9 / 25 / 25.1 / 39.9 / 40 / 40.1 px, truncation and
occlusion at and past each limit), the neighbouring classes (Van, Person_sitting) and other types (Truck,
Misc), DontCare regions with false positives inside them, score ties (scores on a 0.05 grid), duplicates,
detections of a neighbouring or wrong class, small detections of any class, flipped headings (AOS), frames
without ground truth, frames without detections, and empty frames. Numbers are written with `repr`
(shortest round trip), so any reader gets the same doubles.

The golden fixture (`kitti_golden.json`) holds the Python reference evaluator's numbers on these scenes;
how it was made: docs/KPIS.md ("KITTI metric: how the reference was established").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DIMS_HWL = {
    "Car": (1.5, 1.6, 3.9), "Van": (2.2, 1.9, 5.0), "Truck": (3.2, 2.5, 10.0),
    "Pedestrian": (1.75, 0.6, 0.8), "Person_sitting": (1.2, 0.6, 0.9), "Cyclist": (1.7, 0.6, 1.8),
    "Misc": (1.5, 1.2, 2.0),
}  # fmt: skip
GT_TYPES = (
    "Car",
    "Car",
    "Car",
    "Van",
    "Truck",
    "Pedestrian",
    "Pedestrian",
    "Person_sitting",
    "Cyclist",
    "Cyclist",
    "Misc",
    "DontCare",
)
HEIGHTS = (15.0, 24.9, 25.0, 25.1, 30.0, 39.9, 40.0, 40.1, 55.0, 90.0)
TRUNCS = (0.0, 0.0, 0.1, 0.15, 0.16, 0.3, 0.31, 0.5, 0.51, 0.9)
NEIGHBOURS = {"Car": "Van", "Van": "Car", "Pedestrian": "Person_sitting", "Person_sitting": "Pedestrian"}


def _fmt(v: float) -> str:
    return repr(float(v))


def _line(name: str, trunc: float, occ: int, alpha: float, bbox, hwl, loc, ry: float, score=None) -> str:
    cols = [
        name,
        _fmt(trunc),
        str(int(occ)),
        _fmt(alpha),
        *map(_fmt, bbox),
        *map(_fmt, hwl),
        *map(_fmt, loc),
        _fmt(ry),
    ]
    if score is not None:
        cols.append(_fmt(score))
    return " ".join(cols)


def _wrap(a: float) -> float:
    return float((a + np.pi) % (2 * np.pi) - np.pi)


def make_scenes(
    seed: int, frames: int, max_gt: int = 9, alpha: bool = True, drop: tuple[str, ...] = ()
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """`frames` frames of ground-truth and result lines (module docstring), ids `000000`, `000001`, ...
    `alpha=False`: every detection's alpha is -10 (no AOS); `drop`: ground-truth types left out."""
    rng = np.random.default_rng(seed)
    gt: dict[str, list[str]] = {}
    dt: dict[str, list[str]] = {}
    for f in range(frames):
        fid = f"{f:06d}"
        kind = rng.random()
        n_gt = 0 if kind < 0.08 else int(rng.integers(1, max_gt + 1))
        g_lines, d_lines = [], []
        objs = []
        for _ in range(n_gt):
            t = str(rng.choice(GT_TYPES))
            x1, y1 = float(rng.uniform(0, 1100)), float(rng.uniform(80, 250))
            h = float(rng.choice(HEIGHTS)) if rng.random() < 0.7 else float(rng.uniform(10, 120))
            bbox = [round(x1, 2), round(y1, 2), round(x1 + h * rng.uniform(0.5, 2.5), 2), round(y1 + h, 2)]
            bbox[3] = bbox[1] + h  # the exact height (edge values must survive)
            if t == "DontCare":
                g_lines.append(_line("DontCare", -1, -1, -10, bbox, (-1, -1, -1), (-1000, -1000, -1000), -10))
                objs.append((t, bbox, None, None, None))
                continue
            hwl = np.array(DIMS_HWL[t]) * rng.uniform(0.85, 1.15, 3)
            loc = np.array([rng.uniform(-12, 12), rng.uniform(1.2, 2.0), rng.uniform(4, 45)])
            ry = float(rng.uniform(-np.pi, np.pi))
            alpha = _wrap(ry - np.arctan2(loc[0], loc[2]))
            g_lines.append(
                _line(t, float(rng.choice(TRUNCS)), int(rng.integers(0, 4)), alpha, bbox, hwl, loc, ry)
            )
            objs.append((t, bbox, hwl, loc, ry))
        if kind < 0.16:  # no detections (and every 2nd of those frames with no ground truth: empty)
            gt[fid], dt[fid] = g_lines, []
            continue
        for t, bbox, hwl, loc, ry in objs:
            if t == "DontCare":
                if rng.random() < 0.7:  # a false positive inside the region (2D) and one around it
                    w, h = bbox[2] - bbox[0], bbox[3] - bbox[1]
                    inner = [bbox[0] + 0.05 * w, bbox[1] + 0.05 * h, bbox[2] - 0.1 * w, bbox[3]]
                    cls = str(rng.choice(("Car", "Pedestrian", "Cyclist")))
                    d_lines.append(
                        _det(
                            rng,
                            cls,
                            inner,
                            np.array(DIMS_HWL[cls]),
                            np.array([rng.uniform(-10, 10), 1.6, rng.uniform(5, 40)]),
                            0.0,
                        )
                    )
                continue
            for _ in range(int(rng.choice((0, 1, 1, 1, 2)))):  # missed, found, duplicated
                r = rng.random()
                cls = (
                    t
                    if r < 0.75
                    else NEIGHBOURS.get(t, "Car")
                    if r < 0.88
                    else str(rng.choice(("Car", "Pedestrian", "Cyclist")))
                )
                if cls not in ("Car", "Pedestrian", "Cyclist") and rng.random() < 0.5:
                    cls = t
                jitter = float(rng.choice((0.0, 0.05, 0.15, 0.3, 0.6)))
                b = np.array(bbox) + rng.normal(0, jitter * 8, 4)
                # Never the very same BEV box: the Python port's float32 rotated IoU gives 1/3, not 1, for two
                # identical rectangles (docs/KPIS.md); the 2D box may be identical (jitter 0).
                dloc = loc + rng.normal(0, jitter + 0.02, 3) * np.array([1.0, 0.3, 1.0])
                dhwl = hwl * (1 + rng.normal(0, jitter / 3, 3)).clip(0.5, 1.5)
                dry = ry + (np.pi if rng.random() < 0.1 else 0.0) + rng.normal(0, jitter / 2)
                d_lines.append(_det(rng, cls, b, dhwl, dloc, _wrap(dry)))
        for _ in range(int(rng.integers(0, 4))):  # background false positives, some small
            cls = str(rng.choice(("Car", "Pedestrian", "Cyclist", "Van", "Truck")))
            x1, y1, h = (
                rng.uniform(0, 1100),
                rng.uniform(80, 250),
                float(rng.choice((12.0, 24.0, 30.0, 60.0))),
            )
            b = [x1, y1, x1 + h, y1 + h]
            d_lines.append(
                _det(
                    rng,
                    cls,
                    b,
                    np.array(DIMS_HWL[cls]),
                    np.array([rng.uniform(-12, 12), 1.6, rng.uniform(4, 45)]),
                    rng.uniform(-np.pi, np.pi),
                )
            )
        order = rng.permutation(len(d_lines))
        gt[fid], dt[fid] = g_lines, [d_lines[i] for i in order]
    if drop:
        gt = {f: [x for x in lines if x.split(" ", 1)[0] not in drop] for f, lines in gt.items()}
    if not alpha:
        dt = {
            f: [" ".join([*x.split(" ")[:3], "-10", *x.split(" ")[4:]]) for x in lines]
            for f, lines in dt.items()
        }
    return gt, dt


def _det(rng: np.random.Generator, cls: str, bbox, hwl, loc, ry: float) -> str:
    score = float(np.round(rng.uniform(0.05, 1.0) / 0.05) * 0.05)  # a 0.05 grid: many ties
    alpha = _wrap(ry - np.arctan2(loc[0], loc[2]))
    return _line(cls, 0.0, 0, alpha, bbox, hwl, loc, ry, round(score, 2))


def write_scenes(root: Path, gt: dict[str, list[str]], dt: dict[str, list[str]]) -> tuple[Path, Path]:
    """`root/label_2/<id>.txt` and `root/results/<id>.txt` (a file per frame, empty when no lines)."""
    out = []
    for name, frames in (("label_2", gt), ("results", dt)):
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        for fid, lines in frames.items():
            (d / f"{fid}.txt").write_text("".join(line + "\n" for line in lines))
        out.append(d)
    return out[0], out[1]
