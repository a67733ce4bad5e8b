"""The run report: one self-contained HTML page that shows where and why the detector fails.

In:  `ReportInputs` (pfactory.report.inputs). The KPIs are recomputed from the stored ground truth and
     detections (`evaluate_detections`, so the page also shows the error label of every box) and checked
     against kpis.json.
Out: `build_report(inputs) -> Report` (`.html`, the drawn worst frames `.worst`), `write_report`.
Sections: headline KPIs with their deltas against the baseline (champion) and the PyTorch reference;
per-class x per-range tables; the error breakdown as charts and a table; PR curves; the worst frames
(camera image with projected ground truth and detections beside the BEV with points, error labels drawn);
score calibration; the optimize stage's parity and latency summary. Charts are inline SVG, images PNG
data URIs, the style sheet inline; no script, no font, nothing fetched: the file opens offline.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.metrics.detection import DetectionKpis, evaluate_detections, kpi_params_from_json
from pfactory.metrics.errors import DAP_KEYS, ERROR_TYPES, LABELS
from pfactory.report import svg
from pfactory.report.frames import LABEL_COLORS, read_frame_views, render_worst_frame
from pfactory.report.inputs import ReportInputs

CLASS_LINE_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
TH_COLORS = ("#9ecae1", "#4292c6", "#08519c", "#08306b")  # PR curves: 0.5, 1, 2, 4 m, light to dark
CALIBRATION_BINS = 10
PARITY_HEAD = [
    "artifact",
    "verdict",
    "match rate",
    "boxes max |Δ|",
    "scores max |Δ|",
    "yaw max |Δ|",
    "failures",
]
FLIP_COLOR = "#98df8a"  # light green: a tp whose heading points the other way


@dataclass
class Report:
    """A built report: the page and the worst-frame panels it embeds (`{frame_id: {panel: png}}`)."""

    html: str
    worst: dict[str, dict[str, bytes]]


def _f(v: Any, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def _delta(v: float | None, higher_is_better: bool = True, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return '<span class="d">–</span>'
    if abs(v) < 0.5 * 10**-digits:  # rounds to zero: no colour, and no "-0.000"
        return f'<span class="d">{0.0:+.{digits}f}</span>'
    good = v > 0 if higher_is_better else v < 0
    return f'<span class="d {"up" if good else "down"}">{v:+.{digits}f}</span>'


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    h = "".join(f"<th>{c}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>'


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def _headline(m: dict[str, Any], inputs: ReportInputs) -> str:
    base = inputs.baseline.kpis if inputs.baseline else None
    ref = inputs.kpis.get("delta")  # optimized - PyTorch reference

    def tp_mean(block: dict[str, Any], k: str) -> float | None:
        vals = [c.get(k) for c in block["classes"].values() if isinstance(c.get(k), int | float)]
        return float(np.nanmean(vals)) if vals else None

    cards = [("mAP", m["mAP"], base and base.get("mAP"), ref and ref.get("mAP"), True)]
    cards.append(("NDS*", m["NDS"], base and base.get("NDS"), ref and ref.get("NDS"), True))
    for name, c in m["classes"].items():
        bc = base["classes"].get(name) if base else None
        rc = ref["classes"].get(name) if ref else None
        cards.append(
            (f"{name} mean AP", c["mean_ap"], bc and bc.get("mean_ap"), rc and rc.get("mean_ap"), True)
        )
    for k in ("ate", "ase", "aoe"):
        rvals = [c.get(k) for c in ref["classes"].values()] if ref else []
        rv = float(np.mean(rvals)) if rvals and all(isinstance(v, int | float) for v in rvals) else None
        cards.append((f"m{k.upper()}", m["tp_errors"][k], base and tp_mean(base, k), rv, False))
    out = []
    for title, v, b, r, hib in cards:
        vs_b = _delta(v - b if b is not None else None, hib)
        vs_r = _delta(r, hib)
        out.append(
            f'<div class="card"><div class="k">{escape(title)}</div><div class="v">{_f(v)}</div>'
            f'<div class="vs">vs baseline {vs_b}</div><div class="vs">vs PyTorch {vs_r}</div></div>'
        )
    label = escape(inputs.baseline.label) if inputs.baseline else f"none ({escape(inputs.no_baseline)})"
    note = (
        f'<p class="note">{escape(inputs.baseline.note)}</p>'
        if inputs.baseline and inputs.baseline.note
        else ""
    )
    return (
        f'<section id="headline"><h2>Headline KPIs</h2><p>Baseline: <b id="baseline">{label}</b>. '
        "vs PyTorch: the optimized artifact minus its PyTorch checkpoint on the same frames (the parity "
        "gate's KPI half). Higher is better for AP and NDS*, lower for the TP errors.</p>"
        f'{note}<div class="cards">{"".join(out)}</div></section>'
    )


def _range_tables(m: dict[str, Any]) -> str:
    buckets = [("all", m), *m.get("by_range", {}).items()]
    head = ["class", *[f"{k} m" if k != "all" else "all ranges" for k, _ in buckets]]
    rows = []
    for name in m["classes"]:
        row = [escape(name)]
        for _, blk in buckets:
            c = blk["classes"][name]
            row.append(
                f"<b>{_f(c['mean_ap'])}</b><br><small>AP@2m {_f(c['ap']['2.0'])} · {c['num_gt']} GT</small>"
            )
        rows.append(row)
    rows.append(
        [
            "<b>mAP</b> / NDS*",
            *[f"<b>{_f(b['mAP'])}</b><br><small>NDS* {_f(b['NDS'])}</small>" for _, b in buckets],
        ]
    )
    ap = _table(head, rows, "grid")
    rows = []
    for name in m["classes"]:
        row = [escape(name)]
        for _, blk in buckets:
            c = blk["classes"][name]
            row.append(f"{_f(c['ate'], 2)} / {_f(c['ase'], 2)} / {_f(c['aoe'], 2)}")
        rows.append(row)
    tp = _table(head, rows, "grid")
    return (
        '<section id="ranges"><h2>Per class × range</h2>'
        "<p>Mean AP over the 0.5/1/2/4 m thresholds (AP at 2 m below it). Ranges are BEV distances from "
        "the sensor; ground truth and detections are both cut to the bucket.</p>"
        f"{ap}<h3>TP errors: ATE (m) / ASE (1 − IoU) / AOE (rad)</h3>{tp}</section>"
    )


def _errors_section(m: dict[str, Any]) -> str:
    params = m["params"]
    # Detection bars: tp split into heading right / flipped (a flip is a tp for AP but costs AOE), then errors.
    seg = [("tp", LABEL_COLORS["tp"]), ("tp, heading flipped", FLIP_COLOR)]
    seg += [(lbl, LABEL_COLORS[lbl]) for lbl in ERROR_TYPES]

    def det_values(e: dict[str, Any]) -> list[float]:
        return [e["tp"] - e["heading_flip"], e["heading_flip"], *[e[lbl] for lbl in ERROR_TYPES]]

    errs = m["errors"]
    det_rows = [(name, det_values(e)) for name, e in errs.items()]
    charts = [svg.stacked_bars(det_rows, seg, "Detections by label (all ranges)")]
    gt_rows = [(name, [e["tp"], e["missed"]]) for name, e in errs.items()]
    charts.append(svg.stacked_bars(gt_rows, [("found (tp)", LABEL_COLORS["tp"]), ("missed", LABEL_COLORS["missed"])],
                                   "Ground truth: found vs missed"))  # fmt: skip
    groups = [(k, LABEL_COLORS[k]) for k in DAP_KEYS]
    charts.append(svg.grouped_bars([(n, [e["dap"][k] for k in DAP_KEYS]) for n, e in errs.items()], groups,
                                   "AP@2m gain if each error type were fixed (dAP, TIDE oracle)"))  # fmt: skip
    small = []
    for bucket, blk in m.get("by_range", {}).items():
        rows = [(name, det_values(e)) for name, e in blk["errors"].items()]
        small.append(svg.stacked_bars(rows, seg, f"Detections by label, {bucket} m", width=420))
    head = ["class", "range", *LABELS, "missed", "heading flip", "AP@2m", *[f"dAP {k}" for k in DAP_KEYS]]
    rows = []
    for bucket, blk in [("all", m), *m.get("by_range", {}).items()]:
        for name, e in blk["errors"].items():
            rows.append(
                [escape(name), escape(bucket), *[str(e[lbl]) for lbl in LABELS], str(e["missed"]), str(e["heading_flip"]),
                 _f(e["ap"]), *[f"{e['dap'][k]:+.3f}" for k in DAP_KEYS]]
            )  # fmt: skip
    table = _table(head, rows, "grid small errors")
    return (
        '<section id="errors"><h2>Error breakdown</h2>'
        f"<p>Detections scoring ≥ {params.get('frame_score_threshold', params.get('score_threshold'))} get the first label that applies, matched per frame "
        f"greedily by score with BEV centre distance d: <b>tp</b> (same class, d ≤ {params['dist_th_tp_m']:g} m to an "
        "unmatched GT), <b>duplicate</b> (same class, d ≤ d_fg to a matched GT), <b>classification</b> (d ≤ d_fg to "
        f"another class), <b>localization</b> (same class, d ≤ {params.get('error_bg_dist_m', 4.0):g} m), <b>both</b> "
        "(another class within d_bg only), <b>background</b> (nothing within d_bg). GT not matched are <b>missed</b>; "
        "a <b>heading flip</b> is a tp pointing more than 90° away. dAP: the AP@2m of these detections after fixing "
        "every error of one type (TIDE's oracle) minus their AP as they are.</p>"
        f'<div class="charts">{"".join(charts)}</div><div class="charts">{"".join(small)}</div>{table}</section>'
    )


def _kitti_section(doc: dict[str, Any]) -> str:
    """KITTI's official metric (kpis.json `kitti`: AP R40, strict overlaps; R11 and loose beside it), when the
    data is KITTI; empty otherwise."""
    if not doc.get("kitti"):
        return ""
    from pfactory.metrics.kitti_eval import DIFFICULTIES, TABLE_METRICS

    def pct(v: Any) -> str:
        return "–" if v is None else f"{100 * float(v):.2f}"

    blocks = []
    for key, title in (("kitti", "AP R40, strict overlaps (the benchmark's headline)"), ("kitti_R11", "AP R11, strict"),
                       ("kitti_loose", "AP R40, loose overlaps (bev/3d 0.5 / 0.25 / 0.25)")):  # fmt: skip
        rows = [
            [escape(c), m, *(pct(by_m[m][d]) for d in DIFFICULTIES)]
            for c, by_m in (doc.get(key) or {}).items()
            for m in TABLE_METRICS
        ]
        if rows:
            blocks.append(f"<h3>{title}</h3>" + _table(["class", "metric", *DIFFICULTIES], rows, "kitti"))
    info = doc.get("kitti_info") or {}
    res = info.get("results") or {}
    note = (
        f"<p>KITTI's official metric (docs/KPIS.md) in %, scored from <code>{escape(str(doc.get('kitti_results', '')))}/</code> "
        f"against the dataset's label_2: {res.get('written', '?')} detections written, "
        f"{res.get('outside_view', '?')} outside the camera's view left out.</p>"
    )
    return '<section id="kitti"><h2>KITTI benchmark</h2>' + note + "".join(blocks) + "</section>"


def _pr_section(kpis: DetectionKpis) -> str:
    charts = []
    aps = kpis.metrics["classes"]
    for name, by_th in kpis.curves.items():
        series = [
            (
                f"{th:g} m: AP {aps[name]['ap'][str(float(th))]:.3f}",
                c.recall,
                c.precision,
                TH_COLORS[i % len(TH_COLORS)],
            )
            for i, (th, c) in enumerate(sorted(by_th.items()))
        ]
        charts.append(svg.line_chart(series, f"{name} precision–recall", "recall", "precision"))
    return (
        '<section id="pr"><h2>Precision–recall</h2><p>101-point curves of the devkit, one per distance '
        f'threshold; all detections.</p><div class="charts">{"".join(charts)}</div></section>'
    )


def calibration(kpis_all: DetectionKpis, classes: list[str], bins: int = CALIBRATION_BINS) -> dict[str, Any]:
    """Reliability per score bin from a breakdown at score threshold 0 (`tp` = a match at d_fg):
    `{name: {"bins": [{"lo", "hi", "n", "score", "precision"}], "ece"}}` for every class and "all"."""
    e = kpis_all.errors
    assert e is not None
    score = np.clip(e.pred_score, 0.0, 1.0)
    tp = e.label == LABELS.index("tp")
    which = np.minimum((score * bins).astype(np.int64), bins - 1)
    out: dict[str, Any] = {}
    for name, mask in [("all", np.ones(len(score), bool))] + [
        (c, e.pred_class == i) for i, c in enumerate(classes)
    ]:
        rows, ece, n_all = [], 0.0, int(mask.sum())
        for b in range(bins):
            sel = mask & (which == b)
            n = int(sel.sum())
            s = float(score[sel].mean()) if n else None
            p = float(tp[sel].mean()) if n else None
            rows.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n, "score": s, "precision": p})
            if n:
                ece += n / n_all * abs(p - s)
        out[name] = {"bins": rows, "ece": ece if n_all else None, "n": n_all}
    return out


def _calibration_section(cal: dict[str, Any]) -> str:
    series = []
    for i, (name, c) in enumerate(cal.items()):
        pts = [(r["score"], r["precision"]) for r in c["bins"] if r["n"]]
        color = "#222" if name == "all" else CLASS_LINE_COLORS[(i - 1) % len(CLASS_LINE_COLORS)]
        series.append((f"{name} (ECE {_f(c['ece'])})", [p[0] for p in pts], [p[1] for p in pts], color))
    allb = cal["all"]["bins"]
    top = max([r["n"] for r in allb] + [1])
    bars = [(r["lo"], r["hi"], 0.35 * r["n"] / top) for r in allb]
    chart = svg.line_chart(series, "Score calibration", "detection score (bin mean)",
                           "fraction tp at 2 m", width=420, height=320, diagonal=True, points=True, bars=bars)  # fmt: skip
    rows = [[f"{r['lo']:.1f}–{r['hi']:.1f}", str(r["n"]), _f(r["score"]), _f(r["precision"])] for r in allb]
    table = _table(["score bin", "detections", "mean score", "fraction tp"], rows, "grid small")
    return (
        '<section id="calibration"><h2>Score calibration</h2><p>Every detection, binned by score: the fraction '
        "that is a tp at 2 m against the mean score of the bin (a calibrated detector lies on the dashed line; "
        "the grey bars are how many detections each bin holds). ECE = Σ (n_bin / n) · |fraction tp − mean score|.</p>"
        f'<div class="charts">{chart}{table}</div></section>'
    )


def _figure(frame_id: str, panel: str, png: bytes) -> str:
    return (
        f'<figure><img alt="{escape(frame_id)} {escape(panel)}" src="{_data_uri(png)}">'
        f"<figcaption>{escape(panel)}</figcaption></figure>"
    )


def _worst_section(worst: list[dict[str, Any]], panels: dict[str, dict[str, bytes]], thr: float) -> str:
    legend = "".join(
        f'<span class="sw" style="background:{c}"></span>{escape(k)} ' for k, c in LABEL_COLORS.items()
    )
    cards = []
    for rank, w in enumerate(worst):
        fid = w["frame_id"]
        counts = ", ".join(f"{w[k]} {k}" for k in (*ERROR_TYPES, "missed", "heading_flip") if w[k])
        imgs = panels.get(fid, {})
        cams = [p for p in imgs if p != "bev"]

        body = (
            f'<div class="cams">{"".join(_figure(fid, p, imgs[p]) for p in cams)}</div>' if cams else ""
        ) + (_figure(fid, "bev", imgs["bev"]) if "bev" in imgs else "")
        if not body:
            body = '<p class="note">not drawn: no prepared data for this frame (see the notes above)</p>'
        cards.append(
            f'<div class="frame" id="frame-{escape(fid)}"><h3>#{rank + 1} frame {escape(fid)}: {w["errors"]} errors '
            f'<small>({escape(counts)}; {w["tp"]} tp)</small></h3><div class="panels">{body}</div></div>'
        )
    intro = (
        f"<p>The frames with the most errors (non-tp detections scoring ≥ {thr} plus missed GT), most first. "
        "Ground truth solid white (missed: magenta, thick); detections dashed, coloured by their label; "
        "every error and heading flip tagged with its label, class and score (a clean tp is the green dashed box "
        f'on its ground truth).</p><p class="legend">{legend}</p>'
    )
    if not worst:
        intro = "<p>No frame has an error at this threshold.</p>"
    return f'<section id="worst"><h2>Worst frames</h2>{intro}{"".join(cards)}</section>'


def _vs_tol(m: dict[str, Any]) -> str:
    """`max |diff|` of a parity metric, and its ratio to the tolerance when parity.json has one."""
    v, r = m.get("max_abs_diff"), m.get("tolerance_ratio")
    if not isinstance(v, int | float):
        return "–"
    return f"{v:.2e}" + (f" ({r:.2f}× tol)" if isinstance(r, int | float) else "")


def _optimize_section(inputs: ReportInputs) -> str:
    parts = []
    if inputs.parity:
        rows = []
        rates = []  # each rate gate's verdict with its support (k/n, Wilson bound or "too few to judge")
        refused = inputs.parity.get("refused") or {}  # failed parity, not shipped (optimize's fallback)
        for art, a in sorted({**(inputs.parity.get("artifacts") or {}), **refused}.items()):
            mt = a.get("metrics", {}) if isinstance(a, dict) else {}
            b, s, y = mt.get("boxes") or {}, mt.get("scores") or {}, mt.get("yaw") or {}
            ok = a.get("passed") if isinstance(a, dict) else None
            bad = '<b class="bad">REFUSED, not shipped</b>' if art in refused else '<b class="bad">FAILED</b>'
            rows.append(
                [escape(art), '<b class="ok">passed</b>' if ok else bad, _f(mt.get("match_rate")),
                 _vs_tol(b), _vs_tol(s), _vs_tol(y), escape("; ".join(a.get("failures") or []) or "–")]
            )  # fmt: skip
            rates += [f"{art}: {r['text']}" for r in (a.get("rates") or []) if isinstance(r, dict)]
        verdict = "passed" if inputs.parity.get("passed") else "FAILED"
        notes = ""
        if inputs.parity.get("rate_rule"):
            rule = escape(inputs.parity["rate_rule"])
            notes += f'<p class="note">Rates: {rule}. {escape("; ".join(rates))}</p>'
        if inputs.parity.get("fallback"):
            notes += f'<p class="note"><b>Fallback</b>: {escape(inputs.parity["fallback"]["why"])}.</p>'
        parts.append(
            f"<h3>Parity vs PyTorch: {verdict}</h3>"
            + _table(PARITY_HEAD, rows, "grid small") + notes
        )  # fmt: skip
    if inputs.latency:
        rows = []
        speed = inputs.latency.get("speedup_vs_eager") or {}
        for key in sorted(k for k in inputs.latency if k.startswith("batch_")):
            for runner, st in sorted(inputs.latency[key].items()):
                sp = (speed.get(key) or {}).get(runner)
                speedup = f"{sp:.2f}×" if isinstance(sp, int | float) else "–"
                rows.append([escape(key.removeprefix("batch_")), escape(runner), _f(st.get("p50_ms"), 1),
                             _f(st.get("p99_ms"), 1), _f(st.get("throughput_fps"), 1), speedup])  # fmt: skip
        cfg = inputs.latency.get("config") or {}
        ctx = ", ".join(
            f"{k} {cfg[k]}" for k in ("device", "threads", "iterations", "loadavg_1min_before") if k in cfg
        )
        parts.append(f"<h3>Latency <small>({escape(ctx)})</small></h3>"
                     + _table(["batch", "runner", "p50 ms", "p99 ms", "frames/s", "vs eager"], rows, "grid small"))  # fmt: skip
    artifact = (inputs.kpis.get("model") or {}).get("artifact")
    lead = f"<p>Evaluated artifact: <b>{escape(str(artifact))}</b>.</p>" if artifact else ""
    if not parts:
        parts.append('<p class="note">No optimize stage output found (parity.json, latency.json).</p>')
    return f'<section id="optimize"><h2>Optimize: parity and latency</h2>{lead}{"".join(parts)}</section>'


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d1d1f;background:#f6f7f9}
header{background:#14213d;color:#fff;padding:18px 28px}header h1{margin:0 0 6px;font-size:22px}
header table{color:#dfe6f3;font-size:12px;border-collapse:collapse}header td{padding:1px 12px 1px 0}
main{padding:8px 28px 40px;max-width:1500px}section{background:#fff;border-radius:8px;padding:6px 18px 16px;
margin:16px 0;box-shadow:0 1px 3px rgba(0,0,0,.08)}h2{font-size:18px;margin:12px 0 6px}h3{font-size:14px;margin:14px 0 6px}
p{font-size:13px;line-height:1.45;max-width:1100px}.note{color:#8a5300}.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #e2e5ea;border-radius:6px;padding:8px 12px;min-width:120px}.card .k{font-size:12px;color:#555}
.card .v{font-size:22px;font-weight:600}.vs{font-size:11px;color:#666}.d{font-weight:600;color:#666}.up{color:#137333}
.down{color:#b3261e}table.grid{border-collapse:collapse;font-size:13px;margin:6px 0}table.grid th,table.grid td{
border:1px solid #e2e5ea;padding:4px 8px;text-align:right}table.grid th{background:#f0f2f5}table.grid td:first-child,
table.grid th:first-child{text-align:left}table.small{font-size:11px}.charts{display:flex;flex-wrap:wrap;gap:18px;
align-items:flex-start;margin:8px 0}.frame{border-top:1px solid #e2e5ea;margin-top:10px}.panels{display:flex;
gap:10px;align-items:flex-start}.cams{flex:1.6 1 0;min-width:0;display:grid;gap:6px;
grid-template-columns:repeat(auto-fit,minmax(280px,1fr))}.panels>figure{flex:1 1 0;min-width:0}figure{margin:0}
figure img{width:100%;height:auto;display:block;border:1px solid #ddd}@media (max-width:900px){.panels{flex-wrap:wrap}
.panels>figure,.cams{flex-basis:100%}}figcaption{font-size:11px;color:#666}.sw{display:inline-block;width:12px;height:12px;
margin:0 4px 0 10px;vertical-align:-1px}.ok{color:#137333}.bad{color:#b3261e}ul.notes{font-size:13px;color:#8a5300}
footer{font-size:11px;color:#777;padding:0 28px 20px}
"""


