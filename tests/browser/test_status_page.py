"""/status rendered by a real headless Chromium over a fleet of 8 fake instances.

Chromium is Debian's package (`make system-packages` installs it); Playwright only drives it, so nothing is
downloaded at test time. Set EPD_UPDATE_SCREENSHOT=1 to refresh docs/status.png for the docs' status page.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from pathlib import Path

import pytest
from playwright.async_api import async_playwright

from epd_proxy_tools.testing.polling import eventually
from tests.media import chat, image

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# A common laptop screen, minus the browser's own toolbars.
VIEWPORT = {"width": 1366, "height": 680}
WAIT_S = 30.0


def chromium_path() -> str:
    path = os.environ.get("EPD_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no chromium on PATH: `make system-packages` installs Debian's package (as root)")
    return path


async def wait_until(page, expression: str, arg=None) -> None:
    """Poll an expression in the page. Playwright's wait_for_function would evaluate a string
    inside the page, which the page's Content-Security-Policy (no eval) rightly refuses."""
    await eventually(
        lambda: page.evaluate(expression, arg),
        timeout=WAIT_S,
        interval=0.1,
        what=f"page never satisfied {expression} ({arg})",
    )


async def drive(stack, stop: asyncio.Event) -> None:
    """Closed-loop traffic with six images per request, until told to stop."""
    n = 0
    while not stop.is_set():
        n += 1
        with contextlib.suppress(Exception):
            async with await stack.chat(chat(*(image(f"{n}-{i}") for i in range(6)))) as resp:
                await resp.read()


