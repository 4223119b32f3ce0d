"""Thumbs up and down under the chat page's replies, in headless Chromium (test_page.py's harness):
a rating is what the server keeps (its store and /metrics), a thumbs down takes an optional comment,
the pressed button is the rating the server accepted (a refusal says why and changes nothing), a
rating survives switching conversations, and the thumbs fit a phone.

Every wait here is for a condition, with a long limit: these tests share two busy cores."""

from __future__ import annotations

import re

import aiohttp
import pytest

from tests.http.test_page import CHROMIUM, PHONE, Chat, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

WAIT_MS = 20_000  # a condition's limit: generous, since it returns as soon as the condition holds
COMMENT = "It named the wrong river."


async def finished_reply(chat: Chat, count: int = 1):
    """The last reply on screen, once `count` replies have ended and none is streaming."""
    await expect(chat.page.locator(".message.assistant:not(.waiting)")).to_have_count(count, timeout=WAIT_MS)
    await expect(chat.page.locator(".message.assistant.waiting")).to_have_count(0, timeout=WAIT_MS)
    return chat.page.locator(".message.assistant").last


def thumbs(reply):
    """A reply's thumbs up and thumbs down, found as a screen reader names them."""
    return reply.get_by_role("button", name="Good reply", exact=True), reply.get_by_role("button", name="Bad reply", exact=True)


async def pressed(up, down, rating: str | None) -> None:
    """Wait until the thumbs show `rating` (None: neither pressed)."""
    await expect(up).to_have_attribute("aria-pressed", str(rating == "up").lower(), timeout=WAIT_MS)
    await expect(down).to_have_attribute("aria-pressed", str(rating == "down").lower(), timeout=WAIT_MS)


async def kept(chat: Chat) -> dict[str, tuple[str, str | None]]:
    """The ratings the server's store keeps: reply id -> (rating, comment)."""
    return {rated.target_id: (rated.rating, rated.comment) for rated in await chat.state.store.list_feedback()}


async def last_reply_id(chat: Chat) -> str:
    """The id of the open conversation's last message, as the API gives it."""
    return (await chat.api(f"/v1/conversations/{chat.page.url.split('#')[1]}"))["messages"][-1]["id"]


async def counted(chat: Chat) -> dict[str, float]:
    """/metrics' chatd:feedback_total, by rating."""
    async with aiohttp.ClientSession() as session, session.get(chat.server.make_url("/metrics")) as response:
        metrics = await response.text()
    found = re.findall(r'^chatd:feedback_total\{[^}]*rating="(\w+)"[^}]*\} (\S+)$', metrics, re.MULTILINE)
    return {rating: float(value) for rating, value in found}


async def test_thumbs_up_then_down_with_a_comment_are_what_the_server_keeps(chat):
    chat.page.set_default_timeout(WAIT_MS)
    chat.engine.replies.append("The Seine flows through Lyon.")
    await chat.send("Which river flows through Lyon?")
    reply = await finished_reply(chat)
    up, down = thumbs(reply)
    await pressed(up, down, None)
    await expect(up).to_be_in_viewport(ratio=1, timeout=WAIT_MS)
    await expect(down).to_be_in_viewport(ratio=1, timeout=WAIT_MS)
    reply_id = await last_reply_id(chat)

    await up.click()
    await pressed(up, down, "up")
    assert await kept(chat) == {reply_id: ("up", None)}
    assert await counted(chat) == {"up": 1, "down": 0}

    # A thumbs down is sent at once, and asks what was wrong.
    await down.click()
    await pressed(up, down, "down")
    comment = reply.get_by_role("textbox", name="What was wrong with this reply")
    await expect(comment).to_be_focused(timeout=WAIT_MS)
    assert await kept(chat) == {reply_id: ("down", None)}
    await comment.fill(COMMENT)
    await reply.get_by_role("button", name="Send", exact=True).click()
    await expect(comment).to_have_count(0, timeout=WAIT_MS)  # closed once the server took it
    assert await kept(chat) == {reply_id: ("down", COMMENT)}
    assert await counted(chat) == {"up": 1, "down": 1}  # the comment is not a second thumbs down
    await pressed(up, down, "down")

    # Another conversation's reply starts unrated; coming back, this one is still down.
    await chat.page.click("#new-chat")
    await chat.send("And through Paris?")
    other_up, other_down = thumbs(await finished_reply(chat))
    await pressed(other_up, other_down, None)
    await chat.page.locator("#conversations .open", has_text="Which river flows through Lyon?").click()
    await expect(chat.page.locator(".message.assistant .content")).to_have_text(["The Seine flows through Lyon."], timeout=WAIT_MS)
    up, down = thumbs(await finished_reply(chat))
    await pressed(up, down, "down")
    # The pressed thumbs down opens the comment as sent, without rating again; Escape closes it.
    await down.click()
    await expect(comment).to_have_value(COMMENT, timeout=WAIT_MS)
    await comment.press("Escape")
    await expect(comment).to_have_count(0, timeout=WAIT_MS)
    await expect(down).to_be_focused(timeout=WAIT_MS)
    assert await counted(chat) == {"up": 1, "down": 1}  # the comment is not a second thumbs down
    assert await kept(chat) == {reply_id: ("down", COMMENT)}


