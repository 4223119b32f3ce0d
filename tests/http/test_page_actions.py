"""What a user does with the messages of the chat page, in headless Chromium (test_page.py's
harness): highlighted code, token counts under every item, copy, regenerate, edit-and-resend
(the tail is replaced), a conversation's own settings, export, and the keyboard."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest

from tests.http.test_page import CHROMIUM, LONG_REPLY, Chat, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]


async def call(chat: Chat, method: str, path: str, body: dict | None = None) -> dict:
    """The API called directly, as another client of the same server would."""
    async with aiohttp.ClientSession() as session, session.request(method, chat.server.make_url(path), json=body) as response:
        return await response.json()


async def open_listed(chat: Chat, conversation: str) -> None:
    """Open a conversation made through the API as a user would: reload the page, click it in the sidebar.
    (A reload onto a new `#id` was seen to leave the page on a new chat once in CI, on busy cores.)"""
    await chat.page.reload()
    await chat.page.locator(f"#conversations li[data-id='{conversation}'] .open").click()


def conversation_id(chat: Chat) -> str:
    return chat.page.url.split("#")[1]


async def test_code_is_highlighted_and_hostile_code_stays_text(chat):
    hostile = '</code></pre><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    chat.engine.replies.append(f"Here:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n```html\n{hostile}\n```\n\n```\n{hostile}\n```")
    await chat.send("Write some code")
    reply = await chat.reply_done()
    code = reply.locator("pre code")
    await expect(code).to_have_count(3)
    assert await code.nth(0).locator("span.hljs-keyword").all_inner_texts() == ["def", "return"]
    assert (await code.nth(0).inner_text()).strip() == "def add(a, b):\n    return a + b"
    # The highlighter coloured the hostile blocks' text, and it stayed text: no element but <span>.
    assert await code.nth(1).locator("span").count() > 0
    for i in (1, 2):
        assert (await code.nth(i).inner_text()).strip() == hostile
    assert await reply.locator(".content :is(script, img, [onerror])").count() == 0
    assert await reply.locator("pre code *:not(span)").count() == 0
    assert await chat.page.evaluate("window.__pwned") is None


async def test_every_message_shows_its_token_count_by_the_servers_tokenizer(chat):
    items = [{"type": "message", "role": "user", "content": "What is a KV cache?"},
             {"type": "message", "role": "assistant", "content": "The keys and values of past tokens, kept for reuse."}]
    created = await call(chat, "POST", "/v1/conversations", {"title": "Added through the API", "items": items})
    counts = [(await call(chat, "POST", "/tokenize", {"prompt": item["content"]}))["count"] for item in items]
    await open_listed(chat, created["id"])
    stats = chat.page.locator(".message .stats")
    await expect(stats).to_have_text([f"{counts[0]} tokens", f"{counts[1]} tokens"])
    # A message sent from the page is counted too; its reply keeps the usage chatd generated it with.
    await chat.send("Tell me more")
    reply = await chat.reply_done(2)
    sent = (await call(chat, "POST", "/tokenize", {"prompt": "Tell me more"}))["count"]
    await expect(stats.nth(2)).to_have_text(f"{sent} tokens")
    generated = len(chat.engine.default.split())  # the scripted engine: a token per word
    assert f"{generated} tokens" in await reply.locator(".stats").inner_text()


async def test_copy_puts_the_message_as_written_on_the_clipboard(open_chat):
    chat = await open_chat()
    await chat.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    await chat.page.goto(chat.url)
    chat.engine.replies.append("Use **bold** and `code`.")
    await chat.send("How do I write markdown?")
    reply = await chat.reply_done()
    await reply.get_by_role("button", name="Copy message").click()
    await expect(reply.locator(".actions .copy")).to_have_accessible_name("Copied")
    assert await chat.page.evaluate("navigator.clipboard.readText()") == "Use **bold** and `code`."  # the markdown, not the HTML
    await chat.page.locator(".message.user .actions .copy").click()
    assert await chat.page.evaluate("navigator.clipboard.readText()") == "How do I write markdown?"


async def test_regenerate_replaces_the_last_reply(chat):
    chat.engine.replies.extend(["First answer.", "Second answer."])
    await chat.send("Answer me")
    reply = await chat.reply_done()
    await expect(chat.page.locator(".actions .regenerate")).to_have_count(1)  # on the last reply only
    await reply.locator(".actions .regenerate").click()
    await expect(chat.page.locator(".message.assistant .content")).to_have_text(["Second answer."])
    await chat.reply_done()
    assert await chat.user_messages() == ["Answer me"]
    saved = (await chat.api(f"/v1/conversations/{conversation_id(chat)}"))["messages"]
    assert [(m["role"], m["content"]) for m in saved] == [("user", "Answer me"), ("assistant", "Second answer.")]


async def test_editing_a_message_replaces_the_conversation_from_it_on(chat):
    chat.engine.replies.extend(["One.", "Two.", "Edited one."])
    await chat.send("first question")
    await chat.reply_done()
    await chat.send("second question")
    await chat.reply_done(2)
    await chat.page.locator(".message.user").first.locator(".actions .edit").click()
    editor = chat.page.locator(".message.user textarea.editor")
    assert await editor.input_value() == "first question"
    await editor.fill("first question, better put")
    await editor.press("Enter")
    await expect(chat.page.locator(".message.assistant .content")).to_have_text(["Edited one."])
    await chat.reply_done()
    assert await chat.user_messages() == ["first question, better put"]
    saved = (await chat.api(f"/v1/conversations/{conversation_id(chat)}"))["messages"]
    assert [m["content"] for m in saved] == ["first question, better put", "Edited one."]
    # Escape leaves an edit as it was.
    await chat.page.locator(".message.user .actions .edit").click()
    await editor.fill("never sent")
    await editor.press("Escape")
    assert await chat.user_messages() == ["first question, better put"]


async def test_a_conversations_system_prompt_and_sampling_follow_it(open_chat):
    chat = await open_chat()
    page = chat.page
    seen = []  # each reply's sampling parameters, as the engine got them
    generate = chat.engine.generate
    chat.engine.generate = lambda prompt, params, *rest, **named: seen.append(params) or generate(prompt, params, *rest, **named)
    await page.goto(chat.url)
    await page.click("#settings-summary")  # a new chat's settings are folded away
    await page.fill("#system-prompt", "Be brief.")
    await page.fill("#temperature", "0.3")
    await page.fill("#max-tokens", "40")
    await chat.send("hello")
    await chat.reply_done()
    saved = await chat.api(f"/v1/conversations/{conversation_id(chat)}")
    assert (saved["system_prompt"], saved["metadata"]) == ("Be brief.", {"temperature": "0.3", "max_completion_tokens": "40"})
    assert (seen[0].temperature, seen[0].max_tokens) == (0.3, 40)
    await expect(page.locator("#settings-summary")).to_have_text("Model: scripted · system prompt · temperature 0.3 · max tokens 40")

    # In another browser the conversation opens with its settings, and a change is saved with it.
    other = await page.context.browser.new_context()
    try:
        tab = await other.new_page()
        await tab.goto(f"{chat.url}#{saved['id']}")
        await expect(tab.locator("#temperature")).to_have_value("0.3")
        assert await tab.locator("#system-prompt").input_value() == "Be brief."
        assert await tab.locator("#model").is_disabled()  # a conversation keeps its model
        await tab.click("#settings-summary")
        await tab.fill("#system-prompt", "Answer in French.")
        await tab.fill("#temperature", "")
        await tab.fill("#top-p", "0.9")
        await tab.press("#top-p", "Tab")
        await expect(tab.locator("#settings-note")).to_have_text("Saved: applies from the next message.")
    finally:
        await other.close()
    saved = await chat.api(f"/v1/conversations/{saved['id']}")
    assert (saved["system_prompt"], saved["metadata"]) == ("Answer in French.", {"top_p": "0.9", "max_completion_tokens": "40"})
    await page.reload()
    await chat.send("again")
    await chat.reply_done(2)
    assert (seen[1].top_p, seen[1].max_tokens) == (0.9, 40)
    assert "Answer in French." in chat.state.tokenizer.decode(chat.engine.prompts[1])


async def test_a_conversation_downloads_as_json_and_markdown(chat):
    chat.engine.replies.append("A **fine** answer.")
    await chat.send("Export me")
    await chat.reply_done()
    saved = await chat.api(f"/v1/conversations/{conversation_id(chat)}")
    async with chat.page.expect_download() as download:
        await chat.page.get_by_role("button", name="Export", exact=True).click()
        await chat.page.get_by_role("menuitem", name="Download as JSON").click()
    got = await download.value
    assert got.suggested_filename == "Export me.json"
    assert json.loads(open(await got.path()).read()) == saved
    async with chat.page.expect_download() as download:
        await chat.page.get_by_role("button", name="Export", exact=True).click()
        await chat.page.get_by_role("menuitem", name="Download as Markdown").click()
    got = await download.value
    assert got.suggested_filename == "Export me.md"
    assert open(await got.path()).read() == "# Export me\n\nModel: scripted\n\n## User\n\nExport me\n\n## Assistant\n\nA **fine** answer.\n"


async def test_enter_sends_shift_enter_breaks_the_line_and_escape_stops_a_reply(chat):
    chat.engine.replies.append(LONG_REPLY)
    await chat.page.fill("#input", "first line")
    await chat.page.press("#input", "Shift+Enter")
    await chat.page.type("#input", "second line")
    await chat.page.press("#input", "Enter")
    await chat.reply_started()
    assert await chat.user_messages() == ["first line\nsecond line"]
    await chat.page.keyboard.press("Escape")
    reply = await chat.reply_done()
    assert "stopped" in await reply.locator(".stats .ended").inner_text()
    assert re.fullmatch(r"scripted-\d+", next(iter(chat.engine.aborted)))


async def test_function_calls_and_their_outputs_show_as_tool_items(chat):
    items = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and ```sunny```"},
             {"type": "message", "role": "assistant", "content": "It is 18 C."}]
    created = await call(chat, "POST", "/v1/conversations", {"title": "A tool round", "items": items})
    await open_listed(chat, created["id"])
    tools = chat.page.locator(".message.tool")
    await expect(tools).to_have_count(2)
    await expect(tools.nth(0).locator("strong")).to_have_text("Called get_weather")
    await expect(tools.nth(0).locator("pre code")).to_have_text('{"city": "Paris"}')
    await expect(tools.nth(1).locator("pre code")).to_have_text("18 C and ```sunny```")  # the fence held
    await expect(chat.page.locator(".message")).to_have_count(4)
