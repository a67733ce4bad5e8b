"""The worst frames of an evaluation, drawn: the camera image with projected boxes, and the BEV with points.

In:  a prepared frame's points (reference frame) and camera images (read back from the prepared shards and
     de-normalized), its ground truth and detections (`FrameDetections`, reference frame) and the error
     labels of `ErrorLabels.frame`. Out: PNG bytes per panel (`render_worst_frame`).
Colours: ground truth solid white, a missed one magenta and thick; detections (those scoring >= the
breakdown's threshold) dashed in the colour of their label; errors and heading flips tagged `label class
score` (`cls Car→Pedestrian` names the class of the ground truth a classification error sits on).
matplotlib on an Agg canvas, no pyplot state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import FrameDetections

# One colour per label (and missed ground truth): also the legend and the charts of the page.
LABEL_COLORS = {
    "tp": "#2ca02c",
    "duplicate": "#ff7f0e",
    "classification": "#9467bd",
    "localization": "#e6c229",
    "both": "#8c564b",
    "background": "#d62728",
    "missed": "#ff00ff",
}
GT_COLOR = "#ffffff"  # ground truth: one neutral colour, so that every colour on the panel is an error label
SHORT = {"tp": "tp", "duplicate": "dup", "classification": "cls", "localization": "loc", "both": "both",
         "background": "bkg"}  # fmt: skip


@dataclass
class CameraImage:
    """One camera of a prepared frame, as the model saw it (resized, padding cropped off)."""

    name: str
    image: np.ndarray  # [H, W, 3] uint8 RGB
    K: np.ndarray  # [3, 3] intrinsics of this image
    T_cam_from_ref: np.ndarray  # [4, 4]


@dataclass
class FrameView:
    """What a worst-frame render needs from the prepared data."""

    frame_id: str
    points: np.ndarray  # [N, 4] float32, reference frame
    cameras: list[CameraImage]


def read_frame_views(prepared: Any, split: str, frame_ids: list[str]) -> dict[str, FrameView]:
    """Points and de-normalized camera images of `frame_ids` from a `PreparedDataset`'s `split`
    (only the row groups holding them are decoded)."""
    from pfactory.prepare.shards import open_shard, table_to_frames

    want, out = set(frame_ids), {}
    mean = np.asarray(prepared.manifest["image"]["mean"], dtype=np.float32)[:, None, None] * 255.0
    std = np.asarray(prepared.manifest["image"]["std"], dtype=np.float32)[:, None, None] * 255.0
    for path in prepared.shard_paths(split):
        pf = open_shard(path)
        for rg in range(pf.num_row_groups):
            ids = pf.read_row_group(rg, columns=["frame_id"]).column("frame_id").to_pylist()
            if not want.intersection(ids):
                continue
            for f in table_to_frames(pf.read_row_group(rg), prepared.image_shape):
                if f.frame_id not in want:
                    continue
                cams = []
                for c, name in enumerate(f.cam_names):
                    w, h = (int(v) for v in f.cam_resized_size[c])
                    chw = f.cam_image[c].astype(np.float32) * std + mean  # [3, H, W] 0..255
                    rgb = np.clip(np.rint(chw[:, :h, :w]), 0, 255).astype(np.uint8).transpose(1, 2, 0)
                    cams.append(CameraImage(name, np.ascontiguousarray(rgb), f.cam_K[c], f.cam_T[c]))
                out[f.frame_id] = FrameView(f.frame_id, np.asarray(f.points), cams)
    return out


def _drawn(
    gt: FrameDetections, pred: FrameDetections, labels: dict[str, Any]
) -> list[tuple[np.ndarray, str, Any, str | None, float]]:
    """(box [7], colour, line style, tag or None, line width): GT first, then the labelled detections."""
    missed = set(labels["missed"])
    flips = set(labels["heading_flip"])
    out: list[tuple[np.ndarray, str, Any, str | None, float]] = []
    for j, (b, n) in enumerate(zip(gt.boxes, gt.names)):
        if j in missed:
            out.append((b, LABEL_COLORS["missed"], "solid", f"missed {n}", 2.2))
        else:
            out.append((b, GT_COLOR, "solid", None, 1.0))
    for i, lbl in sorted(labels["pred"].items()):
        # Only what is wrong gets a tag (a clean tp is the green dashed box on its GT): dense scenes stay legible.
        tag = None
        if lbl != "tp" or i in flips:
            name = str(pred.names[i])
            t = labels.get("target", {}).get(i)
            if lbl in ("classification", "both") and t is not None:
                name += f"→{gt.names[t]}"  # what it is, by the ground truth it sits on
            tag = f"{SHORT[lbl]}{' flip' if i in flips else ''} {name} {pred.scores[i]:.2f}"
        out.append((pred.boxes[i], LABEL_COLORS[lbl], (0, (3, 2)), tag, 1.4))
    return out


def _png(fig: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 6})
    return buf.getvalue()


def render_camera(cam: CameraImage, drawn: list[tuple], title: str) -> bytes:
    """The camera image with every box's visible edges projected (near-clipped)."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    from pfactory.sensors.show import project_box_edges

    h, w = cam.image.shape[:2]
    width_in = 7.0
    fig = Figure(figsize=(width_in, width_in * h / w + 0.35), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(cam.image, extent=(0, w, h, 0), interpolation="bilinear")
    for box, color, style, tag, lw in drawn:
        segs = project_box_edges(box, cam.T_cam_from_ref, cam.K)
        if not segs:
            continue
        ax.add_collection(LineCollection(segs, colors=color, linewidths=lw, linestyles=style))
        if tag:
            top = np.concatenate(segs).min(0)
            if 0 <= top[0] < w and 0 <= top[1] < h:
                ax.text(top[0], max(top[1] - 2, 6), tag, color=color, fontsize=5.5, va="bottom",
                        bbox={"facecolor": "black", "alpha": 0.45, "pad": 0.6, "linewidth": 0})  # fmt: skip
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_axis_off()
    ax.set_title(title, fontsize=8)
    return _png(fig)


def render_bev(points: np.ndarray, drawn: list[tuple], gt: FrameDetections, title: str) -> bytes:
    """Bird's-eye view: points by height, the same boxes and tags as the camera panel."""
    from matplotlib.figure import Figure

    from pfactory.sensors.show import _draw_bev, bev_range

    window = bev_range(points, list(gt.boxes))  # framed on points and GT: an absurd box must not zoom out
    aspect = (window[4] - window[1]) / max(window[3] - window[0], 1e-6)
    fig = Figure(figsize=(5.2, min(5.2 * aspect, 6.5) + 0.4), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    # _draw_bev draws the points and thin outlines; thick outlines (missed GT) and the tags go on top, the
    # tags clipped to the window (a detection far outside it must not write into the margin).
    _draw_bev(ax, points, [(b, c, st, None) for b, c, st, _, _ in drawn], window, "height")
    from matplotlib.collections import LineCollection

    from pfactory.sensors.geometry import box_corners

    for box, color, _, tag, lw in drawn:
        corners = box_corners(box)[0][:4, :2]  # bottom face [4, 2]
        if lw > 2:
            ax.add_collection(LineCollection([corners[[0, 1, 2, 3, 0]]], colors=color, linewidths=lw))
        if tag:
            front = corners[[0, 3]].mean(0)
            ax.text(front[0], front[1], tag, color=color, fontsize=4.5, clip_on=True)
    ax.set_title(title, fontsize=8)
    return _png(fig)


def render_worst_frame(
    view: FrameView, gt: FrameDetections, pred: FrameDetections, labels: dict[str, Any], title: str
) -> dict[str, bytes]:
    """`{"<camera name>": png, ..., "bev": png}` of one frame (module docstring)."""
    drawn = _drawn(gt, pred, labels)
    out = {cam.name: render_camera(cam, drawn, f"{title} - {cam.name}") for cam in view.cameras}
    out["bev"] = render_bev(view.points, drawn, gt, f"{title} - BEV, {len(view.points)} points")
    return out


def write_pngs(folder: Path, worst: dict[str, dict[str, bytes]]) -> list[Path]:
    """`folder/NN_<frame_id>_<panel>.png` for each frame (in rank order) and panel, and `folder/index.json`
    (`[{"rank", "frame_id", "panels": {panel: file name}}]`: names alone are ambiguous, since frame ids and
    camera names may hold "_"). Atomic writes."""
    from pfactory.storage.fsutil import atomic_write_bytes, atomic_write_json

    written, index = [], []
    for rank, (frame_id, pngs) in enumerate(worst.items()):
        names = {panel: f"{rank:02d}_{frame_id}_{panel}.png" for panel in pngs}
        written += [atomic_write_bytes(folder / names[panel], b) for panel, b in pngs.items()]
        index.append({"rank": rank, "frame_id": frame_id, "panels": names})
    written.append(atomic_write_json(folder / "index.json", index))
    return written


def read_pngs(folder: Path) -> dict[str, dict[str, bytes]]:
    """What `write_pngs` wrote: `{frame_id: {panel: png}}` in rank order ({} without an index)."""
    import json

    if not (folder / "index.json").is_file():
        return {}
    out = {}
    for entry in sorted(json.loads((folder / "index.json").read_text()), key=lambda e: e["rank"]):
        panels = {k: folder / v for k, v in entry["panels"].items()}
        if all(p.is_file() for p in panels.values()):
            out[entry["frame_id"]] = {k: p.read_bytes() for k, p in panels.items()}
    return out
