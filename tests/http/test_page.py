"""The chat page at `/` in a real headless browser: Debian's chromium, driven by Playwright, against
a real aiohttp server on 127.0.0.1 whose engine is scripted (a word per delta, with pauses, so a
test can stop or reload mid-reply) and whose store is a real SQLite file.

`CHATD_SCREENSHOT=docs/chat-page.png pytest tests/http/test_page.py -k markdown` also saves the
screenshot the README shows.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from chatd.config_loader import build_config
from chatd.http.app import create_app
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

playwright_api = pytest.importorskip("playwright.async_api")
expect = playwright_api.expect

CHROMIUM = Path("/usr/bin/chromium")
# Headless Debian chromium with no background traffic (without the last four it floods a closed network with refused connects).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"]
DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}
# The longest a step waits for the page, and Playwright's expect too: generous, since a wait ends
# as soon as its condition holds and these tests share two busy cores.
WAIT_MS = 20_000
expect.set_options(timeout=WAIT_MS)

# One browser for the module (starting chromium is most of a test's time), so one event loop too.
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

LONG_REPLY = " ".join(f"word{i}" for i in range(150))  # 150 deltas: seconds to stream, time to stop or reload


class Chat:
    """The server and one browser tab on its page; `engine.replies` scripts what the model says."""

    def __init__(self, state, server: TestServer, page) -> None:
        self.state, self.server, self.page = state, server, page
        self.engine: ScriptedChatEngine = state.engine
        self.url = str(server.make_url("/"))
        self.errors: list[str] = []  # uncaught exceptions and CSP refusals seen by the page
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("console", lambda message: self.errors.append(message.text) if "Content Security Policy" in message.text else None)

    async def send(self, text: str) -> None:
        await self.page.fill("#input", text)
        await self.page.press("#input", "Enter")

    async def reply_done(self, count: int = 1):
        """The last reply on screen, once `count` replies have ended and none is streaming."""
        # Waits go through locators: the page's CSP refuses the eval that wait_for_function needs.
        await expect(self.page.locator(".message.assistant:not(.waiting)")).to_have_count(count)
        await expect(self.page.locator(".message.assistant.waiting")).to_have_count(0)
        return self.page.locator(".message.assistant").last

    async def reply_started(self) -> None:
        """Some of the reply being generated is on screen (it has not ended)."""
        await expect(self.page.locator(".message.assistant.waiting .content")).to_have_text(re.compile(r".{20}", re.DOTALL))

    async def user_messages(self) -> list[str]:
        return await self.page.locator(".message.user .content").all_inner_texts()

    async def api(self, path: str, key: str | None = None) -> dict:
        """What the API says, for checking what the page did."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as session, session.get(self.server.make_url(path), headers=headers) as response:
            return await response.json()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser():
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield browser
        await browser.close()


@pytest_asyncio.fixture(loop_scope="module")
async def open_chat(browser, tmp_path):
    """open_chat(viewport, auth, settings, **context) -> a Chat: a server of its own (`settings`: more
    of its config) and a fresh browser context on it (`context`: more of its options, e.g. timezone_id).
    Afterwards the page must have thrown nothing and the CSP refused nothing."""
    opened: list[tuple[Chat, object]] = []

    async def open_chat(viewport: dict = DESKTOP, auth: bool = False, settings: dict | None = None, **context) -> Chat:
        config = build_config({"auth": {"enabled": auth}, **(settings or {})})
        state = await make_server_state(ScriptedChatEngine(pause=0.02), tmp_path / f"server{len(opened)}", config)
        server = TestServer(create_app(state), host="127.0.0.1")
        await server.start_server()
        browser_context = await browser.new_context(viewport=viewport, **context)
        page = await browser_context.new_page()
        page.set_default_timeout(WAIT_MS)
        opened.append((Chat(state, server, page), browser_context))
        return opened[-1][0]

    yield open_chat
    for chat, context in opened:
        await context.close()
        await chat.server.close()
        await close_server_state(chat.state)
        assert chat.errors == []


@pytest_asyncio.fixture(loop_scope="module")
async def chat(open_chat) -> Chat:
    chat = await open_chat()
    await chat.page.goto(chat.url)
    return chat


