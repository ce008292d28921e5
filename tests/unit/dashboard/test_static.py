"""The page's files run under the Content Security Policy: nothing inline, nothing evaluated,
and client data only ever written as text."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from importlib import resources

import pytest

STATIC = resources.files("logbroker.dashboard") / "static"
PAGES = sorted(entry.name for entry in STATIC.iterdir() if entry.name.endswith(".html"))
SCRIPTS = sorted(entry.name for entry in STATIC.iterdir() if entry.name.endswith(".js"))


class InlineFinder(HTMLParser):
    """Notes every inline script or style, event handler attribute and javascript: URL."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.linked: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "style":
            self.found.append("<style>")
        if tag == "script":
            if not named.get("src"):
                self.found.append("<script> without src")
            else:
                self.linked.append(named["src"] or "")
        if tag == "link" and named.get("rel") == "stylesheet":
            self.linked.append(named.get("href") or "")
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.found.append(f"{tag} {name}=")
            if value and value.strip().lower().startswith("javascript:"):
                self.found.append(f"{tag} {name}=javascript:")


def test_the_pages_and_scripts_are_shipped() -> None:
    assert PAGES == ["forbidden.html", "index.html", "login.html"]
    assert SCRIPTS == ["dashboard.js", "login.js"]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_has_no_inline_script_or_style_and_links_only_its_own_files(page: str) -> None:
    finder = InlineFinder()
    finder.feed((STATIC / page).read_text("utf-8"))
    assert finder.found == []
    assert finder.linked
    assert all(url.startswith("/static/") for url in finder.linked)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_never_writes_html_nor_evaluates_text(script: str) -> None:
    text = (STATIC / script).read_text("utf-8")
    for forbidden in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert forbidden not in text
    assert "new Function" not in text


def element_ids(page: str) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', (STATIC / page).read_text("utf-8")))


def test_every_element_the_console_script_fills_is_on_the_page() -> None:
    script = (STATIC / "dashboard.js").read_text("utf-8")
    named = set(re.findall(r'(?:byId|setText|fillRows|pairs)\(\s*"([^"]+)"', script))

    assert {"cluster", "cluster-nodes", "cluster-chores", "cluster-violations"} <= named
    assert named - element_ids("index.html") == set()


def test_the_cluster_card_is_hidden_until_the_broker_describes_its_cluster() -> None:
    page = (STATIC / "index.html").read_text("utf-8")

    assert re.search(r'<section class="panel" id="cluster" hidden>', page)
    headings = re.findall(r"<th[^>]*>([^<]+)</th>", page.split('id="cluster-nodes"')[1])
    assert headings[:7] == [
        "Node",
        "State",
        "Address",
        "Peer port",
        "Attributes",
        "Segments led",
        "Role",
    ]
