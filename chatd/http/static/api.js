// The chatd API as the chat page calls it: JSON requests that carry the API key, and replies read
// as Server-Sent Events from a fetch body (EventSource can neither POST nor send a key), picked up
// again with Last-Event-ID when the connection drops. It knows nothing of the page's elements.

const KEY_STORAGE = "chatd.apiKey";
const RECONNECTS = 5; // tries to pick up a reply whose connection dropped, 0.5 s apart and more

/** The API key, kept in this browser's localStorage only. */
export const apiKey = {
  get: () => localStorage.getItem(KEY_STORAGE) || "",
  set: (key) => (key ? localStorage.setItem(KEY_STORAGE, key) : localStorage.removeItem(KEY_STORAGE)),
};

/** An error chatd answered, in OpenAI's shape: its message, its code (null for most), and the
 * seconds its Retry-After header asks to wait (null without one). Status 0: no answer at all. */
export class ApiError extends Error {
  constructor(status, error, retryAfter = null) {
    super(error?.message || `the server answered ${status}`);
    this.status = status;
    this.code = error?.code || null;
    this.retryAfter = retryAfter;
  }
}

/** What fetch throws when nothing answered (the server is down, or the network is). */
const unreachable = () => new ApiError(0, {message: `cannot reach the chatd server at ${location.origin}`, code: "unreachable"});

const path = (...parts) => "/v1/conversations/" + parts.map(encodeURIComponent).join("/");

async function request(method, url, {body, headers = {}, signal} = {}) {
  const key = apiKey.get();
  const init = {method, signal, headers: key ? {...headers, Authorization: `Bearer ${key}`} : {...headers}};
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(url, init);
  } catch (error) {
    throw signal?.aborted ? error : unreachable();
  }
  if (!response.ok) {
    let error = null;
    try {
      error = (await response.json()).error;
    } catch {
      // not chatd's JSON (a proxy's page): the status says enough
    }
    const retryAfter = Number(response.headers.get("Retry-After")) || null;
    throw new ApiError(response.status, error, retryAfter);
  }
  return response;
}

async function call(method, url, body) {
  return (await request(method, url, {body})).json();
}

export const api = {
  models: () => call("GET", "/v1/models"),
  conversations: (after) => call("GET", "/v1/conversations?limit=50" + (after ? `&after=${encodeURIComponent(after)}` : "")),
  conversation: (id) => call("GET", path(id)),
  createConversation: (fields) => call("POST", "/v1/conversations", fields),
  /** Change some of a conversation's `title`, `system_prompt` and `metadata` (which is replaced whole). */
  updateConversation: (id, fields) => call("POST", path(id), fields),
  deleteConversation: (id) => call("DELETE", path(id)),
  deleteItem: (conversationId, itemId) => call("DELETE", path(conversationId, "items", itemId)),
  /** Copy messages into a conversation: `items` as [{role, content}], at most 20 a call. */
  addItems: (conversationId, items) => call("POST", path(conversationId, "items"),
    {items: items.map(({role, content}) => ({type: "message", role, content}))}),
  /** How many tokens `text` is for the served model's own tokenizer. */
  countTokens: (model, text) => call("POST", "/tokenize", {model, prompt: text}).then((answer) => answer.count),
  /** Stop a reply being generated; resolves to the message as saved (its usage included). */
  cancelReply: (conversationId, messageId) => call("POST", path(conversationId, "messages", messageId, "cancel")),
  /** Rate a reply (a message's id) "up" or "down", with an optional comment; it replaces the reply's
   * earlier rating, comment included. Resolves to the rating as kept (POST /v1/feedback). */
  rate: (replyId, rating, comment) => call("POST", "/v1/feedback", {id: replyId, rating, comment}),
};

/**
 * Send a user message and follow its reply; `sampling` adds fields such as temperature, top_p and
 * max_completion_tokens. `onChunk` gets each chat.completion.chunk (the first one's id is the
 * reply's message id). Resolves to how the reply ended: `{done: true}`, or `{error}` with chatd's
 * error (its code says why: reply_cancelled, reply_interrupted...).
 */
export async function sendMessage(conversationId, content, {signal, onChunk, sampling = {}}) {
  const response = await request("POST", path(conversationId, "messages"), {
    body: {...sampling, content, stream: true, stream_options: {include_usage: true}},
    signal,
  });
  return follow(conversationId, null, response, signal, onChunk);
}

/** Follow a reply from its first event: the events so far, then the live rest (as sendMessage). */
export async function resumeReply(conversationId, messageId, {signal, onChunk}) {
  return follow(conversationId, messageId, null, signal, onChunk);
}

async function follow(conversationId, messageId, response, signal, onChunk) {
  let lastEventId = 0;
  for (let attempt = 0; attempt <= RECONNECTS; attempt++) {
    try {
      if (response === null) {
        if (attempt > 0) await sleep(500 * attempt, signal);
        response = await request("GET", path(conversationId, "messages", messageId, "stream"), {
          headers: {"Last-Event-ID": String(lastEventId)},
          signal,
        });
      }
      for await (const event of serverSentEvents(response)) {
        if (event.id !== null) lastEventId = event.id;
        if (event.data === "[DONE]") return {done: true};
        const payload = JSON.parse(event.data);
        if (payload.error) return {error: payload.error};
        messageId ??= payload.id;
        attempt = 0;
        onChunk(payload);
      }
    } catch (error) {
      // The page let go of it, or the server refused it (a 404: the conversation is gone).
      // No answer at all (status 0) is a dropped connection like any other: try again.
      if (signal?.aborted || (error instanceof ApiError && error.status !== 0)) throw error;
    }
    if (messageId === null) break; // nothing to pick up: the reply never began
    response = null; // the connection ended before the reply did: pick it up after the last event
  }
  return {error: {message: "the connection to the server was lost", code: "connection_lost"}};
}

/** The events of an SSE body as {id, data}; comments (keep-alives) are skipped. */
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let id = null;
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("id:")) id = Number(line.slice(3));
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield {id, data: data.join("\n")};
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason);
    }, {once: true});
  });
}
