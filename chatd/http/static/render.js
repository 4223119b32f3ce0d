// A reply's markdown as HTML that cannot run anything: marked (vendor/) parses it, raw HTML the
// model wrote is shown as the text it is (as ChatGPT's page does), and DOMPurify (vendor/) keeps
// only inert markup of what marked made: no <script>, no on* handlers, no javascript: links. The
// page's Content-Security-Policy (page.py) would stop a script that got through anyway.
//
// Raw HTML is escaped rather than only sanitized because parsing it at all, even into DOMPurify's
// inert document, makes Chromium (156.0.8078.108) report each on* attribute as a CSP violation.

/* global marked, DOMPurify */

const SANITIZE = {
  USE_PROFILES: {html: true},
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],
};

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
