// A reply's markdown as HTML that cannot run anything: marked (vendor/) parses it, raw HTML the
// model wrote is shown as the text it is (as ChatGPT's page does), and DOMPurify (vendor/) keeps
// only inert markup of what marked made: no <script>, no on* handlers, no javascript: links. The
// page's Content-Security-Policy (page.py) would stop a script that got through anyway.
//
// Code blocks are coloured by highlight.js (vendor/) after sanitizing: it reads each block's text
// (never its markup) and its output is sanitized again, keeping only <span class>. Each block gets
// a bar above it, made here after sanitizing: the language its fence names ("text" when none) and
// a button that copies its code exactly as the fence holds it.
//
// Raw HTML is escaped rather than only sanitized because parsing it at all, even into DOMPurify's
// inert document, makes Chromium (156.0.8078.108) report each on* attribute as a CSP violation.

/* global marked, DOMPurify, hljs */

import {iconButton, showCopied} from "./icons.js";

const SANITIZE = {
  USE_PROFILES: {html: true},
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],
};

const HIGHLIGHTED = {ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"]};
const AUTO_DETECT_CHARS = 20_000; // guessing a block's language tries every grammar: only for short blocks

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
const markdown = new marked.Marked({gfm: true, async: false, renderer: {html: ({text}) => escapeHtml(text)}});

/** Show `text` (markdown) in `element`, sanitized; links open in a new tab without a referrer. */
export function renderMarkdown(element, text) {
  element.innerHTML = DOMPurify.sanitize(markdown.parse(text), SANITIZE);
  for (const link of element.querySelectorAll("a[href]")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  for (const code of element.querySelectorAll("pre > code")) {
    const language = [...code.classList].find((name) => name.startsWith("language-"))?.slice(9);
    addCodeBar(code, language);
    highlight(code, language);
  }
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

/** Put `code`'s block in a frame with a bar: its language and a Copy button. */
function addCodeBar(code, language) {
  const source = code.textContent.replace(/\n$/, ""); // marked ends a block with a newline the fence does not hold
  const name = document.createElement("span");
  name.className = "code-language";
  name.textContent = language || "text";
  const copy = iconButton("copy", "Copy code", "code-copy", async () => showCopied(copy, await copyText(source), "Copy code"));
  const bar = document.createElement("div");
  bar.className = "code-bar";
  bar.append(name, copy);
  const block = document.createElement("div");
  block.className = "code-block";
  const pre = code.parentElement;
  pre.replaceWith(block);
  block.append(bar, pre);
}

function highlight(code, language) {
  const source = code.textContent;
  let result;
  if (language && hljs.getLanguage(language)) result = hljs.highlight(source, {language, ignoreIllegals: true});
  else if (!language && source.length <= AUTO_DETECT_CHARS) result = hljs.highlightAuto(source);
  else return;
  code.innerHTML = DOMPurify.sanitize(result.value, HIGHLIGHTED);
  code.classList.add("hljs");
  if (result.language) code.dataset.language = result.language;
}

/** Repaint `element` with the latest text at most once a frame, however fast the deltas come. */
export function markdownPainter(element) {
  let text = "";
  let queued = false;
  const paint = () => {
    queued = false;
    renderMarkdown(element, text);
  };
  return {
    update(latest) {
      text = latest;
      if (!queued) {
        queued = true;
        requestAnimationFrame(paint);
      }
    },
    flush: paint,
  };
}
