// The page's icons, drawn for it (24x24, stroked in the button's colour: chat.css's .icon), and the
// icon buttons made of them: a button that shows only an icon is named by its aria-label, which a
// screen reader announces, and by its title, which a mouse shows on hover.

const PATHS = {
  copy: ["M9 9h11v11H9z", "M15 9V4H4v11h5"],
  check: ["M4 12.5l5 5L20 6.5"],
  edit: ["M4 20h4L19 9l-4-4L4 16z", "M13 7l4 4"],
  regenerate: ["M20 12a8 8 0 1 1-2.4-5.7", "M20 4v5h-5"],
  continue: ["M4 12h13", "M12 6l6 6-6 6", "M21 5v14"],
  download: ["M12 4v11", "M7 10l5 5 5-5", "M5 20h14"],
  close: ["M6 6l12 12", "M18 6L6 18"],
  menu: ["M4 6h16", "M4 12h16", "M4 18h16"],
  // a cuff and a hand; turned over for a thumbs down (chat.css)
  thumb: ["M3 10h4v11H3z", "M7 10l4-7a2 2 0 0 1 3 2l-1 5h6a2 2 0 0 1 2 2.3l-1.4 7A2 2 0 0 1 17.6 21H7"],
};

/** An <svg> of the icon `name`, hidden from screen readers (its button says what it does). */
export function icon(name) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.classList.add("icon");
  for (const d of PATHS[name]) {
    const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", d);
    svg.append(path);
  }
  return svg;
}

/** A button that shows the icon `name` and is named `label` (aria-label and title); `className` its classes. */
export function iconButton(name, label, className, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = className;
  button.append(icon(name));
  relabel(button, label);
  button.addEventListener("click", onClick);
  return button;
}

/** Name `button` `label`, and show `name`'s icon in it if given (Copy becomes Copied, with a check). */
export function relabel(button, label, name = null) {
  button.setAttribute("aria-label", label);
  button.title = label;
  if (name) button.querySelector("svg.icon")?.replaceWith(icon(name));
}

/** Show on `button` that its copy worked (a check, "Copied") or not, for two seconds, then `label` again. */
export function showCopied(button, copied, label) {
  relabel(button, copied ? "Copied" : "Copy failed", copied ? "check" : null);
  clearTimeout(button.copiedTimer);
  button.copiedTimer = setTimeout(() => relabel(button, label, "copy"), 2000);
}
