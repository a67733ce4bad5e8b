"""`dvc plots show` writes a page that opens offline: the project's `.dvc/config` points DVC at
`.dvc/plots/offline.html`, which carries Vega, Vega-Lite and Vega-Embed itself (no CDN script)."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dvc_config_uses_the_offline_template() -> None:
    conf = configparser.ConfigParser()
    conf.read(ROOT / ".dvc" / "config")
    template = ROOT / ".dvc" / conf["plots"]["html_template"]
    html = template.read_text(encoding="utf-8")
    assert "{plot_divs}" in html and "{scripts}" not in html  # DVC adds its CDN tags only at {scripts}
    assert "vegaEmbed" in html and "vegaLite" in html
    assert not re.search(r"<script[^>]+src=", html), "no script may load from the network"


def test_dvc_plots_show_writes_a_self_contained_page(tmp_path: Path) -> None:
    (tmp_path / ".dvc" / "plots").mkdir(parents=True)
    (tmp_path / ".dvc" / "config").write_text(
        "[core]\n    no_scm = true\n    analytics = false\n[plots]\n    html_template = plots/offline.html\n"
    )
    (tmp_path / ".dvc" / "plots" / "offline.html").write_bytes((ROOT / ".dvc" / "plots" / "offline.html").read_bytes())
    (tmp_path / "curve.json").write_text('[{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]')
    r = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "curve.json", "-x", "step", "-y", "loss", "-o", "out"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={"DVC_NO_ANALYTICS": "1", "PATH": "", "DVC_SITE_CACHE_DIR": str(tmp_path / "site")},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert "curve.json" in page and "vegaEmbed(" in page
    assert "cdn.jsdelivr" not in page and not re.search(r"<script[^>]+src=", page)
