// A reply's markdown as HTML that cannot run anything: marked (vendor/) parses it, DOMPurify
// (vendor/) keeps only inert markup: no <script>, no on* handlers, no javascript: links. The
// page's Content-Security-Policy (page.py) would stop a script that got through anyway.

/* global marked, DOMPurify */

const SANITIZE = {
  USE_PROFILES: {html: true},
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],
};

/** Show `text` (markdown) in `element`, sanitized; links open in a new tab without a referrer. */
export function renderMarkdown(element, text) {
  element.innerHTML = DOMPurify.sanitize(marked.parse(text, {gfm: true, async: false}), SANITIZE);
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
