"""How the chat page reads, in headless Chromium (test_page.py's harness): icon buttons a screen
reader names, and export under one labelled menu.

Every wait here is for a condition (test_page.py's WAIT_MS): these tests share two busy cores."""

from __future__ import annotations

import pytest

from tests.http.test_page import CHROMIUM, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]


async def test_icon_buttons_are_named_for_a_screen_reader_and_export_is_one_menu(chat):
    page = chat.page
    await chat.send("Name your buttons")
    reply = await chat.reply_done()
    await expect(page.locator(".message.user .actions")).to_match_aria_snapshot(
        '- button "Copy message"\n- button "Edit message"')
    await expect(reply.locator(".actions")).to_match_aria_snapshot(
        '- button "Copy message"\n- button "Regenerate reply"\n- button "Good reply"\n- button "Bad reply"')
    await expect(page.locator("#conversations li")).to_match_aria_snapshot(
        '- listitem:\n  - button "Name your buttons"\n  - button "Rename “Name your buttons”"\n'
        '  - button "Delete “Name your buttons”"')
    # No button on the page is left without a name (an icon alone says nothing to a screen reader).
    for button in await page.locator("button:visible").all():
        assert (await button.get_attribute("aria-label") or await button.inner_text()).strip(), await button.evaluate("e => e.outerHTML")

    # Export: one button, which says it opens a menu; the formats are its items, reached by the arrow keys.
    export = page.get_by_role("button", name="Export", exact=True)
    await expect(export).to_have_attribute("aria-haspopup", "menu")
    await expect(export).to_have_attribute("aria-expanded", "false")
    menu = page.get_by_role("menu", name="Export this conversation")
    await expect(menu).to_be_hidden()
    await export.click()
    await expect(export).to_have_attribute("aria-expanded", "true")
    await expect(menu.get_by_role("menuitem")).to_have_text(["Download as Markdown", "Download as JSON"])
    await expect(menu.get_by_role("menuitem", name="Download as Markdown")).to_be_focused()
    await page.keyboard.press("ArrowDown")
    await expect(menu.get_by_role("menuitem", name="Download as JSON")).to_be_focused()
    await page.keyboard.press("Escape")  # closes it, and gives the focus back to its button
    await expect(menu).to_be_hidden()
    await expect(export).to_be_focused()
    await export.click()
    await page.locator("#messages").click()  # a click elsewhere closes it
    await expect(menu).to_be_hidden()
    async with page.expect_download() as download:
        await export.click()
        await page.keyboard.press("ArrowUp")  # round to the last item
        await page.keyboard.press("Enter")
    assert (await download.value).suggested_filename == "Name your buttons.json"
    await expect(menu).to_be_hidden()
