// The messages of the open conversation as elements: user text as typed, assistant text as
// markdown (render.js), a line of stats under each (its token count, and for a reply just
// generated how fast it came, and what ended it if not its natural end) and its actions, icon
// buttons named for screen readers: Copy, and Edit (user) or Regenerate (the last reply), and
// Continue under a last reply cut at the token limit. A reply not begun shows that it is awaited.
// It knows nothing of the API: what an action does is the page's (chat.js), and rating a reply is
// feedback.js's.

import {iconButton} from "./icons.js";
import {renderMarkdown} from "./render.js";

const box = () => document.getElementById("messages");

/** The Copy button's name, as a screen reader says it (and as it comes back after "Copied"). */
export const COPY_LABEL = "Copy message";

// How a reply that did not end with [DONE] is labelled, by chatd's error code.
const ENDINGS = {
  reply_cancelled: "stopped",
  reply_interrupted: "incomplete: the server stopped before the reply ended",
  conversation_deleted: "the conversation was deleted",
  connection_lost: "the connection to the server was lost",
};
// How a reply that ended on its own, but not at its natural end, is labelled, by finish_reason.
const FINISHES = {length: "cut at the token limit", content_filter: "stopped by the content filter"};

/** A message shown: its element, its content and stats elements, its role and its text as written. */
export class Bubble {
  constructor(role, text) {
    this.role = role;
    this.text = text ?? "";
    this.id = null; // the message's id on the server, once known (a streaming reply's comes with its first chunk)
    this.finishReason = null; // a reply's, once it has ended on its own: "length" when cut at the token limit
    this.element = document.createElement("div");
    this.element.className = `message ${role}`;
    this.content = document.createElement("div");
    this.content.className = "content";
    this.stats = document.createElement("div");
    this.stats.className = "stats";
    this.actions = document.createElement("div");
    this.actions.className = "actions";
    const footer = document.createElement("div");
    footer.className = "footer";
    footer.append(this.stats, this.actions);
    this.element.append(this.content, footer);
    if (role === "user") this.content.textContent = this.text;
    else if (text === null) {
      this.element.classList.add("waiting");
      this.content.append(awaited()); // until its first text is painted over it
    }
    else renderMarkdown(this.content, this.text);
  }

  /** The stats line: `parts` joined, then what ended the reply (shown as a warning) if anything did. */
  setStats(parts, ending = null) {
    this.stats.textContent = parts.filter(Boolean).join(" · ");
    if (ending) {
      const note = document.createElement("span");
      note.className = "ended";
      note.textContent = ending;
      if (this.stats.textContent) this.stats.append(" · ");
      this.stats.append(note);
    }
  }

  /** The stats line of a reply just generated: its time to first token (`sentAt` null: a reply
   * picked up again, not timed), its token count and tokens/s; times are performance.now()'s. */
  setReplyStats({sentAt, firstTokenAt, endedAt, generated}, ending) {
    const timed = sentAt !== null && firstTokenAt !== null;
    const parts = [timed && `first token ${seconds(firstTokenAt - sentAt)}`, generated && tokens(generated)];
    if (timed && generated > 1 && endedAt > firstTokenAt) {
      parts.push(`${((generated - 1) / ((endedAt - firstTokenAt) / 1000)).toFixed(1)} tokens/s`);
    }
    this.setStats(parts, ending);
  }

  /** Its position among the conversation's messages on screen. */
  index() {
    return [...box().children].indexOf(this.element);
  }
}

const bubbles = new WeakMap(); // element -> its Bubble

/** Add a message at the end; `text` null: a reply about to stream in. */
export function addMessage(role, text = null) {
  const bubble = new Bubble(role, text);
  bubbles.set(bubble.element, bubble);
  box().append(bubble.element);
  return bubble;
}

/** Add a message as the server keeps it (GET /v1/conversations/{id}), with its id; a function call
 * or its output (items added through the Responses API) is shown as its name and a code block. */
export function addSaved(message) {
  const bubble = message.call ? addMessage("tool", toolText(message)) : addMessage(message.role, message.content);
  bubble.id = message.id;
  if (message.status === "complete") bubble.finishReason = message.finish_reason;
  return bubble;
}

