"""Inline SVG charts for the run report: stacked and grouped horizontal bars, line charts.

In:  plain numbers and labels. Out: an `<svg>` element as a string (no external references, text as
real SVG `<text>` so a browser, a screen reader and a DOM test can read every value). Coordinates are
in CSS pixels; each chart has a `viewBox` and scales to its container's width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'
AXIS = "#555"
GRID = "#e3e3e3"


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'width="{width:.0f}" height="{height:.0f}" role="img" aria-label="{escape(label)}" {FONT} '
        f'font-size="12" class="chart">' + "".join(body) + "</svg>"
    )


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12, fill: str = "#222", **kw) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in kw.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="{fill}"{extra}>'
        f"{escape(s)}</text>"
    )


def legend(items: Sequence[tuple[str, str]], x: float, y: float, width: float) -> tuple[list[str], float]:
    """Colour swatches with names, wrapped to `width`; returns (elements, height used)."""
    out, cx, cy = [], x, y
    for name, color in items:
        w = 22 + 7 * len(name)
        if cx + w > x + width and cx > x:
            cx, cy = x, cy + 18
        out.append(f'<rect x="{cx:.1f}" y="{cy - 10:.1f}" width="12" height="12" fill="{color}"/>')
        out.append(_text(cx + 16, cy, name, size=11))
        cx += w + 10
    return out, cy - y + 18


def stacked_bars(
    rows: Sequence[tuple[str, Sequence[float]]],
    segments: Sequence[tuple[str, str]],
    title: str,
    width: float = 560,
    unit: str = "",
) -> str:
    """One horizontal bar per row, split into `segments` (name, colour); each row's total at its end.

    Bars share one scale (the largest total), so rows compare by length; segments >= 4 % of the
    scale carry their value."""
    label_w, bar_h, gap, top = 110, 20, 8, 26
    lg, lg_h = legend(segments, 10, top + len(rows) * (bar_h + gap) + 14, width - 20)
    height = top + len(rows) * (bar_h + gap) + lg_h + 10
    scale_max = max([sum(v) for _, v in rows] + [1e-12])
    plot_w = width - label_w - 60
    body = [_text(10, 16, title, size=13, font_weight="600")]
    for i, (name, values) in enumerate(rows):
        y = top + i * (bar_h + gap)
        body.append(_text(label_w - 8, y + bar_h * 0.7, name, anchor="end"))
        x = float(label_w)
        for (seg, color), v in zip(segments, values):
            w = plot_w * v / scale_max
            if w > 0:
                body.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{color}">'
                    f"<title>{escape(f'{name} {seg}: {_num(v)}{unit}')}</title></rect>"
                )
                if w >= 0.04 * plot_w and w >= 7 * len(_num(v)) + 4:
                    body.append(
                        _text(x + w / 2, y + bar_h * 0.7, _num(v), anchor="middle", size=11, fill="#fff")
                    )
            x += w
        body.append(_text(x + 5, y + bar_h * 0.7, f"{_num(sum(values))}{unit}", size=11, fill=AXIS))
    body += lg
    return _svg(width, height, body, title)


def grouped_bars(
    rows: Sequence[tuple[str, Sequence[float]]],
    groups: Sequence[tuple[str, str]],
    title: str,
    width: float = 560,
    fmt: str = "{:+.3f}",
) -> str:
    """Per row, one thin horizontal bar per group (name, colour) from a shared zero line, value at its end."""
    label_w, bar_h, row_gap, top = 110, 11, 12, 26
    n = len(groups)
    row_h = n * bar_h + row_gap
    lg, lg_h = legend(groups, 10, top + len(rows) * row_h + 12, width - 20)
    height = top + len(rows) * row_h + lg_h + 8
    vmax = max([abs(v) for _, vs in rows for v in vs] + [1e-12])
    plot_w = width - label_w - 70
    body = [_text(10, 16, title, size=13, font_weight="600")]
    body.append(
        f'<line x1="{label_w}" y1="{top - 4}" x2="{label_w}" y2="{top + len(rows) * row_h - row_gap + 2}" stroke="{AXIS}"/>'
    )
    for i, (name, values) in enumerate(rows):
        y0 = top + i * row_h
        body.append(_text(label_w - 8, y0 + n * bar_h / 2 + 4, name, anchor="end"))
        for j, ((grp, color), v) in enumerate(zip(groups, values)):
            y = y0 + j * bar_h
            w = plot_w * max(v, 0.0) / vmax
            body.append(
                f'<rect x="{label_w}" y="{y + 1}" width="{w:.1f}" height="{bar_h - 2}" fill="{color}">'
                f"<title>{escape(f'{name} {grp}: {fmt.format(v)}')}</title></rect>"
            )
            body.append(_text(label_w + w + 4, y + bar_h - 2, fmt.format(v), size=9, fill=AXIS))
    body += lg
    return _svg(width, height, body, title)


def line_chart(
    series: Sequence[tuple[str, Sequence[float], Sequence[float], str]],
    title: str,
    xlabel: str,
    ylabel: str,
    width: float = 300,
    height: float = 260,
    diagonal: bool = False,
    points: bool = False,
    bars: Sequence[tuple[float, float, float]] = (),
) -> str:
    """Lines (name, xs, ys, colour) on [0, 1] x [0, 1]; `diagonal` draws y = x; `points` marks each point;
    `bars` (x0, x1, fraction of the chart's height) are drawn faintly under the lines (a histogram)."""
    left, right, top, bottom = 42, 10, 24, 34
    lg, lg_h = legend([(n, c) for n, _, _, c in series], 8, height + 12, width - 16)  # under the x label
    total_h = height + lg_h + 4
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + pw * min(max(x, 0.0), 1.0)

    def py(y: float) -> float:
        return top + ph * (1 - min(max(y, 0.0), 1.0))

    body = [_text(8, 15, title, size=13, font_weight="600")]
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        body.append(f'<line x1="{px(0)}" y1="{py(t):.1f}" x2="{px(1)}" y2="{py(t):.1f}" stroke="{GRID}"/>')
        body.append(_text(left - 5, py(t) + 4, f"{t:g}", anchor="end", size=10, fill=AXIS))
        body.append(_text(px(t), top + ph + 14, f"{t:g}", anchor="middle", size=10, fill=AXIS))
    for x0, x1, frac in bars:
        h = ph * min(max(frac, 0.0), 1.0)
        body.append(
            f'<rect x="{px(x0):.1f}" y="{top + ph - h:.1f}" width="{px(x1) - px(x0):.1f}" height="{h:.1f}" fill="#dde6f0"/>'
        )
    body.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="{AXIS}"/>')
    if diagonal:
        body.append(
            f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(1)}" y2="{py(1)}" stroke="#999" stroke-dasharray="4 3"/>'
        )
    for name, xs, ys, color in series:
        pts = [(px(x), py(y)) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        if not pts:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        body.append(
            f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8">'
            f"<title>{escape(name)}</title></polyline>"
        )
        if points:
            body += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{color}"/>' for x, y in pts]
    body.append(_text(left + pw / 2, top + ph + 28, xlabel, anchor="middle", size=11))
    body.append(
        _text(
            12, top + ph / 2, ylabel, anchor="middle", size=11, transform=f"rotate(-90 12 {top + ph / 2:.1f})"
        )
    )
    body += lg
    return _svg(width, total_h, body, title)


def _num(v: float) -> str:
    return f"{round(v):d}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}"
