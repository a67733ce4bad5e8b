"""Write `.dvc/plots/offline.html`: DVC's plots page template with Vega, Vega-Lite and Vega-Embed inlined.

`dvc plots show` / `dvc plots diff` fill an HTML template (`.dvc/config`: `plots.html_template`); DVC's own
default loads the three libraries from a CDN, so the page is blank without network. With a template that
has no `{scripts}` placeholder DVC adds no script tags, and this one carries the libraries itself: the page
opens offline.

Usage (the three npm packages' build/*.min.js, e.g. from `npm pack vega@5 vega-lite@5 vega-embed@6`):
    python scripts/make_plots_template.py VEGA.min.js VEGA_LITE.min.js VEGA_EMBED.min.js
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / ".dvc" / "plots" / "offline.html"

HEAD = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot (offline)</title>
    <!-- Vega, Vega-Lite and Vega-Embed (BSD-3-Clause, University of Washington Interactive Data Lab),
         inlined by scripts/make_plots_template.py so this page needs no network. -->
"""
TAIL = """    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def main(paths: list[str]) -> None:
    if len(paths) != 3:
        raise SystemExit(__doc__)
    scripts = []
    for p in paths:
        js = Path(p).read_text(encoding="utf-8")
        if "</script" in js.lower():
            raise SystemExit(f"{p}: contains '</script', cannot be inlined")
        scripts.append(f"    <script>/* {Path(p).name} */\n{js}\n    </script>\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(HEAD + "".join(scripts) + TAIL, encoding="utf-8")
    print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
