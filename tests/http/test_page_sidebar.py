"""The chat page's sidebar, in headless Chromium (test_page.py's harness): conversations grouped by
the day they were started, each title whole on hover, a search box that filters them by title, and
a title that follows its first message when that message is edited.

Every wait here is for a condition (test_page.py's WAIT_MS): these tests share two busy cores."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
import pytest

from tests.http.test_page import CHROMIUM, Chat, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

NOON = datetime(2026, 3, 18, 12, tzinfo=UTC).timestamp()  # the browser's "now" (in UTC)
HOUR, DAY = 3600, 86400
LONG_TITLE = "How the scheduler admits a request when the KV cache is nearly full, and what it preempts first"
STARTED = {  # title -> when the conversation was started
    "Paged attention this morning": NOON - 3 * HOUR,
    LONG_TITLE: NOON - 5 * HOUR,
    "Speculative decoding last night": NOON - 14 * HOUR,  # 22:00 the day before
    "Prefix caching on Monday": NOON - 2 * DAY,
    "Quantization a week ago": NOON - 7 * DAY,
    "Paged attention last month": NOON - 30 * DAY,
}


async def start_conversations(chat: Chat) -> None:
    """Make STARTED's conversations through the API, each at its time (the store's clock)."""
    clock = chat.state.store._clock
    try:
        async with aiohttp.ClientSession() as session:
            for title, started in STARTED.items():
                chat.state.store._clock = lambda started=started: started
                async with session.post(chat.server.make_url("/v1/conversations"), json={"title": title}) as response:
                    assert response.status == 200, await response.text()
    finally:
        chat.state.store._clock = clock


async def shown_groups(chat: Chat) -> dict[str, list[str]]:
    """The sidebar as shown: each day's heading and the titles under it."""
    groups = {}
    for i, heading in enumerate(await chat.page.locator("#conversations h2").all_inner_texts()):
        groups[heading] = await chat.page.locator("#conversations ul").nth(i).locator(".open").all_inner_texts()
    return groups


async def test_conversations_are_grouped_by_day_titled_whole_on_hover_and_searched(open_chat):
    chat = await open_chat(timezone_id="UTC")
    await start_conversations(chat)
    await chat.page.clock.set_fixed_time(NOON)
    await chat.page.goto(chat.url)
    headings = chat.page.locator("#conversations h2")
    await expect(headings).to_have_text(["Today", "Yesterday", "Previous 7 days", "Older"])
    assert await shown_groups(chat) == {
        "Today": ["Paged attention this morning", LONG_TITLE],
        "Yesterday": ["Speculative decoding last night"],
        "Previous 7 days": ["Prefix caching on Monday", "Quantization a week ago"],
        "Older": ["Paged attention last month"],
    }
    # Each group is a list named by its heading, as a screen reader reads it.
    await expect(chat.page.get_by_role("list", name="Yesterday").get_by_role("listitem")).to_have_count(1)

    # A title too long for its row is cut there, and whole on hover.
    long = chat.page.locator("#conversations .open", has_text="How the scheduler")
    assert await long.evaluate("element => element.scrollWidth > element.clientWidth")
    await expect(long).to_have_attribute("title", LONG_TITLE)

    # The search keeps the titles that have what is typed, in any case; groups left empty go.
    search = chat.page.get_by_role("searchbox", name="Search conversations")
    await search.fill("paged ATTENTION")
    await expect(headings).to_have_text(["Today", "Older"])
    assert await shown_groups(chat) == {"Today": ["Paged attention this morning"], "Older": ["Paged attention last month"]}
    await search.fill("flash attention")
    await expect(chat.page.locator("#conversations li")).to_have_count(0)
    await expect(chat.page.locator("#no-match")).to_have_text("No conversation's title has “flash attention”.")
    await search.fill("")
    await expect(chat.page.locator("#conversations li")).to_have_count(len(STARTED))
    await expect(chat.page.locator("#no-match")).to_be_hidden()
    # A match opens as any conversation does.
    await search.fill("speculative")
    await chat.page.locator("#conversations .open").click()
    await expect(chat.page.locator("#title")).to_have_text("Speculative decoding last night")


async def test_a_title_taken_from_the_first_message_follows_its_edit(chat):
    page = chat.page
    await chat.send("What is paged attention?")
    await chat.reply_done()
    await chat.send("And prefix caching?")
    await chat.reply_done(2)
    await expect(page.locator("#title")).to_have_text("What is paged attention?")

    # Editing the first message retitles the conversation: the header, the sidebar and the API agree.
    await page.locator(".message.user").first.get_by_role("button", name="Edit message").click()
    editor = page.locator(".message.user textarea.editor")
    await editor.fill("What is paged attention in vLLM?\nAnswer briefly.")
    await editor.press("Enter")
    await chat.reply_done()
    await expect(page.locator("#title")).to_have_text("What is paged attention in vLLM?")
    await expect(page.locator("#conversations .open")).to_have_text(["What is paged attention in vLLM?"])
    conversation_id = page.url.split("#")[1]
    assert (await chat.api(f"/v1/conversations/{conversation_id}"))["title"] == "What is paged attention in vLLM?"

    # A conversation renamed by hand keeps its name when the first message is edited again.
    page.once("dialog", lambda dialog: dialog.accept("Attention notes"))
    await page.locator("#conversations li").first.get_by_role("button", name="Rename “What is paged attention in vLLM?”").click()
    await expect(page.locator("#title")).to_have_text("Attention notes")
    await page.locator(".message.user").first.get_by_role("button", name="Edit message").click()
    await editor.fill("What is attention?")
    await editor.press("Enter")
    await expect(chat.page.locator(".message.user .content")).to_have_text(["What is attention?"])
    await chat.reply_done()
    assert (await chat.api(f"/v1/conversations/{conversation_id}"))["title"] == "Attention notes"
    await expect(page.locator("#title")).to_have_text("Attention notes")
