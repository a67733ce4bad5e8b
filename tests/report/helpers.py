"""Reading a report page back: its tags and attributes, its tables, its text (stdlib HTML parser)."""

from __future__ import annotations

import base64
from html.parser import HTMLParser


class Page(HTMLParser):
    """Collects every start tag with its attributes, the text, and the rows of every table by class."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "table":
            self.tables.append((a.get("class", ""), []))
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None and self.tables:
            self.tables[-1][1].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data + " ")

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if "id" in a}

    def images(self) -> list[bytes]:
        """The decoded bytes of every <img> (all must be data URIs)."""
        out = []
        for tag, a in self.tags:
            if tag == "img":
                src = a.get("src", "")
                assert src.startswith("data:image/png;base64,"), src[:60]
                out.append(base64.b64decode(src.split(",", 1)[1]))
        return out

    def table(self, cls: str) -> list[list[str]]:
        return next(rows for c, rows in self.tables if cls in c.split())


def external_references(html: str, page: Page) -> list[str]:
    """Anything the page would fetch: src/href/xlink:href/poster/srcset values that are not data URIs,
    <script>/<link>/<iframe>/<object> tags, CSS url() and @import."""
    bad = []
    for tag, a in page.tags:
        if tag in ("script", "link", "iframe", "object", "embed", "base"):
            bad.append(f"<{tag}>")
        for k in ("src", "href", "xlink:href", "poster", "srcset", "data"):
            v = a.get(k)
            if v and not v.startswith("data:") and not v.startswith("#"):
                bad.append(f"{tag} {k}={v[:60]}")
    for needle in ("url(", "@import"):
        if needle in html:
            bad.append(needle)
    return bad
