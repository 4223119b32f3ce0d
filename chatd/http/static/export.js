// Download a conversation as a file: JSON (exactly what GET /v1/conversations/{id} answers, so
// it can be read back by any client) or Markdown (to read or paste elsewhere), chosen in the top
// bar's Export menu. The file is made in the browser; nothing is sent anywhere.

import {icon} from "./icons.js";

const $ = (id) => document.getElementById(id);

/** Make the Export button open its menu of formats; choosing one calls `save` with its download
 * function (downloadJson or downloadMarkdown). Arrow keys move in the menu, Escape closes it. */
export function exportMenu(save) {
  const toggle = $("export-toggle");
  const menu = $("export-menu");
  const items = [...menu.querySelectorAll("[role=menuitem]")];
  const setOpen = (open) => {
    menu.hidden = !open;
    toggle.setAttribute("aria-expanded", String(open));
    if (open) items[0].focus();
  };
  toggle.prepend(icon("download"));
  toggle.addEventListener("click", () => setOpen(menu.hidden));
  for (const [id, download] of [["export-markdown", downloadMarkdown], ["export-json", downloadJson]]) {
    $(id).addEventListener("click", () => {
      setOpen(false);
      save(download);
    });
  }
  menu.addEventListener("keydown", (event) => {
    const step = {ArrowDown: 1, ArrowUp: -1}[event.key];
    if (step) {
      event.preventDefault();
      items[(items.indexOf(document.activeElement) + step + items.length) % items.length].focus();
    } else if (event.key === "Escape") {
      event.stopPropagation(); // not the page's Escape, which stops a reply
      setOpen(false);
      toggle.focus();
    }
  });
  document.addEventListener("click", (event) => {
    if (!menu.hidden && !$("export").contains(event.target)) setOpen(false);
  });
}

/** Save `conversation` (with its messages) as `<title>.json`. */
export function downloadJson(conversation) {
  download(`${fileName(conversation)}.json`, JSON.stringify(conversation, null, 2) + "\n", "application/json");
}

/** Save `conversation` (with its messages) as `<title>.md`: a heading per message. */
export function downloadMarkdown(conversation) {
  download(`${fileName(conversation)}.md`, toMarkdown(conversation), "text/markdown");
}

/** The conversation as Markdown: its title, model and system prompt, then each message. */
export function toMarkdown(conversation) {
  const lines = [`# ${conversation.title || conversation.id}`, "", `Model: ${conversation.model}`, ""];
  if (conversation.system_prompt) lines.push("## System", "", conversation.system_prompt, "");
  for (const message of conversation.messages) {
    lines.push(`## ${message.role === "user" ? "User" : "Assistant"}`, "", message.content, "");
  }
  return lines.join("\n");
}

function fileName(conversation) {
  const title = (conversation.title || conversation.id).replace(/[^\p{L}\p{N} _-]+/gu, "").trim().slice(0, 60);
  return title || conversation.id;
}

function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], {type}));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000); // once the browser has surely read it
}
