"""The run report in a real headless browser (Chromium): it loads offline, every image decodes, the sections
lay out with a size, nothing is fetched, and a screenshot shows a page (not a blank or an error page).

Needs Debian's `chromium` (`apt-get install -y chromium`; .ci/run tries to install it); skipped with the
reason when no Chromium is on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.report.test_build import SECTIONS

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium); browser test skipped"
)

# Runs when the page has loaded (all images decoded or failed), then writes what it saw into the DOM,
# which --dump-dom prints. Only the test's copy of the page gets it: the report itself has no script.
CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const box = (el) => { const r = el.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
  const out = {
    title: document.title,
    images: imgs.length,
    decoded: imgs.filter((i) => i.complete && i.naturalWidth > 0).length,
    image_sizes: imgs.map((i) => [i.naturalWidth, i.naturalHeight]),
    svgs: document.querySelectorAll("svg").length,
    sections: Object.fromEntries([...document.querySelectorAll("section")].map((s) => [s.id, box(s)])),
    fetched: performance.getEntriesByType("resource").map((e) => e.name),
    baseline: (document.getElementById("baseline") || {}).textContent,
    svg_text: [...document.querySelectorAll("svg text")].length,
  };
  document.body.setAttribute("data-check", JSON.stringify(out));
});
</script>"""

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    env = {**os.environ, "HOME": str(tmp)}  # a fresh profile and no crash reporter state outside tmp
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_report_renders_in_chromium(report_html: Path, tracked_eval, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(report_html.read_text().replace("</body>", CHECK + "</body>"))
    res = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", page.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    start = res.stdout.index('data-check="') + len('data-check="')
    import html as html_mod

    seen = json.loads(html_mod.unescape(res.stdout[start : res.stdout.index('"', start)]))
    assert seen["title"].startswith("Run report: evaluation of onnxruntime/fp32")
    assert seen["images"] > 0 and seen["decoded"] == seen["images"], seen["image_sizes"]
    assert all(w > 300 and h > 100 for w, h in seen["image_sizes"])
    assert seen["fetched"] == [] or all(u.startswith("data:") for u in seen["fetched"]), seen["fetched"]
    assert set(seen["sections"]) >= SECTIONS
    for name, (w, h) in seen["sections"].items():
        assert w > 400 and h > 60, (name, w, h)  # every section laid out with real content
    assert seen["svgs"] >= 7 and seen["svg_text"] > 50
    assert "no champion" in seen["baseline"]

    shot = tmp_path / "shot.png"
    res = _chromium(tmp_path, "--virtual-time-budget=10000", f"--screenshot={shot}", "--window-size=1400,2400",
                    report_html.as_uri())  # fmt: skip
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    im = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert im.shape[:2] == (2400, 1400)
    # The header band is the report's dark blue (#14213d), the page body light; a blank or an error page is not.
    assert np.abs(im[20, 700] - (0x14, 0x21, 0x3D)).max() < 8
    assert im.std() > 30 and (im.mean(axis=2) > 200).mean() > 0.3
    # For a human look: PFACTORY_REPORT_SCREENSHOT=/path/shot.png pytest tests/report/test_browser.py
    keep = os.environ.get("PFACTORY_REPORT_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