async def test_a_reply_streams_in_as_markdown_with_its_speed_under_it(chat):
    chat.engine.pause = 0.04
    chat.engine.replies.append("Paged attention keeps the **KV cache** in blocks:\n\n- no fragmentation\n- prefixes are shared\n\n"
                               "```python\ndef admit(seq):\n    blocks = cache.allocate(seq, num_tokens=16)  # shared prefixes first\n"
                               "    return len(blocks) > 0\n```\n\nSo a turn costs only its *new* tokens.")
    await chat.send("How does chatd keep the KV cache?")
    await chat.reply_started()  # on screen while it is still being generated
    reply = await chat.reply_done()
    assert await reply.locator("strong").inner_text() == "KV cache"
    assert await reply.locator("li").all_inner_texts() == ["no fragmentation", "prefixes are shared"]
    assert "cache.allocate(seq, num_tokens=16)" in await reply.locator("pre code").inner_text()
    assert await reply.locator("pre code .hljs-keyword").all_inner_texts() == ["def", "return"]  # highlighted
    stats = await reply.locator(".stats").inner_text()
    assert "first token" in stats and "tokens/s" in stats and "tokens ·" in stats, stats
    # The conversation was made for it, titled by the message, and the sidebar lists it.
    assert await chat.page.locator("#conversations .open").all_inner_texts() == ["How does chatd keep the KV cache?"]
    if os.environ.get("CHATD_SCREENSHOT"):
        await chat.page.screenshot(path=os.environ["CHATD_SCREENSHOT"])


async def test_stop_ends_the_reply_and_keeps_what_was_generated(chat):
    chat.engine.replies.append(LONG_REPLY)
    await chat.send("Count for me")
    await chat.reply_started()
    await chat.page.click("#stop")
    reply = await chat.reply_done()
    assert "stopped" in await reply.locator(".stats .ended").inner_text()
    shown = await reply.locator(".content").inner_text()
    assert 20 < len(shown) < len(LONG_REPLY)
    assert chat.engine.aborted == {"scripted-1"}
    conversation = await chat.api(f"/v1/conversations/{chat.page.url.split('#')[1]}")
    saved = conversation["messages"][-1]
    assert saved["status"] == "partial" and saved["content"].strip() == shown.strip()
    # The conversation is free again: the next message gets its reply.
    assert await chat.page.locator("#send").is_visible() and not await chat.page.locator("#stop").is_visible()
    await chat.send("Now say hello")
    assert await (await chat.reply_done(2)).locator(".content").inner_text() == chat.engine.default


async def test_a_reload_mid_reply_picks_it_up_again(chat):
    chat.engine.pause = 0.015
    chat.engine.replies.append(LONG_REPLY)
    await chat.send("Count for me")
    await chat.reply_started()
    await chat.page.reload()
    await expect(chat.page.locator(".message.assistant.waiting")).to_have_count(1)  # followed again while it goes on
    reply = await chat.reply_done()
    assert await reply.locator(".content").inner_text() == LONG_REPLY
    assert await chat.user_messages() == ["Count for me"]
    assert chat.engine.num_requests == 1 and chat.engine.aborted == set()  # the same reply, not a new one


async def test_html_in_a_reply_or_a_message_never_runs(chat):
    chat.engine.replies.append('Look: <script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> '
                               '<b onmouseover="window.__pwned = 3">hover me</b> [click me](javascript:window.__pwned=4) '
                               '<iframe srcdoc="<script>parent.__pwned = 5</script>"></iframe> end')
    await chat.send('<img src=y onerror="window.__pwned = 6">')
    reply = await chat.reply_done()
    content = reply.locator(".content")
    await content.get_by_text("hover me").hover()
    await content.locator("a").click()
    assert await chat.page.evaluate("window.__pwned") is None
    assert await content.locator("script, iframe, img, b, [onerror], [onmouseover]").count() == 0
    assert await content.locator("a").get_attribute("href") is None
    # The model's raw HTML is shown as the text it wrote (never parsed, so not even refused by the CSP).
    text = await content.inner_text()
    assert '<img src=x onerror="window.__pwned = 2">' in text and '<b onmouseover="window.__pwned = 3">hover me</b>' in text
    assert text.endswith(" end")
    # The user's own message is shown as the text it is.
    assert await chat.user_messages() == ['<img src=y onerror="window.__pwned = 6">']


