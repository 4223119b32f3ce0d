// The chat page: conversations in the sidebar (newest first), the open one, and its reply as it
// streams in, with a Stop button and the time to first token and tokens/s under each reply. A
// reload in the middle of a reply picks it up again. It reaches chatd only through api.js and
// shows model text only through render.js.

import {api, apiKey, resumeReply, sendMessage} from "./api.js";
import {markdownPainter, renderMarkdown} from "./render.js";

const $ = (id) => document.getElementById(id);

const page = {
  conversations: [], // the caller's, newest first, as far as listed
  hasMore: false,
  current: null, // the open conversation with its messages; null for a new chat
  reply: null, // the reply streaming into the open conversation: {conversationId, messageId, controller, cancelling}
};

// How a reply that did not end with [DONE] is labelled, by chatd's error code.
const ENDINGS = {
  reply_cancelled: "stopped",
  reply_interrupted: "incomplete: the server stopped before the reply ended",
  conversation_deleted: "the conversation was deleted",
  connection_lost: "the connection to the server was lost",
};

// -- starting: the key, the models, the conversations ---------------------------------------

async function connect() {
  showError(null);
  const opened = location.hash.slice(1); // the conversation the page was opened on, if any
  try {
    fillModels((await api.models()).data);
  } catch (error) {
    if (error.status !== 401) return showError(error.message);
    $("key-form").hidden = false; // auth is on: nothing can be shown without a key
    $("api-key").focus();
    return showError(apiKey.get() ? "The server refused this API key." : "This server needs an API key (`chatd keys create`).");
  }
  $("key-form").hidden = !apiKey.get();
  await loadConversations(false);
  // A chat sent while the lists loaded (a key typed, then a message at once) is left as it is:
  // opening or clearing one here would stop following its reply.
  if (page.current !== null || page.reply) return;
  if (opened) await openConversation(opened);
  else newChat(false); // the page opened on a new chat: keep what was typed while it loaded
}

function fillModels(models) {
  $("model").replaceChildren(...models.map((model) => new Option(model.id, model.id)));
}

async function loadConversations(older) {
  try {
    const list = await api.conversations(older ? page.conversations.at(-1)?.id : undefined);
    page.conversations = older ? [...page.conversations, ...list.data] : list.data;
    page.hasMore = list.has_more;
  } catch (error) {
    showError(error.message);
  }
  renderSidebar();
}

function renderSidebar() {
  const items = page.conversations.map((conversation) => {
    const item = document.createElement("li");
    item.dataset.id = conversation.id;
    item.classList.toggle("current", conversation.id === page.current?.id);
    const open = button("open", titleOf(conversation), () => openConversation(conversation.id));
    open.title = titleOf(conversation);
    const rename = button("rename", "✎", () => renameConversation(conversation));
    rename.setAttribute("aria-label", `Rename “${titleOf(conversation)}”`);
    const remove = button("delete", "✕", () => deleteConversation(conversation));
    remove.setAttribute("aria-label", `Delete “${titleOf(conversation)}”`);
    item.append(open, rename, remove);
    return item;
  });
  $("conversations").replaceChildren(...items);
  $("older").hidden = !page.hasMore;
}

// -- opening, starting and deleting conversations --------------------------------------------

/** Show an empty chat; `clear`: also empty the system prompt (false at start, where a user may
 * already be typing in it while the page loads its conversations). */
function newChat(clear = true) {
  leaveReply();
  page.current = null;
  history.replaceState(null, "", location.pathname);
  $("title").textContent = "New chat";
  $("setup").hidden = false;
  if (clear) $("system-prompt").value = "";
  $("about").hidden = true;
  $("messages").replaceChildren();
  renderSidebar();
  closeSidebar();
  if (clear || document.activeElement === document.body) $("input").focus();
}