def worst_frames(kpis: DetectionKpis, n: int) -> list[dict[str, Any]]:
    """The `n` frames with the most errors (non-tp detections + missed GT), most first, ties by frame id."""
    assert kpis.errors is not None
    rows = []
    for fid, c in zip(kpis.errors.frame_ids, kpis.errors.frame_counts()):
        err = sum(c[k] for k in ERROR_TYPES) + c["missed"]
        if err:
            rows.append({"frame_id": fid, "errors": err, **c})
    return sorted(rows, key=lambda r: (-r["errors"], r["frame_id"]))[:n]


def draw_worst(
    inputs: ReportInputs, kpis: DetectionKpis, worst: list[dict[str, Any]]
) -> dict[str, dict[str, bytes]]:
    """Camera + BEV panels of the worst frames from the prepared data, else the evaluate stage's drawings."""
    ids = [w["frame_id"] for w in worst]
    if inputs.prepared is None:
        return {f: inputs.prerendered[f] for f in ids if f in inputs.prerendered}
    assert kpis.errors is not None
    views = read_frame_views(inputs.prepared, (inputs.kpis.get("data") or {}).get("split", "val"), ids)
    gt = {f.frame_id: f for f in inputs.gt}
    pred = {f.frame_id: f for f in inputs.pred}
    out = {}
    for rank, fid in enumerate(ids):
        if fid in views:
            out[fid] = render_worst_frame(
                views[fid], gt[fid], pred[fid], kpis.errors.frame(fid), f"#{rank + 1} {fid}"
            )
    return out


