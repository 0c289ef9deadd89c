"""GET /: the status page in a real headless Chromium, following a fault scenario live."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import ROOT, ServiceProcess, write_tokens

PAGE = ROOT / "service" / "static" / "status.html"
SCREENSHOT = ROOT / "docs" / "status.png"
WAIT_S = 20  # the page polls every second: a state change shows within about one poll, or a
# few on a busy machine (the wait ends as soon as it shows)
#: Headless, and nothing that talks to any address but the service's.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-breakpad",
    "--disable-dev-shm-usage",
    "--no-default-browser-check",
    "--no-proxy-server",
    "--window-size=1280,1000",
)
#: Run before the page's own script: the browser's clock is an hour ahead of the store's.
#: Windows are judged against the response's ``now``, so the page must not notice.
SKEW_CLOCK = """
(() => {
  const RealDate = Date;
  const skew = 3600 * 1000;
  class SkewedDate extends RealDate {
    constructor(...args) { if (args.length === 0) { super(RealDate.now() + skew); }
                           else { super(...args); } }
    static now() { return RealDate.now() + skew; }
  }
  window.Date = SkewedDate;
})();
"""


def _binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed: Debian package {package} (make system-deps)")
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    chromium = _binary("chromium", "chromium")
    chromedriver = _binary("chromedriver", "chromium-driver")
    tmp = tmp_path_factory.mktemp("chromium")
    options = Options()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}"):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager (which would download one) is never run.
    service = Service(executable_path=chromedriver, log_output=str(tmp / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.set_page_load_timeout(WAIT_S)
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": SKEW_CLOCK})
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def detour() -> Iterator[ServiceProcess]:
    svc = ServiceProcess()  # the memory store: the page reads the same API either way
    try:
        yield svc
    finally:
        svc.stop()


#: Read in one script: the page rebuilds its tables every second, so element handles go stale.
ROW_JS = """
const row = document.querySelector(`#brokers tr[data-broker="${arguments[0]}"]`);
if (!row) return {};
const text = (f) => row.querySelector(`[data-field="${f}"]`).innerText;
return {state: row.dataset.state, "remaining-ms": row.dataset.remainingMs, tier: row.dataset.tier,
        isolated: row.dataset.isolated, text_state: text("state"), text_ends: text("ends"),
        text_remaining: text("remaining"), text_latency: text("latency"), text_tier: text("tier")};
"""
#: Names whose text box is split over lines (an inline element that wraps has several rects).
WRAPPED_JS = """
return [...document.querySelectorAll(".name")].filter((e) => e.getClientRects().length > 1)
  .map((e) => e.innerText);
"""


def _row(driver: WebDriver, broker: str) -> dict[str, str]:
    """The broker's row as the page shows it; {} while the page has no row for it."""
    return dict(driver.execute_script(ROW_JS, broker))


def _shows(driver: WebDriver, states: dict[str, str]) -> Callable[[WebDriver], bool]:
    def check(_: WebDriver) -> bool:
        return all(_row(driver, b).get("state") == s for b, s in states.items())

    return check