async function openConversation(id) {
  leaveReply();
  closeSidebar();
  showError(null);
  let conversation;
  try {
    conversation = await api.conversation(id);
  } catch (error) {
    newChat();
    return showError(error.status === 404 ? "That conversation no longer exists." : error.message);
  }
  page.current = conversation;
  history.replaceState(null, "", `#${id}`);
  showConversation(conversation);
  const last = conversation.messages.at(-1);
  // A reply that is still `partial` may be under way (or was cut short): follow it from its start.
  if (last?.role === "assistant" && last.status === "partial") {
    await followReply(conversation.id, addMessage("assistant"), null, (handlers) => resumeReply(conversation.id, last.id, handlers));
  }
}

function showConversation(conversation) {
  $("title").textContent = titleOf(conversation);
  $("setup").hidden = true;
  $("about").hidden = false;
  $("about").querySelector("summary").textContent = `Model: ${conversation.model}` + (conversation.system_prompt ? " · system prompt" : "");
  $("about-system").textContent = conversation.system_prompt || "No system prompt.";
  const shown = conversation.messages.filter((m, i, all) => !(i === all.length - 1 && m.role === "assistant" && m.status === "partial"));
  $("messages").replaceChildren();
  for (const message of shown) {
    const bubble = addMessage(message.role, message.content);
    if (message.role === "assistant") {
      bubble.stats.textContent = message.status === "complete" ? `${message.usage.completion_tokens} tokens` : "";
      if (message.status !== "complete") ending(bubble, message.status === "error" ? "generation failed" : "incomplete");
    }
  }
  renderSidebar();
  scrollToEnd(true);
}

async function renameConversation(conversation) {
  const title = prompt("Rename the conversation", conversation.title || "");
  if (title === null || !title.trim()) return;
  try {
    const renamed = await api.renameConversation(conversation.id, title.trim());
    page.conversations = page.conversations.map((c) => (c.id === renamed.id ? renamed : c));
    if (page.current?.id === renamed.id) $("title").textContent = titleOf(renamed);
  } catch (error) {
    return showError(error.message);
  }
  renderSidebar();
}

async function deleteConversation(conversation) {
  if (!confirm(`Delete “${titleOf(conversation)}”?`)) return;
  try {
    await api.deleteConversation(conversation.id);
  } catch (error) {
    if (error.status !== 404) return showError(error.message);
  }
  page.conversations = page.conversations.filter((c) => c.id !== conversation.id);
  if (page.current?.id === conversation.id) newChat();
  else renderSidebar();
}

// -- sending and following replies -----------------------------------------------------------

async function send(event) {
  event.preventDefault();
  const content = $("input").value.trim();
  if (!content || page.reply) return;
  showError(null);
  if (page.current === null) {
    const fields = {model: $("model").value, title: content.split("\n")[0].slice(0, 40)};
    const systemPrompt = $("system-prompt").value.trim();
    if (systemPrompt) fields.system_prompt = systemPrompt;
    try {
      const conversation = await api.createConversation(fields);
      page.current = {...conversation, messages: []};
      page.conversations.unshift(conversation);
    } catch (error) {
      return showError(error.message);
    }
    history.replaceState(null, "", `#${page.current.id}`);
    showConversation(page.current);
  }
  const conversationId = page.current.id;
  $("input").value = "";
  addMessage("user", content);
  const bubble = addMessage("assistant");
  const sentAt = performance.now();
  const ended = await followReply(conversationId, bubble, sentAt, (handlers) => sendMessage(conversationId, content, handlers));
  if (ended === "refused") {
    bubble.element.previousElementSibling.remove();
    bubble.element.remove();
    $("input").value = content;
  }
}