/** What ended a saved reply, when it was not its natural end; null for any other message. */
export function savedEnding(message) {
  if (message.role !== "assistant") return null;
  if (message.status === "error") return "generation failed";
  return message.status !== "complete" ? "incomplete" : FINISHES[message.finish_reason] || null;
}

/** What ended a reply just followed: chatd's `error` (by its code), else its finish_reason; null at its natural end. */
export function streamEnding(error, finishReason) {
  return error ? ENDINGS[error.code] || `failed: ${error.message}` : FINISHES[finishReason] || null;
}

function toolText(message) {
  const fence = "`".repeat(Math.max(3, ...[...message.content.matchAll(/`+/g)].map((m) => m[0].length + 1)));
  const title = message.role === "tool" ? "Tool result" : `Called \`${message.call.name}\``;
  return `**${title}**\n\n${fence}\n${message.content}\n${fence}`;
}

/** The messages on screen, oldest first. */
export function shownMessages() {
  return [...box().children].map((element) => bubbles.get(element));
}

/** Give every message its buttons: Copy on each, Edit on user messages, Regenerate on the last
 * reply and Continue when it was cut at the token limit; `handlers` has copy, edit, regenerate and
 * continue, each called with the Bubble. */
export function addActions(handlers) {
  const all = shownMessages();
  for (const bubble of all) {
    const buttons = [iconButton("copy", COPY_LABEL, "action copy", () => handlers.copy(bubble))];
    if (bubble.role === "user") buttons.push(iconButton("edit", "Edit message", "action edit", () => handlers.edit(bubble)));
    if (bubble.role === "assistant" && bubble === all.at(-1)) {
      buttons.push(iconButton("regenerate", "Regenerate reply", "action regenerate", () => handlers.regenerate(bubble)));
      if (bubble.finishReason === "length") buttons.unshift(continueButton(() => handlers.continue(bubble)));
    }
    bubble.actions.replaceChildren(...buttons);
  }
}

/** Continue shows its word too: it is what a reader of a cut reply looks for. */
function continueButton(onClick) {
  const button = iconButton("continue", "Continue", "action continue", onClick);
  button.title = "Ask for the rest of this reply, which the token limit cut";
  button.append("Continue");
  return button;
}

/** What a reply shows until its first text: three pulsing dots, announced as awaited. */
function awaited() {
  const status = document.createElement("div");
  status.className = "awaited";
  status.setAttribute("role", "status");
  status.setAttribute("aria-label", "Waiting for the reply");
  for (let i = 0; i < 3; i++) status.append(document.createElement("span"));
  return status;
}

/** Turn a user message into a text box with Send and Cancel; resolves to the new text, or null. */
export function editInPlace(bubble) {
  return new Promise((resolve) => {
    const field = document.createElement("textarea");
    field.className = "editor";
    field.value = bubble.text;
    field.rows = Math.min(12, bubble.text.split("\n").length + 1);
    const done = (text) => {
      bubble.content.textContent = bubble.text;
      bubble.element.classList.remove("editing");
      resolve(text);
    };
    const send = actionButton("Send", () => field.value.trim() && done(field.value.trim()));
    send.classList.add("primary");
    const cancel = actionButton("Cancel", () => done(null));
    field.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send.click();
      } else if (event.key === "Escape") {
        event.stopPropagation();
        done(null);
      }
    });
    const row = document.createElement("div");
    row.className = "row";
    row.append(send, cancel);
    bubble.element.classList.add("editing");
    bubble.content.replaceChildren(field, row);
    field.focus();
  });
}

/** A duration as people read it: 850 ms, 1.25 s, 12 s. */
export function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 0)} s`;
}

export function tokens(count) {
  return count === 1 ? "1 token" : `${count} tokens`;
}

function actionButton(label, onClick) {
  const element = document.createElement("button");
  element.type = "button";
  element.className = `action ${label.toLowerCase()}`;
  element.textContent = label;
  element.addEventListener("click", onClick);
  return element;
}