async def test_conversations_are_listed_newest_first_opened_renamed_and_deleted(chat):
    page = chat.page
    await page.click("#settings-summary")  # a new chat's settings are folded away
    await page.fill("#system-prompt", "Answer like a pirate.")
    await chat.send("first chat")
    await chat.reply_done()
    await page.click("#new-chat")
    await chat.send("second chat")
    await chat.reply_done()
    titles = page.locator("#conversations .open")
    assert await titles.all_inner_texts() == ["second chat", "first chat"]
    listed = (await chat.api("/v1/conversations"))["data"]
    assert [(c["title"], c["system_prompt"], c["model"]) for c in listed] == [
        ("second chat", None, "scripted"), ("first chat", "Answer like a pirate.", "scripted")]

    await titles.nth(1).click()  # opening one shows its messages and its system prompt
    await expect(page.locator("#title")).to_have_text("first chat")
    assert await chat.user_messages() == ["first chat"]
    assert await page.locator("#system-prompt").input_value() == "Answer like a pirate."

    # Renaming asks for the new title (a prompt dialog); the sidebar, the header and the API agree.
    page.once("dialog", lambda dialog: dialog.accept("Pirate talk"))
    await page.locator("#conversations li", has_text="first chat").locator(".rename").click()
    await expect(page.locator("#title")).to_have_text("Pirate talk")
    assert await titles.all_inner_texts() == ["second chat", "Pirate talk"]
    assert [c["title"] for c in (await chat.api("/v1/conversations"))["data"]] == ["second chat", "Pirate talk"]

    page.on("dialog", lambda dialog: dialog.accept())
    second = page.locator("#conversations li", has_text="second chat")
    await second.hover()
    await second.locator(".delete").click()
    await expect(page.locator("#conversations li")).to_have_count(1)
    await page.locator("#conversations li", has_text="Pirate talk").locator(".delete").click()  # the open one
    await expect(page.locator("#title")).to_have_text("New chat")
    assert await page.locator("#conversations li").count() == 0 and await page.locator("#welcome").is_visible()
    assert (await chat.api("/v1/conversations"))["data"] == []


async def test_with_auth_on_the_page_asks_for_a_key_and_keeps_it_in_the_browser(open_chat):
    chat = await open_chat(auth=True)
    key, _ = await chat.state.store.create_key("alice", "paid")
    await chat.page.goto(chat.url)
    await expect(chat.page.locator("#key-form")).to_be_visible()
    assert "needs an API key" in await chat.page.locator("#error").inner_text()
    await chat.page.fill("#api-key", key)
    await chat.page.click("#key-form button[type=submit]")
    await expect(chat.page.locator("#error")).to_be_hidden()
    await chat.send("hello with a key")
    await chat.reply_done()
    assert await chat.page.evaluate("localStorage.getItem('chatd.apiKey')") == key
    assert [c["title"] for c in (await chat.api("/v1/conversations", key))["data"]] == ["hello with a key"]


async def test_a_message_sent_before_the_models_are_listed_goes_to_the_servers_model(open_chat):
    chat = await open_chat()
    listed = asyncio.Event()

    async def held(route):  # GET /v1/models answers only once the message is sent
        await listed.wait()
        await route.continue_()

    await chat.page.route("**/v1/models", held)
    await chat.page.goto(chat.url)
    await chat.send("hello before the models")
    await chat.reply_done()
    listed.set()
    await expect(chat.page.locator("#model option")).to_have_text(["scripted"])
    assert (await chat.api(f"/v1/conversations/{chat.page.url.split('#')[1]}"))["model"] == "scripted"
    assert await chat.user_messages() == ["hello before the models"]


async def test_on_a_phone_nothing_scrolls_sideways_and_the_sidebar_slides_in(open_chat):
    chat = await open_chat(viewport=PHONE)
    await chat.page.goto(chat.url)
    chat.engine.replies.append("A long line:\n\n```python\nx = [" + ", ".join(map(str, range(80))) + "]\n```\n\n"
                               + "| a | b | c | d | e |\n|---|---|---|---|---|\n| " + " | ".join(["wide-cell-" * 3] * 5) + " |")
    await chat.send("hello from a phone")
    await chat.reply_done()
    sidebar = chat.page.locator("#sidebar")
    await expect(sidebar).not_to_be_in_viewport()
    # The page itself never scrolls sideways: a long code line or table scrolls in its own box.
    assert await chat.page.evaluate("document.scrollingElement.scrollWidth <= innerWidth")
    for part in ("#composer", "#input", "#send", ".message.assistant .actions", "#export"):
        box = await chat.page.locator(part).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], part
    await chat.page.click("#settings-summary")  # the settings open without widening the page
    await expect(chat.page.locator("#max-tokens")).to_be_in_viewport()
    assert await chat.page.evaluate("document.scrollingElement.scrollWidth <= innerWidth")
    await chat.page.click("#settings-summary")
    await chat.send("and a second message")
    await chat.reply_done(2)
    await chat.page.click("#menu")
    await expect(sidebar).to_be_in_viewport(ratio=1)
    await chat.page.click("#new-chat")  # and it slides away again
    await expect(sidebar).not_to_be_in_viewport()
