// The chat page: conversations in the sidebar (newest first), the open one, and its reply as it
// streams in, with a Stop button (or Escape) and the time to first token and tokens/s under each
// reply; every message shows its token count. A reload in the middle of a reply picks it up
// again. Editing a message (or regenerating the last reply) replaces the conversation's tail from
// that message on: there are no branches. A reply cut at the token limit is continued by a next
// turn that asks for the rest (the conversations API has no other way). It reaches chatd only
// through api.js, shows model text only through render.js, and builds messages in messages.js,
// the sidebar's list in sidebar.js, settings in settings.js and the thumbs under replies in feedback.js.

import {api, apiKey, resumeReply, sendMessage} from "./api.js";
import {exportMenu} from "./export.js";
import {addRatings} from "./feedback.js";
import {showCopied} from "./icons.js";
import {COPY_LABEL, addActions, addMessage, addSaved, editInPlace, savedEnding, shownMessages, streamEnding, tokens} from "./messages.js";
import {describe, keyAdvice, showError} from "./notice.js";
import {copyText, markdownPainter} from "./render.js";
import {invalidSampling, sampling, showSettings, summarize, systemPrompt, withSampling} from "./settings.js";
import {forgetConversations, listNew, loadConversations, markOpen, onConversation, relist, titleFrom, titleOf} from "./sidebar.js";

const $ = (id) => document.getElementById(id);

// What a continuation asks, as the next user message: the model sees its cut reply just above it.
const CONTINUE_PROMPT = "Continue from exactly where your last reply stopped.";

const page = {
  current: null, // the open conversation with its messages as opened; null for a new chat
  reply: null, // the reply streaming into the open conversation: {conversationId, messageId, controller, cancelling}
};

// -- starting: the key, the models, the conversations ---------------------------------------

async function connect() {
  showError(null);
  const opened = location.hash.slice(1); // the conversation the page was opened on, if any
  try {
    fillModels((await api.models()).data);
  } catch (error) {
    if (error.status !== 401) return showError(describe(error), connect);
    $("key-form").hidden = false; // auth is on: nothing can be shown without a key
    $("api-key").focus();
    return showError(keyAdvice(error, apiKey.get() !== ""));
  }
  $("key-form").hidden = !apiKey.get();
  await loadConversations(false);
  // A chat sent while the lists loaded (a key typed, then a message at once) is left as it is:
  // opening or clearing one here would stop following its reply.
  if (page.current !== null || page.reply) return;
  if (opened) await openConversation(opened);
  else newChat(false); // the page opened on a new chat: keep what was typed while it loaded
}

// Chat models and aliases (not an embedding model); one that is not loaded says it loads first.
function fillModels(models) {
  const chosen = page.current?.model || $("model").value;
  const chat = models.filter((model) => model.chatd?.kind !== "embedding");
  const label = (model) => (model.status === "unloaded" ? `${model.id} (loads on first use)` : model.id);
  $("model").replaceChildren(...chat.map((model) => new Option(label(model), model.id)));
  if (chosen) $("model").value = chosen;
  summarize(page.current);
}

// -- opening and starting conversations ----------------------------------------------------

/** Show an empty chat; `clear`: also empty its settings (false at start, where a user may
 * already be typing a system prompt while the page loads its conversations). */
function newChat(clear = true) {
  leaveReply();
  page.current = null;
  history.replaceState(null, "", location.pathname);
  $("title").textContent = "New chat";
  $("export").hidden = true;
  showSettings(null, clear);
  $("messages").replaceChildren();
  markOpen(null);
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
    if (error.status === 404) return showError("That conversation no longer exists.");
    return showError(describe(error), () => openConversation(id));
  }
  page.current = conversation;
  history.replaceState(null, "", `#${id}`);
  showConversation(conversation);
  const last = conversation.messages.at(-1);
  // A reply that is still `partial` may be under way (or was cut short): follow it from its start.
  if (last?.role === "assistant" && last.status === "partial") {
    await followReply(conversation.id, addMessage("assistant"), null, (handlers) => resumeReply(conversation.id, last.id, handlers));
    refreshActions();
  }
}