async def test_status_page_in_chromium(make_stack, tmp_path):
    stack = await make_stack(encoders=4, prefills=2, decoders=2, probe_interval_s=0.2, fail_threshold=2)
    for fake in stack.encoders:
        fake.faults.delay_s = 0.02  # long enough that in-flight counts show
    for n in range(12):
        async with await stack.chat(chat(image(f"warm{n}"), image(f"warm{n}b"))) as resp:
            assert resp.status == 200
    # A client's bad JSON: a client error, not a failure of the proxy.
    async with await stack.chat(b"{not json") as resp:
        assert resp.status == 400
    stop = asyncio.Event()
    load = [asyncio.create_task(drive(stack, stop)) for _ in range(3)]
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
            try:
                page = await browser.new_page(viewport=VIEWPORT)
                # A script error or a Content-Security-Policy refusal shows up here.
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
                await page.goto(f"{stack.url}/status")
                # At least one refresh after the first render: the page keeps itself current.
                await wait_until(page, "() => Number(document.body.dataset.refreshes || 0) >= 2")

                rows = page.locator("#roster tbody tr")
                assert await rows.count() == 8
                roles = [await rows.nth(i).get_attribute("data-role") for i in range(8)]
                assert roles == ["encode"] * 4 + ["prefill"] * 2 + ["decode"] * 2
                assert await page.locator("#roster tbody tr[data-state='in rotation']").count() == 8
                assert float(await page.text_content("#rate")) > 0
                # Health detail: ejection counts and the age of the last active check.
                first = rows.nth(0).locator("td")
                assert await first.nth(5).text_content() == "0"
                assert (await first.nth(6).text_content()).endswith(" ago")
                # The encoder scheduler's speed estimate, for encoders only.
                assert float(await first.nth(7).text_content()) > 0
                assert await rows.nth(7).locator("td").nth(7).text_content() == "–"
                # How each consumer receives encoder output: prefill's shared store; none for others.
                assert await rows.nth(4).locator("td").nth(8).text_content() == "store"
                assert "reuse of held media: yes" in await rows.nth(4).locator("td").nth(8).get_attribute("title")
                assert await first.nth(8).text_content() == "–"
                assert await page.locator("#latency tbody tr").count() == 4
                assert (await page.text_content("#latency tr[data-stage='encode'] td:nth-child(2)")).endswith("ms")
                assert await page.locator("#mix tbody tr[data-status='200']").count() == 1
                assert float(await page.text_content("#images")) > 0
                # The window's slowest requests, each with the stage it waited in longest.
                assert await page.locator("#slowest tbody tr[data-waited-in]").count() == 5
                total = await page.text_content("#slowest tbody tr:first-child td:nth-child(3)")
                assert re.fullmatch(r"\d+(\.\d+)? m?s", total), total
                # Long ids and stage names stay inside the card (its columns are fixed).
                assert await page.evaluate(
                    "(() => { const t = document.querySelector('#slowest');"
                    " return t.scrollWidth <= t.parentElement.clientWidth; })()"
                )
                # 4xx apart from failures: the bad JSON does not lower the success rate.
                assert await page.text_content("#success") == "100.0%"
                assert await page.get_attribute("#success-sub", "data-client-errors") == "1"
                assert await page.get_attribute("#success-sub", "data-failed") == "0"
                # The live chart: a line per series, the encoder backlog sampled at every refresh.
                for chart in ("rate", "latency", "backlog"):
                    await wait_until(
                        page,
                        "id => [...document.querySelectorAll(`#chart-${id} polyline`)]"
                        ".every(line => Number(line.dataset.points) >= 2)",
                        chart,
                    )
                assert await page.locator("#chart-latency polyline").count() == 2

                # Readable without scrolling on a laptop screen, for 8 instances.
                overflow = await page.evaluate(
                    "[document.documentElement.scrollWidth - innerWidth,"
                    " document.documentElement.scrollHeight - innerHeight]"
                )
                assert overflow[0] <= 0 and overflow[1] <= 0, f"page overflows the viewport by {overflow}"

                stopped = stack.backend_urls["e"][3]
                await stack.servers[3].close()
                row = page.locator(f"#roster tbody tr[data-url='{stopped}']")
                await wait_until(
                    page,
                    "url => ['ejected', 'down'].includes("
                    "document.querySelector(`#roster tr[data-url='${url}']`).dataset.state)",
                    stopped,
                )
                assert (await row.locator("td.state").text_content()).startswith(("ejected", "down"))
                assert await page.locator("#roster tbody tr[data-state='in rotation']").count() == 7

                shot = tmp_path / "status.png"
                await page.screenshot(path=str(shot))
                assert shot.stat().st_size > 10_000
                assert errors == []
                if os.environ.get("EPD_UPDATE_SCREENSHOT"):
                    docs = Path(__file__).resolve().parents[2] / "docs" / "status.png"
                    docs.parent.mkdir(exist_ok=True)
                    shutil.copyfile(shot, docs)
            finally:
                await browser.close()
    finally:
        stop.set()
        await asyncio.gather(*load)


async def test_status_page_asks_for_the_admin_key_behind_a_client_key(make_stack):
    stack = await make_stack(encoders=1, api_key="client-secret", admin_api_key="admin-secret")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            page = await browser.new_page(viewport=VIEWPORT)
            script_errors: list[str] = []
            page.on("pageerror", lambda exc: script_errors.append(str(exc)))
            await page.goto(f"{stack.url}/status")
            asking = "() => getComputedStyle(document.getElementById('key')).display === 'block'"
            await wait_until(page, asking)
            assert await page.locator("#roster tbody tr").count() == 0
            # A wrong key is asked for again; the right one shows the fleet.
            await page.fill("#key-input", "guess")
            await page.press("#key-input", "Enter")
            await wait_until(page, "() => document.getElementById('key-input').value === ''")
            await wait_until(page, asking)
            await page.fill("#key-input", "admin-secret")
            await page.click("#key-go")
            await wait_until(page, "() => Number(document.body.dataset.refreshes || 0) >= 2")
            assert await page.locator("#roster tbody tr").count() == 2
            assert await page.evaluate("getComputedStyle(document.getElementById('key')).display") == "none"
            assert script_errors == []
        finally:
            await browser.close()
