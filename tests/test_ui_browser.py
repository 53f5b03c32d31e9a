"""The page in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium through the system chromedriver; nothing is downloaded at test time) renders /ui of an
infertap in front of the simulated engine and the fake upstream, under a mixed load.

Skips when the browser is missing (scripts/install_browser.sh installs it), but fails in CI.
Leaves screenshots in artifacts/: ui-load.png (under load) and ui.png (after it). With
INFERTAP_UPDATE_SCREENSHOT=1 the load runs for a minute (so the charts have a history) and the
under-load screenshot also replaces docs/img/ui.png.
"""

from __future__ import annotations

import base64
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.settings import RetrySettings, Settings, UISettings, UpstreamSettings
from proxy.sim import create_sim_app, load_sim_config
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import TEST_HEADERS, run_proxy, serve_in_thread, wait_until

ROOT = Path(__file__).resolve().parent.parent
CI = os.environ.get("CI", "").lower() == "true"
UPDATE = os.environ.get("INFERTAP_UPDATE_SCREENSHOT") == "1"
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--window-size=1440,1000",
)
# [request id, outcome] of every row of the requests table, top to bottom.
ROWS = (
    "return [...document.querySelectorAll('#requests tbody tr')]"
    ".map(r => [r.dataset.requestId, r.dataset.outcome])"
)