def build_report(inputs: ReportInputs, worst_n: int = 6) -> Report:
    """The page (module docstring) and the worst-frame panels it embeds."""
    params = kpi_params_from_json(inputs.kpis["params"])
    kpis = evaluate_detections(inputs.gt, inputs.pred, params)
    m = kpis.metrics
    notes = list(inputs.notes)
    if abs(m["mAP"] - inputs.kpis["mAP"]) > 1e-9:
        notes.append(
            f"mAP recomputed from predictions.parquet is {m['mAP']:.6f}, kpis.json says {inputs.kpis['mAP']:.6f}: "
            "the table and kpis.json disagree (the page shows the recomputed numbers)"
        )
    all_dets = evaluate_detections(
        inputs.gt, inputs.pred, dataclasses.replace(params, frame_score_threshold=0.0, range_buckets_m=())
    )
    cal = calibration(all_dets, list(params.classes))
    worst = worst_frames(kpis, worst_n)
    panels = draw_worst(inputs, kpis, worst)

    data = inputs.kpis.get("data") or {}
    data_line = (
        f"{data.get('split', '?')} split, {data.get('frames', '?')} frames, {data.get('ground_truth_boxes', '?')} "
        f"GT boxes, hash {str(data.get('prepared_hash', '?'))[:16]}…"
    )
    prov = [*inputs.provenance, ("data", data_line)]
    prov_html = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in prov)
    notes_html = "".join(f"<li>{escape(n)}</li>" for n in notes)
    body = [
        _headline(m, inputs),
        _range_tables(m),
        _kitti_section(inputs.kpis),
        _errors_section(m),
        _pr_section(kpis),
        _worst_section(worst, panels, params.frame_score_threshold),
        _calibration_section(cal),
        _optimize_section(inputs),
    ]
    html = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Run report: {escape(inputs.name)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>Run report: {escape(inputs.name)}</h1><table>{prov_html}</table></header><main>"
        + (
            f'<section id="notes"><h2>Notes</h2><ul class="notes">{notes_html}</ul></section>'
            if notes
            else ""
        )
        + "".join(body)
        # No clock in the page: the same evaluation gives the same bytes (the stage's outputs are reproducible).
        + "</main><footer>perception-factory run report. Definitions: docs/KPIS.md (KPIs, error breakdown), "
        "docs/REPORT.md (this page).</footer>"
        "</body></html>\n"
    )
    return Report(html, panels)


def write_report(inputs: ReportInputs, out: Path, worst_n: int = 6) -> Report:
    """Build the report and write it to `out` atomically."""
    from pfactory.storage.fsutil import atomic_write_text

    report = build_report(inputs, worst_n)
    atomic_write_text(Path(out), report.html)
    return report
