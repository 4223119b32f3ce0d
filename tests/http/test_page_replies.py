"""What a reply shows besides its text, in headless Chromium (test_page.py's harness): a bar over each
code block with its language and a Copy button that copies the code exactly.

Every wait here is for a condition (test_page.py's WAIT_MS): these tests share two busy cores."""

from __future__ import annotations

import pytest

from tests.http.test_page import CHROMIUM, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]


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