def _browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths; skips, or fails in CI, when something is missing."""
    missing: list[str] = []
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = (
        "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else shutil.which("chromedriver")
    )
    if chromium is None:
        missing.append("chromium (Debian package chromium)")
    if driver is None:
        missing.append("chromedriver (Debian package chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip, in .venv)")
    if missing or chromium is None or driver is None:
        why = f"headless browser test needs {', '.join(missing)}: run scripts/install_browser.sh"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    return chromium, driver


@contextmanager
def chrome(chromium: str, driver_path: str) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with both paths given, Selenium Manager is never asked
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def chat(model: str, words: int) -> dict[str, Any]:
    text = " ".join(["token"] * words)
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": text}]}


def sim_load(proxy: str, seconds: float) -> list[str]:
    """Streams to the sim from 5 clients for about `seconds`, prompt lengths going up and down in
    waves (so TTFT does too); returns the request ids."""
    ids: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()

    def worker(w: int) -> None:
        rng = random.Random(w)
        with httpx.Client(timeout=30) as client:
            i = 0
            while (now := time.monotonic()) < start + seconds or i == 0:
                rid = f"sim-{w}-{i}"
                i += 1
                wave = 1.5 + math.sin(2 * math.pi * 1.5 * (now - start) / seconds)
                words = int(rng.choice((50, 400, 1500)) * wave)
                headers = {"x-request-id": rid, "x-sim-output-tokens": str(rng.randint(12, 48))}
                r = client.post(
                    f"{proxy}/v1/chat/completions", json=chat("sim-model", words), headers=headers
                )
                assert r.status_code == 200, r.text
                with lock:
                    ids.append(rid)

    with ThreadPoolExecutor(5) as pool:
        list(pool.map(worker, range(5)))
    return ids


def faults(proxy: str) -> list[tuple[str, str]]:
    """Requests to the fake upstream, one after another: (id, outcome), oldest first."""
    done: list[tuple[str, str]] = []
    with httpx.Client(timeout=30) as c:
        for i in range(3):
            c.post(
                f"{proxy}/v1/chat/completions",
                json=chat("fake-model", 20),
                headers={"x-request-id": f"fake-{i}"},
            )
            done.append((f"fake-{i}", "ok"))
        hdr = {"x-request-id": "timeout-0", "x-fake-hang": "after-first"}
        r = c.post(f"{proxy}/v1/chat/completions", json=chat("fake-model", 20), headers=hdr)
        assert "idle_timeout" in r.text
        done.append(("timeout-0", "idle_timeout"))
        hdr = {"x-request-id": "error-0", "x-fake-status": "500"}
        assert (
            c.post(f"{proxy}/v1/chat/completions", json=chat("fake-model", 20), headers=hdr).status_code
            == 500
        )
        done.append(("error-0", "upstream_error"))
        hdr = {"x-request-id": "gone-0", "x-fake-hang": "after-first"}
        with c.stream("POST", f"{proxy}/v1/chat/completions", json=chat("fake-model", 20), headers=hdr) as s:
            next(s.iter_raw())  # the first token arrived; the client leaves
        done.append(("gone-0", "client_disconnect"))
    return done


def test_ui_renders_in_headless_chromium() -> None:
    chromium, driver_path = _browser()
    fake = FakeUpstream()
    with (
        serve_in_thread(create_sim_app(load_sim_config())) as sim,
        serve_in_thread(fake) as fake_url,
    ):
        settings = Settings(
            upstreams=[
                UpstreamSettings(
                    name="sim", base_url=f"{sim}/v1", models=["sim-*"], forward_headers=TEST_HEADERS
                ),
                UpstreamSettings(
                    name="fake",
                    base_url=f"{fake_url}/v1",
                    default=True,
                    timeouts={"idle": 0.3},
                    forward_headers=TEST_HEADERS,
                ),
            ],
            retry=RetrySettings(max_attempts=2, backoff_seconds=0),
            ui=UISettings(
                window_seconds=120 if UPDATE else 60,
                step_seconds=2 if UPDATE else 1,
                recent_requests=500,
                refresh_seconds=1,
            ),
        )
        # The faults go at `fault_at` of the load, and the screenshot right after them.
        seconds, fault_at = (60, 0.8) if UPDATE else (5, 0.4)
        with (
            run_proxy(settings) as proxy,
            chrome(chromium, driver_path) as driver,
            ThreadPoolExecutor(1) as pool,
        ):
            started = time.monotonic()
            load = pool.submit(sim_load, proxy, seconds)
            driver.get(f"{proxy}/ui")
            wait_until(
                lambda: time.monotonic() - started >= fault_at * seconds or load.done(),
                seconds + 30,
                "the load to run its course",
            )
            sent_faults = faults(proxy)  # while the sim load runs
            wait_until(lambda: "gone-0" in ids(driver), 20, "the page to list the faults")
            save_screenshot(driver, "ui-load.png", docs=UPDATE)  # under load
            expected = [(rid, "ok") for rid in load.result()] + sent_faults
            total = len(expected)
            wait_until(
                lambda: sum(ui_data(proxy)["totals"]["requests"].values()) == total,
                what="every request to end",
            )
            wait_until(lambda: len(ids(driver)) == total, 20, "the table to list every request")
            wait_until(lambda: tiles(driver)["inflight"] == "0", 20, "in flight to return to 0")
            check_page(driver, expected, ui_data(proxy))
            save_screenshot(driver, "ui.png")
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not severe, f"the page logged errors: {severe}"


def ui_data(proxy: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{proxy}/ui/data").json()
    return data


def ids(driver: Any) -> list[str]:
    return [row[0] for row in driver.execute_script(ROWS)]


def tiles(driver: Any) -> dict[str, str]:
    found: dict[str, str] = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('.tile')]"
        ".map(t => [t.dataset.tile, t.querySelector('.value').textContent]))"
    )
    return found


def check_page(driver: Any, expected: list[tuple[str, str]], data: dict[str, Any]) -> None:
    js = driver.execute_script
    # The table: every request with its outcome, newest first (the order of /ui/data; the fake
    # upstream's requests went one after another).
    rows = [tuple(r) for r in js(ROWS)]
    assert sorted(rows) == sorted(expected)
    order = [r[0] for r in rows]
    assert order == [r["request_id"] for r in data["requests"]]
    assert order.index("gone-0") < order.index("error-0") < order.index("timeout-0") < order.index("fake-2")
    # Prefill and decode bars for a successful stream, only prefill and the rest for the timeout.
    segs = (
        "return [...document.querySelectorAll(`#requests tr[data-request-id='${arguments[0]}'] .seg`)]"
        ".map(s => s.classList[1])"
    )
    assert js(segs, expected[0][0])[:2] == ["prefill", "decode"]
    assert js(segs, "timeout-0") == ["prefill", "rest"]  # one token, then silence until the timeout
    # Latency charts per model with points on every quantile line.
    for model in ("sim-model", "fake-model"):
        for kind in ("ttft", "tpot"):
            for q in ("p50", "p90", "p99"):
                points = js(
                    "const g = document.querySelector(`[data-model='${arguments[0]}'] figure.${arguments[1]} "
                    "g[data-series='${arguments[2]}']`); return g ? Number(g.dataset.points) : -1",
                    model,
                    kind,
                    q,
                )
                assert points > 0, (model, kind, q)
    # Traffic charts: every outcome of the load has a line; tokens were drawn.
    series = js(
        "return [...document.querySelectorAll('#chart-requests g.series')].map(g => g.dataset.series)"
    )
    assert set(series) == {o for _, o in expected}
    assert js("return Number(document.querySelector('#chart-tokens svg').dataset.points)") > 0
    t = tiles(driver)
    assert (t["timeouts"], t["disconnects"], t["retries"], t["interrupted"]) == ("1", "1", "1", "0")
    upstreams = js(
        "return [...document.querySelectorAll('#upstreams tbody tr')]"
        ".map(r => [r.dataset.upstream, r.dataset.state])"
    )
    assert sorted(map(tuple, upstreams)) == [("fake", "up"), ("sim", "up")]
    assert "updated" in js("return document.getElementById('status').textContent")
    # The configuration panel says which configuration it shows (no reload here: start-up's).
    note = js("return document.getElementById('config-note').textContent")
    assert note.startswith("what new requests follow: as loaded at start; a reload applies upstreams"), note


def save_screenshot(driver: Any, name: str, docs: bool = False) -> None:
    """The whole page, not just the window; into artifacts/ (and docs/img/ui.png with `docs`)."""
    width, height = driver.execute_script(
        "const e = document.documentElement; return [e.scrollWidth, e.scrollHeight]"
    )
    clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    png = base64.b64decode(shot["data"])
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / name).write_bytes(png)
    if docs:
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        (ROOT / "docs" / "img" / "ui.png").write_bytes(png)