def _text(driver: WebDriver, selector: str) -> str | None:
    return driver.execute_script(  # type: ignore[no-any-return]
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", selector)


def _order(driver: WebDriver) -> list[str]:
    """The brokers in the order of the page's rows."""
    return driver.execute_script(  # type: ignore[no-any-return]
        'return [...document.querySelectorAll("#brokers tbody tr")].map((r) => r.dataset.broker);')


def _events(driver: WebDriver) -> list[tuple[str, str, int]]:
    """(kind, broker, count) of the event rows, newest first."""
    return [tuple(row) for row in driver.execute_script(  # type: ignore[misc]
        'return [...document.querySelectorAll("#events tbody tr[data-kind]")].map((r) =>'
        ' [r.dataset.kind, r.dataset.broker, Number(r.dataset.count)]);')]


def _route_state(driver: WebDriver, topic: str) -> str | None:
    return driver.execute_script(  # type: ignore[no-any-return]
        "const r = document.querySelector(`#routes tr[data-topic=\"${arguments[0]}\"]`);"
        "return r ? r.dataset.state : null;", topic)


@pytest.mark.unit
def test_page_is_self_contained() -> None:
    html = PAGE.read_text(encoding="utf-8")
    # No external script, style, font or image: everything inline, nothing fetched elsewhere.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"@import|url\(", html)
    assert re.search(r"<script>", html) and re.search(r"<style>", html)
    for path in ("fault-items", "routes", "config"):
        assert f'getJson("{path}"' in html


@pytest.mark.integration
def test_root_serves_the_page() -> None:
    with TestClient(create_app(Settings())) as client:
        res = client.get("/")
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("text/html")
    assert res.text == PAGE.read_text(encoding="utf-8")


@pytest.mark.e2e
@pytest.mark.slow
def test_page_follows_a_fault_scenario(browser: WebDriver, detour: ServiceProcess,
                                       tmp_path: Path) -> None:
    with httpx.Client(base_url=detour.url, timeout=5) as api:
        api.put("/routes/orders", json={"brokers": [
            {"brokerName": "broker-a", "writeQueueNums": 4, "address": "10.0.0.5:10911"},
            {"brokerName": "broker-b", "writeQueueNums": 4, "address": "10.0.0.6:10911"},
            {"brokerName": "broker-c", "writeQueueNums": 4, "address": "10.0.0.7:10911"},
        ]}).raise_for_status()
        api.put("/routes/payments", json={"brokers": [
            {"brokerName": "broker-c", "writeQueueNums": 2},
            {"brokerName": "broker-d", "writeQueueNums": 2},
        ]}).raise_for_status()
        browser.get(detour.url + "/")
        wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.05)
        wait.until(_shows(browser, {b: "available" for b in ("broker-a", "broker-b",
                                                               "broker-c", "broker-d")}))
        assert _row(browser, "broker-a")["text_latency"] == "—"  # no report yet

        # a fails, b is slow (600 ms: the 550 ms tier, 30 s), c and d are healthy.
        for report in ({"brokerName": "broker-a", "latencyMs": 3001, "isolation": True},
                       {"brokerName": "broker-b", "latencyMs": 600},
                       {"brokerName": "broker-c", "latencyMs": 20},
                       {"brokerName": "broker-d", "latencyMs": 120}):
            api.post("/report-latency", json=report).raise_for_status()
        wait.until(_shows(browser, {"broker-a": "avoided", "broker-b": "avoided",
                                    "broker-c": "available", "broker-d": "available"}))

        wait.until(lambda _: _row(browser, "broker-a").get("isolated") == "true")
        a, b, c, d = (_row(browser, n) for n in ("broker-a", "broker-b", "broker-c", "broker-d"))
        # Judged against the store's `now` although the browser's clock is an hour ahead.
        assert 580_000 < int(a["remaining-ms"]) <= 600_000, a
        assert a["text_remaining"].startswith("in 9 min"), a
        assert 20_000 < int(b["remaining-ms"]) <= 30_000, b
        # a failed: isolated, its window the failure's (10 min), not its latency's tier (3 min).
        assert a["text_state"] == "isolated" and a["text_latency"] == "3.0 s", a
        assert a["text_tier"].startswith("isolated: failed send → 10 min window"), a
        assert "3 min, does not count" in a["text_tier"], a
        assert b["text_state"] == "avoided" and b["isolated"] == "false", b
        assert b["text_latency"] == "600 ms" and b["tier"] == "2", b
        # avoided for its slow answer: the tier of the latency that set the window, and since
        assert b["text_tier"].startswith("≥ 550 ms → 30 s\nlatency 600 ms since "), b
        assert c["text_latency"] == "20 ms" and c["text_tier"] == "< 50 ms → no window", c
        assert d["tier"] == "1" and d["text_tier"] == "≥ 100 ms → no window", d
        assert c["remaining-ms"] == "0" and c["text_remaining"] == "—", c
        # An ended window shows no end time (it is in the past); an open one does.
        assert c["text_ends"] == d["text_ends"] == "—", (c, d)
        assert re.fullmatch(r"\d\d:\d\d:\d\d UTC", a["text_ends"]), a
        assert _route_state(browser, "orders") == "ok"
        assert _text(browser, "#avoided-count") == "2 avoided"
        assert _text(browser, "#isolated-count") == "1 isolated"
        assert browser.find_element(By.ID, "error").is_displayed() is False
        assert _text(browser, '#config tr[data-key="isolationLatencyMs"] td') == "30000 ms"
        assert _text(browser, '#tiers tr[data-tier="2"]') == "550 ms\t30 s"
        assert _text(browser, '#tiers tr[data-tier="6"]') == "15 s\t10 min"
        # docs/status.png is the README's picture: rewritten only on request
        # (DETOUR_UPDATE_SCREENSHOT=1) or when missing, so test runs leave the tree clean.
        shot = SCREENSHOT if os.environ.get("DETOUR_UPDATE_SCREENSHOT") or \
            not SCREENSHOT.exists() else tmp_path / "status.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # Alphabetical order happens to be the right one so far: isolated, avoided, available.
        assert _order(browser) == ["broker-a", "broker-b", "broker-c", "broker-d"]

        # c fails too: every broker of `orders` is avoided, `payments` still has d.
        c_end = api.post("/report-latency", json={"brokerName": "broker-c", "latencyMs": 0,
                                                  "isolation": True}).json()["availableAt"]
        wait.until(lambda _: _route_state(browser, "orders") == "all-avoided")
        assert _route_state(browser, "payments") == "ok"
        # The window outlives c's 0 ms latency (its tier opens none): the page says why.
        wait.until(lambda _: _row(browser, "broker-c").get("isolated") == "true")
        assert _row(browser, "broker-c")["text_tier"].startswith("isolated: failed send"), \
            _row(browser, "broker-c")
        # Isolated first (a, c), then avoided for latency (b), then available (d).
        assert _order(browser) == ["broker-a", "broker-c", "broker-b", "broker-d"]

        # An operator restores a: the page follows.
        api.delete("/fault-items/broker-a").raise_for_status()
        wait.until(_shows(browser, {"broker-a": "available", "broker-c": "avoided"}))
        wait.until(lambda _: _route_state(browser, "orders") == "ok")
        assert _row(browser, "broker-a")["text_latency"] == "—"
        assert _order(browser) == ["broker-c", "broker-b", "broker-a", "broker-d"]
        # The event log shows the latest first: the operator's restore, c's isolation.
        wait.until(lambda _: browser.find_elements(
            By.CSS_SELECTOR, '#events tbody tr[data-kind="ended"][data-broker="broker-a"]'))
        assert _events(browser)[:2] == [("ended", "broker-a", 1), ("opened", "broker-c", 1)]

        # Producers keep failing on c: each failure that moves its window's end extends it,
        # one event each, shown as one row with the count. Two reports in the same
        # millisecond end the window at the same moment: the second moves nothing and
        # logs nothing, so the count is the number of moves the answers show.
        moves = 0
        for _ in range(500):  # bounded: 500 reports span far more than 5 ms
            end = api.post("/report-latency", json={"brokerName": "broker-c", "latencyMs": 0,
                                                    "isolation": True}).json()["availableAt"]
            assert end >= c_end
            moves, c_end = moves + (end > c_end), end
            if moves == 5:
                break
        assert moves == 5
        wait.until(lambda _: _events(browser)[:1] == [("extended", "broker-c", 5)])
        assert _events(browser)[:3] == [("extended", "broker-c", 5), ("ended", "broker-a", 1),
                                         ("opened", "broker-c", 1)]
        assert "×5" in (_text(browser, '#events tbody tr[data-kind="extended"]') or "")

        # Busy brokers fill the event log (250 extensions of b's window, more than the page
        # reads): c's isolation is still named, from its fault item, as it was.
        for n in range(250):
            api.post("/report-latency", json={"brokerName": "broker-b",
                                              "latencyMs": 600 + n}).raise_for_status()
        # The page has the last report (its latency), and names the one that set the window
        # end: the last one only if it moved the end (reports can come faster than one a ms,
        # and two in one ms move nothing).
        wait.until(lambda _: _row(browser, "broker-b").get("text_latency") == "849 ms")
        why = next(i for i in api.get("/fault-items").json()["items"]
                   if i["brokerName"] == "broker-b")["why"]
        assert why["reason"] == "latency" and 600 <= why["latencyMs"] <= 849, why
        named = f"latency {why['latencyMs']} ms"
        wait.until(lambda _: named in _row(browser, "broker-b")["text_tier"])
        assert _row(browser, "broker-c")["text_tier"].startswith("isolated: failed send"), \
            _row(browser, "broker-c")

        # 800 px wide: no name breaks over two lines (the tables scroll sideways instead).
        browser.set_window_size(800, 1000)
        try:
            wait.until(lambda _: browser.execute_script("return window.innerWidth") <= 800)
            assert browser.execute_script(WRAPPED_JS) == []
        finally:
            browser.set_window_size(1280, 1000)


