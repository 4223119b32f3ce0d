"""What a reply shows besides its text, in headless Chromium (test_page.py's harness): a bar over each
code block with its language and a Copy button that copies the code exactly, a Continue button under
a reply the token limit cut, and an indicator while the first token is awaited.

Every wait here is for a condition (test_page.py's WAIT_MS): these tests share two busy cores."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from chatd.engine import FinishReason
from tests.factories import ScriptedReply
from tests.http.test_page import CHROMIUM, Chat, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

CONTINUE_PROMPT = "Continue from exactly where your last reply stopped."  # chat.js's


class CutReply(ScriptedReply):
    """A scripted reply cut at its request's max_tokens words (a token a word), as the engine cuts at the limit."""

    async def __aiter__(self):
        count = 0
        async with contextlib.aclosing(super().__aiter__()) as outputs:
            async for out in outputs:
                count += 1
                if count == self.params.max_tokens and not out.finished:
                    out.outputs[0].finish_reason, out.finished = FinishReason.LENGTH, True
                    yield out
                    return
                yield out


class HeldReply(ScriptedReply):
    """A scripted reply that says nothing until its engine's `go` event is set."""

    async def __aiter__(self):
        await self.engine.go.wait()
        async with contextlib.aclosing(super().__aiter__()) as outputs:
            async for out in outputs:
                yield out


def replies_as(chat: Chat, kind: type[ScriptedReply]) -> None:
    """Make the chat's engine answer with `kind` of reply (same texts, same ids)."""
    generate = chat.engine.generate

    def generate_as(*args, **named):
        reply = generate(*args, **named)
        return kind(reply.engine, reply.request_id, reply.prompt, reply.text, reply.params)

    chat.engine.generate = generate_as


async def test_a_code_block_names_its_language_and_copies_its_code_exactly(open_chat):
    chat = await open_chat()
    await chat.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    await chat.page.goto(chat.url)
    python = 'def greet(name):\n    print(f"hello {name} <&> `ok`")\n\n    return None'
    shell = "ls -la | grep '\\.py$'"
    chat.engine.replies.append(f"Two blocks:\n\n```python\n{python}\n```\n\nand one with no language:\n\n```\n{shell}\n```\n\nDone.")
    await chat.send("Show me code")
    reply = await chat.reply_done()
    blocks = reply.locator(".code-block")
    await expect(blocks).to_have_count(2)
    await expect(blocks.locator(".code-language")).to_have_text(["python", "text"])
    assert await blocks.nth(0).locator("pre code .hljs-keyword").count() > 0  # still highlighted
    for block, code in zip((blocks.nth(0), blocks.nth(1)), (python, shell), strict=True):
        await block.get_by_role("button", name="Copy code").click()
        await expect(block.locator(".code-copy")).to_have_accessible_name("Copied")
        assert await chat.page.evaluate("navigator.clipboard.readText()") == code
    # The message's own Copy still copies the whole reply as written.
    await reply.get_by_role("button", name="Copy message").click()
    assert (await chat.page.evaluate("navigator.clipboard.readText()")).startswith("Two blocks:\n\n```python\n")
    await expect(reply.locator(".code-copy").first).to_have_accessible_name("Copy code")  # back after a moment


async def test_a_reply_cut_at_the_token_limit_can_be_continued(open_chat):
    chat = await open_chat()
    replies_as(chat, CutReply)
    page = chat.page
    await page.goto(chat.url)
    await page.click("#settings-summary")
    await page.fill("#max-tokens", "4")
    chat.engine.replies.extend(["Once upon a time there was a cache.", "there was a cache."])
    await chat.send("Tell me a story")
    reply = await chat.reply_done()
    await expect(reply.locator(".content")).to_have_text("Once upon a time")
    await expect(reply.locator(".stats .ended")).to_have_text("cut at the token limit")
    await expect(reply.get_by_role("button", name="Continue")).to_be_visible()
    # As saved, after a reload, it can be continued too.
    await page.reload()
    reply = await chat.reply_done()
    await reply.get_by_role("button", name="Continue").click()
    await expect(page.locator(".message.assistant .content")).to_have_text(["Once upon a time", "there was a cache."])
    await chat.reply_done(2)
    assert await chat.user_messages() == ["Tell me a story", CONTINUE_PROMPT]
    # The model was asked to go on from its cut reply, under the conversation's limit.
    assert "Once upon a time" in chat.state.tokenizer.decode(chat.engine.prompts[1])
    saved = (await chat.api(f"/v1/conversations/{page.url.split('#')[1]}"))["messages"]
    assert [(m["role"], m.get("finish_reason")) for m in saved] == [
        ("user", None), ("assistant", "length"), ("user", None), ("assistant", "stop")]
    await expect(page.get_by_role("button", name="Continue")).to_have_count(0)  # the last reply was not cut


async def test_a_reply_shows_it_is_awaited_until_its_first_token(chat):
    chat.engine.go = asyncio.Event()
    replies_as(chat, HeldReply)
    chat.engine.replies.append("Here at last.")
    await chat.send("Are you there?")
    pending = chat.page.locator(".message.assistant").last
    awaited = pending.get_by_role("status", name="Waiting for the reply")
    await expect(awaited).to_be_visible()
    assert await pending.locator(".awaited span").count() == 3
    chat.engine.go.set()
    reply = await chat.reply_done()
    await expect(reply.locator(".content")).to_have_text("Here at last.")
    await expect(awaited).to_have_count(0)
