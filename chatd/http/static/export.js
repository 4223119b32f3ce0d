// Download a conversation as a file: JSON (exactly what GET /v1/conversations/{id} answers, so
// it can be read back by any client) or Markdown (to read or paste elsewhere). The file is made
// in the browser; nothing is sent anywhere.

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
