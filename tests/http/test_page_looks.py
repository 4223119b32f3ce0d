"""How the chat page reads, in headless Chromium (test_page.py's harness): icon buttons a screen
reader names, export under one labelled menu, the Send button readable in the dark scheme, and a
new chat that opens on a short welcome naming the model, with the keyboard hints whole on a phone.

Every wait here is for a condition (test_page.py's WAIT_MS): these tests share two busy cores."""

from __future__ import annotations

import re

import pytest

from tests.http.test_page import CHROMIUM, PHONE, browser, chat, expect, open_chat  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} (apt-get install chromium)")]

MIN_CONTRAST = 4.5  # WCAG AA for text of a normal size


def luminance(css_color: str) -> float:
    """WCAG's relative luminance of an `rgb(r, g, b)` colour."""
    channels = [int(c) / 255 for c in re.findall(r"\d+", css_color)[:3]]
    r, g, b = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(first: str, second: str) -> float:
    lighter, darker = sorted((luminance(first), luminance(second)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


async def colours(locator) -> tuple[str, str]:
    """An element's text colour and background colour, as computed."""
    return tuple(await locator.evaluate("element => [getComputedStyle(element).color, getComputedStyle(element).backgroundColor]"))


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


@pytest.mark.parametrize("scheme", ["dark", "light"])
async def test_the_send_buttons_text_is_readable_in_either_colour_scheme(open_chat, scheme):
    chat = await open_chat(color_scheme=scheme)
    page = chat.page
    await page.goto(chat.url)
    assert await page.evaluate(f"matchMedia('(prefers-color-scheme: {scheme})').matches")
    send = page.get_by_role("button", name="Send")
    assert contrast(*await colours(send)) >= MIN_CONTRAST, await colours(send)
    # The other filled button, the edited message's Send, too.
    await chat.send("hello")
    await chat.reply_done()
    await page.get_by_role("button", name="Edit message").click()
    edit_send = page.locator(".message.user button.primary")
    assert contrast(*await colours(edit_send)) >= MIN_CONTRAST, await colours(edit_send)


async def test_on_a_phone_a_new_chat_opens_on_a_short_welcome_and_the_keyboard_hints_fit(open_chat):
    chat = await open_chat(viewport=PHONE)
    page = chat.page
    await page.goto(chat.url)
    welcome = page.get_by_role("region", name="Chat with scripted")  # the model's name, from GET /v1/models
    await expect(welcome).to_be_visible()
    await expect(page.locator("#system-prompt")).to_be_hidden()  # the settings are folded away
    settings, shown = await page.locator("#settings").bounding_box(), await welcome.bounding_box()
    assert shown["y"] + shown["height"] < PHONE["height"] / 2, shown
    assert settings["height"] < 60, settings
    # The keyboard hints are whole: in the viewport, nothing cut, and named as the message box's description.
    hints = page.locator("#keys")
    await expect(hints).to_be_in_viewport(ratio=1)
    assert await hints.evaluate("e => e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight")
    message = page.get_by_role("textbox", name="Message")
    await expect(message).to_have_accessible_description("Enter sends · Shift+Enter starts a new line · Escape stops a reply")
    assert await page.evaluate("document.scrollingElement.scrollWidth <= innerWidth")

    # The settings open when asked; a message replaces the welcome; a new chat brings it back.
    await page.click("#settings-summary")
    await expect(page.locator("#system-prompt")).to_be_visible()
    await chat.send("hello from a phone")
    await chat.reply_done()
    await expect(welcome).to_be_hidden()
    await expect(page.locator("#system-prompt")).to_be_hidden()
    await page.click("#menu")
    await page.click("#new-chat")
    await expect(welcome).to_be_visible()
    await expect(page.locator("#system-prompt")).to_be_hidden()
