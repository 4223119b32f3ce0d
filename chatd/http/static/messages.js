// The messages of the open conversation as elements: user text as typed, assistant text as
// markdown (render.js), a line of stats under each (its token count, and for a reply just
// generated how fast it came) and its actions: Copy, and Edit (user) or Regenerate (the last
// reply). It knows nothing of the API: what an action does is the page's (chat.js).

import {renderMarkdown} from "./render.js";

const box = () => document.getElementById("messages");

/** A message shown: its element, its content and stats elements, its role and its text as written. */
export class Bubble {
  constructor(role, text) {
    this.role = role;
    this.text = text ?? "";
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
    else if (text === null) this.element.classList.add("waiting");
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

/** The messages on screen, oldest first. */
export function shownMessages() {
  return [...box().children].map((element) => bubbles.get(element));
}

/** Give every message its buttons: Copy on each, Edit on user messages, Regenerate on the last
 * reply; `handlers` has copy, edit and regenerate, each called with the Bubble. */
export function addActions(handlers) {
  const all = shownMessages();
  for (const bubble of all) {
    const buttons = [actionButton("Copy", () => handlers.copy(bubble))];
    if (bubble.role === "user") buttons.push(actionButton("Edit", () => handlers.edit(bubble)));
    if (bubble.role === "assistant" && bubble === all.at(-1)) buttons.push(actionButton("Regenerate", () => handlers.regenerate(bubble)));
    bubble.actions.replaceChildren(...buttons);
  }
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

/** Copy `text` to the clipboard; false where the browser refuses (no permission, not https). */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false;
  }
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
