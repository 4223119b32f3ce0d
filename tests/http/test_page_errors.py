"""What the chat page says when it cannot do what was asked, in headless Chromium (test_page.py's
harness): the server unreachable, a 429 with its wait, a 503 while the server drains, the content
filter on a message or a reply, and which key to type (the key database's, or the one shared key)."""

from __future__ import annotations

import asyncio

import pytest

from tests.http.test_page import CHROMIUM, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

THREAT = "I'm going to kill you tomorrow."  # blocked by the shipped safety policies (tests/http/test_safety.py)
SHARED_KEY = "sk-page-shared-41"


async def test_an_unreachable_server_is_named_and_retry_picks_up(open_chat):
    chat = await open_chat()
    page = chat.page
    origin = chat.url.rstrip("/")
    await page.route("**/v1/models", lambda route: route.abort("connectionrefused"))
    await page.goto(chat.url)
    await expect(page.locator("#error-text")).to_have_text(f"Cannot reach the chatd server at {origin}: is it running?")
    await page.unroute("**/v1/models")
    await page.click("#retry")
    await expect(page.locator("#error")).to_be_hidden()
    await expect(page.locator("#model option")).to_have_text(["scripted"])

    # A message that never reached the server comes back to the composer, and Retry sends it.
    await page.route("**/messages", lambda route: route.abort("connectionrefused"))
    await chat.send("are you there?")
    await expect(page.locator("#error-text")).to_have_text(f"Cannot reach the chatd server at {origin}: is it running?")
    assert await page.locator("#input").input_value() == "are you there?"
    assert await chat.user_messages() == []
    await page.unroute("**/messages")
    await page.click("#retry")
    await chat.reply_done()
    assert await chat.user_messages() == ["are you there?"]
    assert "Failed to fetch" not in await page.locator("body").inner_text()


async def test_a_rate_limit_says_how_long_to_wait(open_chat):
    chat = await open_chat(auth=True, settings={"tiers": {"trial": {"requests_per_minute": 1}}})
    key, _ = await chat.state.store.create_key("carol", "trial")
    await chat.page.goto(chat.url)
    await chat.page.fill("#api-key", key)
    await chat.page.click("#key-form button[type=submit]")
    await chat.send("one")
    await chat.reply_done()
    await chat.send("two")  # the tier's one request a minute is spent
    error = chat.page.locator("#error-text")
    await expect(error).to_contain_text("Too many requests: rate limit reached for requests per minute (tier trial)")
    assert (await error.inner_text()).endswith(tuple(f"Try again in {s} s." for s in range(55, 61)))
    await expect(chat.page.locator("#retry")).to_be_visible()
    assert await chat.page.locator("#input").input_value() == "two" and await chat.user_messages() == ["one"]


async def test_a_draining_server_is_a_503_with_its_wait_and_retry_sends_once_it_serves(chat):
    # The page has loaded its model and conversation lists: the drain refuses the message, not those
    # (a refused list load would put its own Retry on the button; seen once in CI).
    await chat.page.wait_for_load_state("networkidle")
    chat.state.draining_until = asyncio.get_running_loop().time() + 30
    try:
        await chat.send("during the drain")
        error = chat.page.locator("#error-text")
        await expect(error).to_contain_text("The server cannot take this now: the server is shutting down")
        await expect(error).to_contain_text("Try again in 30 s.")
    finally:
        chat.state.draining_until = None
    await chat.page.click("#retry")
    await chat.reply_done()
    assert await chat.user_messages() == ["during the drain"]


async def test_the_content_filter_refuses_a_message_and_stops_a_reply(open_chat):
    chat = await open_chat(settings={"safety": {"check_input": True, "check_output": True}})
    await chat.page.goto(chat.url)
    chat.engine.replies.append("Sure. Here is a long enough start of a story. " + THREAT + " More words.")
    await chat.send("Tell me a story.")
    reply = await chat.reply_done()
    assert await reply.locator(".stats .ended").inner_text() == "stopped by the content filter"
    assert "kill" not in await reply.locator(".content").inner_text()
    await chat.page.reload()  # and so it stays, as saved
    assert await (await chat.reply_done()).locator(".stats .ended").inner_text() == "stopped by the content filter"
    await chat.send(THREAT)
    await expect(chat.page.locator("#error-text")).to_contain_text("harassment")
    assert await chat.page.locator("#input").input_value() == THREAT
    assert await chat.user_messages() == ["Tell me a story."]


async def test_with_one_shared_key_the_page_asks_for_the_key_the_server_was_started_with(open_chat):
    chat = await open_chat(settings={"auth": {"api_key": SHARED_KEY}})
    page = chat.page
    await page.goto(chat.url)
    where = "the key given to `chatd serve --api-key` or CHATD_API_KEY"
    await expect(page.locator("#error-text")).to_have_text(f"This server needs an API key: {where}.")
    await page.fill("#api-key", "sk-wrong")
    await page.click("#key-form button[type=submit]")
    await expect(page.locator("#error-text")).to_have_text(f"The server refused this API key: {where}.")
    assert "keys create" not in await page.locator("body").inner_text()
    await page.fill("#api-key", SHARED_KEY)
    await page.click("#key-form button[type=submit]")
    await expect(page.locator("#error")).to_be_hidden()
    await chat.send("hello with the shared key")
    await chat.reply_done()