/** Show a reply as it streams into `bubble`; with `sentAt` (not a resumed reply) also how fast it came. */
async function followReply(conversationId, bubble, sentAt, open) {
  const reply = {conversationId, messageId: null, controller: new AbortController(), cancelling: null};
  page.reply = reply;
  setStreaming(true);
  const painter = markdownPainter(bubble.content);
  let text = "";
  let firstTokenAt = null;
  let usage = null;
  let finishReason = null;
  let ended;
  try {
    ended = await open({
      signal: reply.controller.signal,
      onChunk(chunk) {
        if (reply.messageId === null) {
          reply.messageId = chunk.id;
          $("stop").disabled = false;
        }
        for (const choice of chunk.choices) {
          if (choice.delta?.content) {
            text += choice.delta.content;
            firstTokenAt ??= performance.now();
          }
          finishReason = choice.finish_reason || finishReason;
        }
        usage = chunk.usage || usage;
        const atEnd = nearEnd();
        painter.update(text);
        scrollToEnd(atEnd);
      },
    });
  } catch (error) {
    if (reply.controller.signal.aborted) return "left"; // the page moved on; the reply goes on on the server
    showError(error.message);
    return "refused";
  } finally {
    if (page.reply === reply) {
      page.reply = null;
      setStreaming(false);
    }
  }
  const endedAt = performance.now();
  painter.flush();
  bubble.element.classList.remove("waiting");
  if (ended.error?.code === "reply_cancelled" && reply.cancelling) {
    usage = (await reply.cancelling.catch(() => null))?.usage || usage; // the stopped reply's usage, as saved
  }
  const parts = [];
  if (sentAt !== null && firstTokenAt !== null) parts.push(`first token ${seconds(firstTokenAt - sentAt)}`);
  const tokens = usage?.completion_tokens;
  if (tokens) parts.push(`${tokens} tokens`);
  if (sentAt !== null && firstTokenAt !== null && tokens > 1 && endedAt > firstTokenAt) {
    parts.push(`${((tokens - 1) / ((endedAt - firstTokenAt) / 1000)).toFixed(1)} tokens/s`);
  }
  bubble.stats.textContent = parts.join(" · ");
  if (ended.error) ending(bubble, ENDINGS[ended.error.code] || `failed: ${ended.error.message}`);
  else if (finishReason === "length") ending(bubble, "cut at the token limit");
  return ended.error ? "ended" : "done";
}

async function stop() {
  const reply = page.reply;
  if (!reply?.messageId) return;
  $("stop").disabled = true;
  reply.cancelling = api.cancelReply(reply.conversationId, reply.messageId);
  try {
    await reply.cancelling;
  } catch (error) {
    showError(error.message);
  }
}

/** Stop following the reply on screen (the page is leaving its conversation); the server finishes it anyway. */
function leaveReply() {
  if (page.reply) {
    page.reply.controller.abort();
    page.reply = null;
    setStreaming(false);
  }
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("stop").disabled = true; // until the reply's id is known
}

// -- elements ---------------------------------------------------------------------------------

/** A message in the open conversation: user text as typed, assistant text as markdown. */
function addMessage(role, content = null) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "content";
  const stats = document.createElement("div");
  stats.className = "stats";
  element.append(body, stats);
  if (role === "user") body.textContent = content;
  else if (content === null) element.classList.add("waiting");
  else renderMarkdown(body, content);
  $("messages").append(element);
  return {element, content: body, stats};
}

function ending(bubble, label) {
  const note = document.createElement("span");
  note.className = "ended";
  note.textContent = label;
  if (bubble.stats.textContent) bubble.stats.append(" · ");
  bubble.stats.append(note);
}

function button(className, label, onClick) {
  const element = document.createElement("button");
  element.type = "button";
  element.className = className;
  element.textContent = label;
  element.addEventListener("click", onClick);
  return element;
}

function titleOf(conversation) {
  return conversation.title || `Chat of ${new Date(conversation.created_at * 1000).toLocaleString()}`;
}

function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

function nearEnd() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function scrollToEnd(wanted) {
  if (wanted) $("messages").scrollTop = $("messages").scrollHeight;
}

function closeSidebar() {
  $("app").classList.remove("sidebar-open");
  $("scrim").hidden = true;
}

// -- wiring -----------------------------------------------------------------------------------

$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => newChat());
$("older").addEventListener("click", () => loadConversations(true));
$("menu").addEventListener("click", () => {
  $("scrim").hidden = !$("app").classList.toggle("sidebar-open");
});
$("scrim").addEventListener("click", closeSidebar);
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey.set($("api-key").value.trim());
  $("api-key").value = "";
  connect();
});
$("forget-key").addEventListener("click", () => {
  apiKey.set("");
  page.conversations = [];
  newChat();
  connect();
});

connect();