async def test_a_refused_rating_says_why_and_leaves_the_thumbs_as_they_were(chat):
    page = chat.page
    page.set_default_timeout(WAIT_MS)
    await chat.send("Rate me")
    reply = await finished_reply(chat)
    up, down = thumbs(reply)
    reply_id = await last_reply_id(chat)
    await up.click()
    await pressed(up, down, "up")

    # A server error: its message on the error line, the thumbs as they were, no comment box.
    error = {"message": "the store is busy", "type": "server_error", "param": None, "code": None}
    await page.route("**/v1/feedback", lambda route: route.fulfill(status=500, json={"error": error}))
    await down.click()
    await expect(page.locator("#error-text")).to_have_text("the store is busy.", timeout=WAIT_MS)
    await pressed(up, down, "up")
    await expect(reply.locator(".feedback")).to_have_count(0)
    assert await kept(chat) == {reply_id: ("up", None)}
    await page.unroute("**/v1/feedback")
    await page.click("#retry")  # Retry sends it again
    await pressed(up, down, "down")
    await expect(page.locator("#error")).to_be_hidden(timeout=WAIT_MS)
    assert await kept(chat) == {reply_id: ("down", None)}

    # No answer at all: the page's own words for it.
    await page.route("**/v1/feedback", lambda route: route.abort("connectionrefused"))
    await up.click()
    origin = chat.url.rstrip("/")
    await expect(page.locator("#error-text")).to_have_text(f"Cannot reach the chatd server at {origin}: is it running?",
                                                           timeout=WAIT_MS)
    await pressed(up, down, "down")
    await page.unroute("**/v1/feedback")

    # A comment the server refuses stays in its box, to send again.
    await down.click()  # already down: it opens the box without rating again
    comment = reply.get_by_role("textbox", name="What was wrong with this reply")
    await comment.fill(COMMENT)
    refusal = {"message": "comment must be a string of at most 2000 characters", "type": "invalid_request_error",
               "param": "comment", "code": None}
    await page.route("**/v1/feedback", lambda route: route.fulfill(status=400, json={"error": refusal}))
    send = reply.get_by_role("button", name="Send", exact=True)
    await send.click()
    await expect(page.locator("#error-text")).to_have_text(refusal["message"] + ".", timeout=WAIT_MS)
    await expect(comment).to_have_value(COMMENT, timeout=WAIT_MS)
    await pressed(up, down, "down")
    await page.unroute("**/v1/feedback")
    await send.click()
    await expect(comment).to_have_count(0, timeout=WAIT_MS)
    assert await kept(chat) == {reply_id: ("down", COMMENT)}

    # The server's own 404: the conversation was deleted elsewhere, so its reply can no longer be rated.
    async with aiohttp.ClientSession() as session:
        await session.delete(chat.server.make_url(f"/v1/conversations/{page.url.split('#')[1]}"))
    await up.click()
    await expect(page.locator("#error-text")).to_have_text(f"you have no reply '{reply_id}' to rate.", timeout=WAIT_MS)
    await pressed(up, down, "down")
    assert await kept(chat) == {reply_id: ("down", COMMENT)}


async def test_on_a_phone_the_thumbs_and_the_comment_box_fit(open_chat):
    chat = await open_chat(viewport=PHONE)
    chat.page.set_default_timeout(WAIT_MS)
    await chat.page.goto(chat.url)
    chat.engine.replies.append("A reply long enough to wrap on a phone, with its stats and buttons under it.")
    await chat.send("hello from a phone")
    reply = await finished_reply(chat)
    up, down = thumbs(reply)
    for thumb in (up, down):
        await expect(thumb).to_be_in_viewport(ratio=1, timeout=WAIT_MS)
        box = await thumb.bounding_box()
        assert 0 <= box["x"] and box["x"] + box["width"] <= PHONE["width"]
        assert 0 <= box["y"] and box["y"] + box["height"] <= PHONE["height"]
        assert box["width"] >= 24 and box["height"] >= 24  # big enough for a finger
    await down.click()
    await pressed(up, down, "down")
    comment = reply.get_by_role("textbox", name="What was wrong with this reply")
    await expect(comment).to_be_in_viewport(timeout=WAIT_MS)
    for part in (comment, reply.get_by_role("button", name="Send", exact=True), reply.get_by_role("button", name="Cancel")):
        box = await part.bounding_box()
        assert 0 <= box["x"] and box["x"] + box["width"] <= PHONE["width"]
    assert await chat.page.evaluate("document.scrollingElement.scrollWidth <= innerWidth")
    await reply.get_by_role("button", name="Cancel").click()
    await expect(comment).to_have_count(0, timeout=WAIT_MS)
    assert (await kept(chat)).popitem()[1] == ("down", None)
