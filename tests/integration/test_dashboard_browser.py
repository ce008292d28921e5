"""The operator page in a real browser (Debian's chromium, headless, driven by Playwright) against
the real ``twistd logbroker`` while a producer writes: sign in through the form, see the topic
and a live produce rate, and no CSP violation or script error on the way.

Set ``LOGBROKER_DASHBOARD_SCREENSHOT`` to a path to keep the page's screenshot there
(docs/images/dashboard.png is made this way)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import ConsoleMessage, Error, sync_playwright

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.integration.twistd import flip_byte, running_broker, wait_until

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOPIC = "browser-orders"
# Seconds to wait for what the page should show.
TIMEOUT_MS = 30_000

#: Collects CSP violations as the page sees them (an init script is not subject to the CSP).
RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__cspViolations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""

#: The produce rate shown in the topic's row, as a number (0 until there is one).
TOPIC_PRODUCE_RATE = """
(topic) => {
  const row = [...document.querySelectorAll("#topics tbody tr")]
    .find((tr) => tr.cells[0].textContent === topic);
  return row ? Number(row.cells[6].textContent.replaceAll(",", "")) || 0 : 0;
}
"""


@contextmanager
def producing(port: int) -> Iterator[None]:
    """A producer writing small batches to TOPIC from a background thread until the end."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            with BlockingClient.connect("127.0.0.1", port, "app", "app123") as client:
                batch = [Record(b"order %d" % i, key=b"k%d" % (i % 16)) for i in range(50)]
                while not stop.wait(0.02):
                    client.produce(TOPIC, batch)
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=run, name="producer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures


def test_the_page_shows_the_topic_and_its_live_produce_rate_without_csp_errors(
    tmp_path: Path,
) -> None:
    # A missing browser is a broken test machine, not a reason to skip.
    assert Path(CHROMIUM).exists(), "chromium is missing: run scripts/install --test"
    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as admin:
            admin.create_topic(TOPIC)
        with producing(broker.port), sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 820})
                console: list[ConsoleMessage] = []
                errors: list[Error] = []
                # Playwright takes Python functions, not bound builtins like list.append.
                page.on("console", lambda message: console.append(message))
                page.on("pageerror", lambda error: errors.append(error))
                page.add_init_script(RECORD_VIOLATIONS)

                page.goto(f"http://127.0.0.1:{broker.dashboard_port}/")
                page.fill("#username", "admin")
                page.fill("#password", "admin123")
                page.click("button[type=submit]")

                page.wait_for_selector(f"#topics td:text-is('{TOPIC}')", timeout=TIMEOUT_MS)
                page.wait_for_function(TOPIC_PRODUCE_RATE, arg=TOPIC, timeout=TIMEOUT_MS)
                assert page.text_content("#node-status") == "ready"
                assert float(page.text_content("#produce-rate").replace(",", "")) > 0
                # A few more polls, so that the screenshot shows some history.
                page.wait_for_timeout(6000)
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                violations = page.evaluate("window.__cspViolations")
            finally:
                browser.close()

    keep = os.environ.get("LOGBROKER_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(tmp_path / "dashboard.png", keep)
    assert violations == []
    assert errors == []
    problems = [
        message.text
        for message in console
        if message.type == "error" or "Content Security Policy" in message.text
    ]
    assert problems == []


def test_the_page_names_an_unrepairable_segment_and_an_admin_starts_a_full_scrub_pass(
    tmp_path: Path,
) -> None:
    assert Path(CHROMIUM).exists(), "chromium is missing: run scripts/install --test"
    data = tmp_path / "data"
    settings = {
        "SVC_DATA_DIR": str(data),
        "SVC_SEGMENT_MAX_BYTES": "4096",
        "SVC_TOPIC_RANGES": "1",
        "SVC_SCRUB_INTERVAL_MS": "200",
        "SVC_SCRUB_SEGMENTS_PER_TICK": "10",
    }
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as admin:
            admin.create_topic(TOPIC)
            for batch in range(12):
                admin.produce(TOPIC, [Record(b"v" * 200, key=b"k%d" % batch)] * 5)
        # A full segment is sealed behind the appends (decision 0024): the last may lag.
        wait_until(lambda: len(list(data.rglob("*.sealed"))) >= 3, 10)
        sealed = sorted(p.with_suffix(".log") for p in data.rglob("*.sealed"))
        rotten = sealed[1]
        flip_byte(rotten)
        segment = f"{rotten.parent.name}@{int(rotten.stem)}"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 820})
                errors: list[Error] = []
                page.on("pageerror", lambda error: errors.append(error))
                page.add_init_script(RECORD_VIOLATIONS)
                page.goto(f"http://127.0.0.1:{broker.dashboard_port}/")
                page.fill("#username", "admin")
                page.fill("#password", "admin123")
                page.click("button[type=submit]")

                page.wait_for_selector(
                    f"#scrub-unrepairable-segments td:text-is('{segment}')", timeout=TIMEOUT_MS
                )
                assert page.text_content("#scrub-state") == "10 segments every 200 ms"
                assert page.text_content("#retention-limits") == "off: every segment is kept"
                page.click("#scrub-now")
                page.wait_for_function(
                    "() => document.getElementById('scrub-now-result').textContent !== ''",
                    timeout=TIMEOUT_MS,
                )
                result = page.text_content("#scrub-now-result")
                violations = page.evaluate("window.__cspViolations")
            finally:
                browser.close()
    assert result == f"Started: {len(sealed)} sealed segments to check."
    assert violations == []
    assert errors == []
