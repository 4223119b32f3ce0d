"""The chat page on a real `chatd serve` with two models and an alias: the picker lists the chat
models (not the embedding model) and says which one loads on first use, and a conversation
started on the one picked is served by it, turn after turn."""

from __future__ import annotations

import sqlite3

import aiohttp
import pytest

from chatd.engine.models.demo import build_demo_model, build_model_dir
from tests.http.serving import start_server, stop_server
from tests.http.test_page import CHROMIUM, CHROMIUM_FLAGS, WAIT_MS

playwright_api = pytest.importorskip("playwright.async_api")
expect = playwright_api.expect

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

CONFIG = """
[model]
device = "cpu"
compile = false
[[models]]
name = "small"
path = "{demo}"
[[models]]
name = "qwen"
path = "{qwen}"
[aliases.chat]
targets = {{ small = 1, qwen = 1 }}
"""


async def test_the_page_picks_a_model_and_its_conversation_stays_on_it(tmp_path):
    demo, qwen = build_demo_model(tmp_path / "demo"), build_model_dir(tmp_path / "qwen", "qwen2", seed=3)
    proc, url, _ = start_server(tmp_path, demo, CONFIG.format(demo=demo, qwen=qwen))
    try:
        async with playwright_api.async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
            page = await browser.new_page()
            page.set_default_timeout(WAIT_MS)
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            await page.goto(url + "/")
            options = page.locator("#model option")
            await expect(options).to_have_text(["small", "qwen (loads on first use)", "chat"])
            await page.click("#settings-summary")  # a new chat's settings, the model among them, are folded away
            await page.select_option("#model", "qwen")
            for turn, text in enumerate(("first question", "second question"), start=1):
                await page.fill("#input", text)
                await page.press("#input", "Enter")
                await expect(page.locator(".message.assistant:not(.waiting)")).to_have_count(turn, timeout=60_000)
            assert await page.locator("#model").is_disabled()  # a conversation keeps its model
            await browser.close()
        assert errors == []
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/conversations") as r:
                [conversation] = (await r.json())["data"]
            async with session.get(f"{url}/v1/models/qwen") as r:
                assert (await r.json())["status"] == "loaded"
        assert conversation["model"] == "qwen"
    finally:
        stop_server(proc)
    [db] = (tmp_path / "home").rglob("*.db")
    with sqlite3.connect(db) as connection:  # both turns were billed to the model picked
        assert [m for (m,) in connection.execute("SELECT model FROM usage_events")] == ["qwen", "qwen"]