function showConversation(conversation) {
  $("title").textContent = titleOf(conversation);
  $("export").hidden = false;
  showSettings(conversation);
  const shown = conversation.messages.filter((m, i, all) => !(i === all.length - 1 && m.role === "assistant" && m.status === "partial"));
  $("messages").replaceChildren();
  for (const message of shown) {
    const bubble = addSaved(message);
    const ending = savedEnding(message);
    // A reply chatd generated has its usage; a message or an item added through the API is counted.
    const generated = message.usage?.completion_tokens;
    if (generated) bubble.setStats([tokens(generated)], ending);
    else countTokens(bubble, ending);
  }
  refreshActions();
  markOpen(conversation.id);
  scrollToEnd(true);
}

/** Save the settings panel into the open conversation (a new chat takes them when it is made). */
async function saveSettings() {
  summarize(page.current);
  const invalid = invalidSampling();
  if (invalid) return showError(invalid);
  if (page.current === null) return;
  const fields = {metadata: withSampling(page.current.metadata)};
  if (systemPrompt() !== (page.current.system_prompt || null)) fields.system_prompt = systemPrompt();
  try {
    page.current = {...page.current, ...(await api.updateConversation(page.current.id, fields))};
  } catch (error) {
    return showError(describe(error), saveSettings);
  }
  showError(null);
  $("settings-note").textContent = "Saved: applies from the next message.";
}

// -- sending and following replies -----------------------------------------------------------

async function send(event) {
  event.preventDefault();
  const content = $("input").value.trim();
  if (!content || page.reply) return;
  const invalid = invalidSampling();
  if (invalid) return showError(invalid);
  showError(null);
  if (page.current === null && !(await startConversation(content))) return;
  $("input").value = "";
  await turn(content);
}

async function startConversation(content) {
  // Sent before the models are listed, a message goes to the server's default model (no `model`).
  const fields = {model: $("model").value || undefined, title: titleFrom(content), metadata: withSampling({})};
  if (systemPrompt()) fields.system_prompt = systemPrompt();
  try {
    const conversation = await api.createConversation(fields);
    page.current = {...conversation, messages: []};
    listNew(conversation);
  } catch (error) {
    showError(describe(error), () => $("composer").requestSubmit());
    return false;
  }
  history.replaceState(null, "", `#${page.current.id}`);
  showConversation(page.current);
  return true;
}

/** Post `content` as the next user message and show it and its reply. A message the server
 * refused is taken off the screen and put back in the composer, with a Retry. */
async function turn(content) {
  const conversationId = page.current.id;
  const user = addMessage("user", content);
  const bubble = addMessage("assistant");
  refreshActions();
  const ended = await followReply(conversationId, bubble, performance.now(),
    (handlers) => sendMessage(conversationId, content, {...handlers, sampling: sampling()}));
  if (ended === "refused") {
    user.element.remove();
    bubble.element.remove();
    $("input").value = content;
  } else if (ended !== "left") {
    countTokens(user);
  }
  refreshActions();
}