@pytest.mark.e2e
def test_error_banner_when_a_poll_fails(browser: WebDriver, detour: ServiceProcess) -> None:
    with httpx.Client(base_url=detour.url, timeout=5) as api:
        api.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1}]})
    browser.get(detour.url + "/")
    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.05)
    wait.until(_shows(browser, {"x": "available"}))
    banner = browser.find_element(By.ID, "error")
    assert not banner.is_displayed()

    detour.stop()
    wait.until(lambda _: banner.is_displayed())
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-poll") == "error"
    assert re.match(r"Poll failed: GET /(fault-items|routes|config|events\?\S*): ",
                    banner.text), banner.text
    assert "showing data from" in banner.text
    assert _row(browser, "x")["state"] == "available"  # the last good data stays on screen

    # Back on the same port: the banner goes away at the next good poll.
    revived = ServiceProcess(port=detour.port)
    try:
        wait.until(lambda _: not banner.is_displayed())
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-poll") == "ok"
    finally:
        revived.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_page_asks_for_a_token_when_the_service_needs_one(browser: WebDriver,
                                                          tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens.json", {"ops": ("tok-ops", "admin", "prod")})
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(tokens)}) as svc:
        httpx.put(f"{svc.url}/routes/orders", timeout=5,
                  headers={"Authorization": "Bearer tok-ops"},
                  json={"brokers": [{"brokerName": "broker-a", "writeQueueNums": 2}]}
                  ).raise_for_status()
        browser.get(svc.url + "/")
        wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.05)
        form = browser.find_element(By.ID, "auth")
        banner = browser.find_element(By.ID, "error")
        wait.until(lambda _: form.is_displayed() and "401" in banner.text)
        browser.find_element(By.ID, "token").send_keys("tok-ops")
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()
        wait.until(_shows(browser, {"broker-a": "available"}))
        wait.until(lambda _: not banner.is_displayed())
        assert form.is_displayed() is False
