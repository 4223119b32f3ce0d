// The sidebar's list of conversations, as llama.cpp's and Open WebUI's pages show theirs: newest
// first, grouped by the day each was started (Today, Yesterday, Previous 7 days, Older), each title
// whole on hover (the row cuts a long one), with Rename and Delete, and a search box that keeps the
// conversations whose title has what is typed. The list is loaded 50 at a time ("Older
// conversations" loads more) and the search looks through those loaded. It reaches chatd through
// api.js; what opening a conversation, or losing the open one, does is chat.js's.

import {api} from "./api.js";
import {iconButton} from "./icons.js";
import {describe, showError} from "./notice.js";

const $ = (id) => document.getElementById(id);

const MAX_TITLE_CHARS = 80; // of a title taken from a first message (the server keeps up to 256)

const listed = {
  conversations: [], // the caller's, newest first, as far as loaded
  hasMore: false,
  openId: null, // the conversation open in the page, marked in the list
};
let page = {open() {}, renamed() {}, deleted() {}}; // chat.js's, each called with the conversation

/** What the page does when a conversation is clicked (`open`), renamed here, or deleted here. */
export function onConversation(handlers) {
  page = handlers;
}

/** Load the first 50 conversations, or (`older`) the 50 after those loaded. */
export async function loadConversations(older) {
  try {
    const list = await api.conversations(older ? listed.conversations.at(-1)?.id : undefined);
    listed.conversations = older ? [...listed.conversations, ...list.data] : list.data;
    listed.hasMore = list.has_more;
  } catch (error) {
    showError(describe(error), () => loadConversations(older));
  }
  render();
}

/** Mark the conversation `id` as the open one (null: none is). */
export function markOpen(id) {
  listed.openId = id;
  render();
}

/** Put a conversation just made at the top of the list. */
export function listNew(conversation) {
  listed.conversations.unshift(conversation);
  render();
}

/** Show `conversation` as it is now (renamed). */
export function relist(conversation) {
  listed.conversations = listed.conversations.map((c) => (c.id === conversation.id ? conversation : c));
  render();
}

/** Empty the list (the API key was forgotten). */
export function forgetConversations() {
  listed.conversations = [];
  listed.hasMore = false;
  render();
}

function render() {
  const query = $("search").value.trim();
  const found = listed.conversations.filter((c) => titleOf(c).toLocaleLowerCase().includes(query.toLocaleLowerCase()));
  const days = new Map(); // day -> its rows, newest day first
  const now = new Date();
  for (const conversation of found) {
    const day = dayOf(conversation.created_at, now);
    if (!days.has(day)) days.set(day, []);
    days.get(day).push(row(conversation));
  }
  $("conversations").replaceChildren(...[...days].flatMap(([day, rows], i) => {
    const heading = document.createElement("h2");
    heading.id = `day-${i}`;
    heading.textContent = day;
    const list = document.createElement("ul");
    list.setAttribute("aria-labelledby", heading.id);
    list.append(...rows);
    return [heading, list];
  }));
  $("no-match").hidden = found.length > 0 || !query;
  $("no-match").textContent = `No conversation's title has “${query}”.`;
  $("older").hidden = !listed.hasMore;
}

function row(conversation) {
  const title = titleOf(conversation);
  const item = document.createElement("li");
  item.dataset.id = conversation.id;
  item.classList.toggle("current", conversation.id === listed.openId);
  const open = document.createElement("button");
  open.type = "button";
  open.className = "open";
  open.textContent = title;
  open.title = title; // whole, where the row cuts it
  open.addEventListener("click", () => page.open(conversation));
  item.append(open, iconButton("edit", `Rename “${title}”`, "rename", () => rename(conversation)),
              iconButton("close", `Delete “${title}”`, "delete", () => remove(conversation)));
  return item;
}

async function rename(conversation) {
  const title = prompt("Rename the conversation", conversation.title || "");
  if (title === null || !title.trim()) return;
  try {
    const renamed = await api.updateConversation(conversation.id, {title: title.trim()});
    relist(renamed);
    page.renamed(renamed);
  } catch (error) {
    showError(describe(error));
  }
}

async function remove(conversation) {
  if (!confirm(`Delete “${titleOf(conversation)}”?`)) return;
  try {
    await api.deleteConversation(conversation.id);
  } catch (error) {
    if (error.status !== 404) return showError(describe(error));
  }
  listed.conversations = listed.conversations.filter((c) => c.id !== conversation.id);
  render();
  page.deleted(conversation);
}

/** Which group a conversation started at `createdAt` (seconds) is in, by the browser's calendar. */
export function dayOf(createdAt, now) {
  const startOf = (daysAgo) => new Date(now.getFullYear(), now.getMonth(), now.getDate() - daysAgo).getTime() / 1000;
  if (createdAt >= startOf(0)) return "Today";
  if (createdAt >= startOf(1)) return "Yesterday";
  return createdAt >= startOf(7) ? "Previous 7 days" : "Older";
}

/** A conversation's title, or when it has none the time it was started. */
export function titleOf(conversation) {
  return conversation.title || `Chat of ${new Date(conversation.created_at * 1000).toLocaleString()}`;
}

/** The title a conversation takes from its first message: the message's first line, cut to 80 characters. */
export function titleFrom(content) {
  return content.trim().split("\n")[0].trim().slice(0, MAX_TITLE_CHARS);
}

$("search").addEventListener("input", render);
$("older").addEventListener("click", () => loadConversations(true));