/** Show a reply as it streams into `bubble`; with `sentAt` (not a resumed reply) also how fast it came. */
async function followReply(conversationId, bubble, sentAt, open) {
  const reply = {conversationId, messageId: null, controller: new AbortController(), cancelling: null};
  page.reply = reply;
  setStreaming(true);
  const painter = markdownPainter(bubble.content);
  let firstTokenAt = null;
  let usage = null;
  let finishReason = null;
  let ended;
  try {
    ended = await open({
      signal: reply.controller.signal,
      onChunk(chunk) {
        if (reply.messageId === null) {
          reply.messageId = bubble.id = chunk.id;
          $("stop").disabled = false;
        }
        for (const choice of chunk.choices) {
          if (choice.delta?.content) {
            bubble.text += choice.delta.content;
            firstTokenAt ??= performance.now();
          }
          finishReason = choice.finish_reason || finishReason;
        }
        usage = chunk.usage || usage;
        if (!bubble.text) return; // the reply shows that it is awaited until its first text
        const atEnd = nearEnd();
        painter.update(bubble.text);
        scrollToEnd(atEnd);
      },
    });
  } catch (error) {
    if (reply.controller.signal.aborted) return "left"; // the page moved on; the reply goes on on the server
    showError(describe(error), () => $("composer").requestSubmit());
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
  bubble.finishReason = ended.error ? null : finishReason;
  bubble.setReplyStats({sentAt, firstTokenAt, endedAt, generated: usage?.completion_tokens}, streamEnding(ended.error, finishReason));
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
    showError(describe(error));
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
  $("messages").classList.toggle("streaming", on);
}

// -- copy, edit, regenerate, continue, rate -----------------------------------------------------

function refreshActions() {
  addActions({copy, edit, regenerate, continue: continueReply});
  addRatings(shownMessages());
}

async function copy(bubble) {
  showCopied(bubble.actions.querySelector(".copy"), await copyText(bubble.text), COPY_LABEL);
}

/** Ask for the rest of the last reply, which the token limit cut: a next turn, with the same settings. */
async function continueReply() {
  if (page.reply) return;
  showError(null);
  await turn(CONTINUE_PROMPT);
}

async function edit(bubble) {
  if (page.reply) return;
  const text = await editInPlace(bubble);
  if (text !== null) await resend(bubble.index(), text);
}

async function regenerate(bubble) {
  const question = shownMessages()[bubble.index() - 1];
  if (!page.reply && question?.role === "user") await resend(question.index(), question.text);
}

/** Replace the conversation's tail from the message at `index` on (on the server too) with `text` and its reply. */
async function resend(index, text) {
  showError(null);
  try {
    const {messages, title} = await api.conversation(page.current.id);
    const onScreen = shownMessages().slice(index);
    if (messages[index]?.role !== "user" || messages[index].content !== onScreen[0]?.text) {
      await openConversation(page.current.id); // changed elsewhere (another tab): show it as it is now
      return showError("The conversation changed since it was shown; here it is as it is now.");
    }
    for (const message of messages.slice(index).reverse()) await api.deleteItem(page.current.id, message.id);
    for (const bubble of onScreen) bubble.element.remove();
    if (index === 0) retitle(title, messages[0].content, text); // beside the reply: a failure only leaves the title
  } catch (error) {
    return showError(describe(error), () => resend(index, text));
  }
  await turn(text);
}

/** A conversation titled by its first message takes the title of that message as edited (`title`:
 * its title now, on the server); one renamed since keeps its name. */
async function retitle(title, before, after) {
  if (title !== titleFrom(before) || titleFrom(after) === title) return;
  try {
    const renamed = await api.updateConversation(page.current.id, {title: titleFrom(after)});
    relist(renamed);
    showRenamed(renamed);
  } catch (error) {
    showError(describe(error));
  }
}

/** Show the open conversation's new title, if `conversation` is the open one. */
function showRenamed(conversation) {
  if (page.current?.id !== conversation.id) return;
  page.current = {...page.current, title: conversation.title};
  $("title").textContent = titleOf(conversation);
}

// -- elements ---------------------------------------------------------------------------------

/** Show `bubble`'s token count, by the server's tokenizer; a count that cannot be had is left out. */
async function countTokens(bubble, ending = null) {
  bubble.setStats([], ending);
  try {
    bubble.setStats([tokens(await api.countTokens(page.current.model, bubble.text))], ending);
  } catch {
    // the count is a nicety: the message stands without it
  }
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
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && page.reply) {
    event.preventDefault();
    stop();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => newChat());
$("menu").addEventListener("click", () => {
  $("scrim").hidden = !$("app").classList.toggle("sidebar-open");
});
$("scrim").addEventListener("click", closeSidebar);
$("settings-form").addEventListener("submit", (event) => event.preventDefault());
$("settings-form").addEventListener("change", saveSettings);
exportMenu(exportConversation);
onConversation({
  open: (conversation) => openConversation(conversation.id),
  renamed: showRenamed,
  deleted: (conversation) => page.current?.id === conversation.id && newChat(),
});
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey.set($("api-key").value.trim());
  $("api-key").value = "";
  connect();
});
$("forget-key").addEventListener("click", () => {
  apiKey.set("");
  forgetConversations();
  newChat();
  connect();
});

async function exportConversation(download) {
  try {
    download(await api.conversation(page.current.id)); // as saved now, the replies since it was opened included
  } catch (error) {
    showError(describe(error), () => exportConversation(download));
  }
}

connect();
