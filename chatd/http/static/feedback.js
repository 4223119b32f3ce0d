// Thumbs up and down under each reply, as llama.cpp's and Open WebUI's pages have them: a click
// rates the reply (POST /v1/feedback), and the pressed button is always the rating the server
// accepted, so a refused one leaves them as they were and says why on the error line. A thumbs
// down is sent at once and opens a box for an optional comment, sent as a second "down" with it.
//
// The ratings given are kept in memory by message id, so they survive switching conversations;
// chatd has no GET for them, so after a reload no button is pressed. It knows a message only as
// a Bubble (messages.js) and the server only through api.js.

import {api} from "./api.js";
import {iconButton} from "./icons.js";
import {describe, showError} from "./notice.js";

const THUMBS = [{rating: "up", label: "Good reply"}, {rating: "down", label: "Bad reply"}];
const MAX_COMMENT_CHARS = 2000; // the server's limit (chatd/store/feedback.py)

const given = new Map(); // message id -> {rating, comment} as the server accepted it, this page session

/** Put the two thumbs in the actions of every reply in `bubbles` that has its server id (after addActions). */
export function addRatings(bubbles) {
  for (const bubble of bubbles) {
    if (bubble.role !== "assistant" || !bubble.id) continue;
    bubble.actions.append(...THUMBS.map(({rating, label}) => thumb(bubble, rating, label)));
    showRating(bubble);
  }
}

function thumb(bubble, rating, label) {
  return iconButton("thumb", label, `action rate ${rating}`, () => (rating === "up" ? rateUp(bubble) : rateDown(bubble)));
}

async function rateUp(bubble) {
  if (given.get(bubble.id)?.rating !== "up") await rate(bubble, "up");
}

/** A thumbs down is sent at once; then (or when it was already down) the comment box opens. */
async function rateDown(bubble) {
  if (given.get(bubble.id)?.rating === "down" || (await rate(bubble, "down"))) openComment(bubble);
}

/** Send a rating of `bubble`'s reply; true once the server took it (which closes the comment box
 * when it was an up or the comment). While it is on its way the thumbs are disabled; a refusal is
 * shown on the error line, with a Retry, and changes nothing. */
async function rate(bubble, rating, comment) {
  showError(null);
  setBusy(bubble, true);
  try {
    const rated = await api.rate(bubble.id, rating, comment);
    given.set(bubble.id, {rating: rated.rating, comment: rated.comment});
    if (rating === "up" || comment) closeComment(bubble);
    return true;
  } catch (error) {
    showError(describe(error), () => rate(bubble, rating, comment));
    return false;
  } finally {
    setBusy(bubble, false);
    showRating(bubble);
  }
}

/** The box under a reply for saying what was wrong with it: Send (or Enter) sends it, Cancel or Escape closes it. */
function openComment(bubble) {
  const open = bubble.element.querySelector(".feedback textarea");
  if (open) return open.focus();
  const field = document.createElement("textarea");
  field.rows = 2;
  field.maxLength = MAX_COMMENT_CHARS;
  field.placeholder = "What was wrong with this reply? (optional)";
  field.setAttribute("aria-label", "What was wrong with this reply");
  field.value = given.get(bubble.id)?.comment || "";
  const send = button("Send", async () => {
    const comment = field.value.trim();
    if (!comment || send.disabled) return;
    send.disabled = true;
    await rate(bubble, "down", comment);
    send.disabled = false;
  });
  send.classList.add("primary");
  const cancel = button("Cancel", () => closeComment(bubble, true));
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send.click();
    } else if (event.key === "Escape") {
      event.stopPropagation(); // not the page's Escape, which stops a reply
      closeComment(bubble, true);
    }
  });
  const row = document.createElement("div");
  row.className = "row";
  row.append(send, cancel);
  const box = document.createElement("div");
  box.className = "feedback";
  box.append(field, row);
  bubble.element.append(box);
  field.focus();
}

/** Close `bubble`'s comment box, if open; `refocus`: give the focus back to its thumbs down. */
function closeComment(bubble, refocus = false) {
  const box = bubble.element.querySelector(".feedback");
  if (!box) return;
  box.remove();
  if (refocus) bubble.actions.querySelector(".rate.down")?.focus();
}

function showRating(bubble) {
  const rating = given.get(bubble.id)?.rating;
  for (const button of bubble.actions.querySelectorAll(".rate")) {
    button.setAttribute("aria-pressed", String(rating !== undefined && button.classList.contains(rating)));
  }
}

function setBusy(bubble, busy) {
  for (const button of bubble.actions.querySelectorAll(".rate")) button.disabled = busy;
}

function button(label, onClick) {
  const element = document.createElement("button");
  element.type = "button";
  element.textContent = label;
  element.addEventListener("click", onClick);
  return element;
}
