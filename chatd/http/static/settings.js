// A conversation's settings panel: its model (chosen once, at the start), its system prompt and
// its sampling (temperature, top p, max tokens). The sampling is kept in the conversation's
// metadata, as strings (OpenAI's metadata holds strings), so it follows the conversation to any
// browser; each message is sent with it. The panel stays folded under its one-line summary, and a
// new chat opens on a short welcome that names its model instead. It knows nothing of the API:
// chat.js saves what it reads.

const $ = (id) => document.getElementById(id);

// The metadata key of each field, and the name the message POST gives it.
const SAMPLING = [
  {input: "temperature", key: "temperature", label: "temperature"},
  {input: "top-p", key: "top_p", label: "top p"},
  {input: "max-tokens", key: "max_completion_tokens", label: "max tokens"},
];

/** Show `conversation`'s settings, folded (null: a new chat, with its welcome; `clear` also empties
 * what was typed for it, and folds the panel, which is otherwise left as the user has it while the page loads). */
export function showSettings(conversation, clear = true) {
  $("model").disabled = conversation !== null;
  if (conversation !== null) {
    $("model").value = conversation.model;
    $("system-prompt").value = conversation.system_prompt || "";
    for (const field of SAMPLING) $(field.input).value = conversation.metadata?.[field.key] ?? "";
  } else if (clear) {
    $("system-prompt").value = "";
    for (const field of SAMPLING) $(field.input).value = "";
  }
  if (clear || conversation !== null) $("settings").open = false;
  $("welcome").hidden = conversation !== null;
  $("settings-note").textContent = conversation === null
    ? "Kept with the conversation, for each of its messages."
    : "Changes are saved with this conversation and apply from its next message.";
  summarize(conversation);
}

/** The one-line summary above the panel: the model and what differs from the defaults. */
export function summarize(conversation) {
  const model = conversation?.model || $("model").value || "…";
  $("welcome-model").textContent = model;
  const parts = [`Model: ${model}`];
  if ($("system-prompt").value.trim()) parts.push("system prompt");
  for (const field of SAMPLING) {
    if ($(field.input).value !== "") parts.push(`${field.label} ${$(field.input).value}`);
  }
  $("settings-summary").textContent = parts.join(" · ");
}

/** The system prompt as typed (null when empty). */
export function systemPrompt() {
  return $("system-prompt").value.trim() || null;
}

/** The sampling fields as a message POST takes them (numbers; the ones left empty are not sent). */
export function sampling() {
  const fields = {};
  for (const field of SAMPLING) {
    const input = $(field.input);
    if (input.value !== "" && input.checkValidity()) fields[field.key] = Number(input.value);
  }
  return fields;
}

/** `metadata` with the sampling as typed (strings; the ones left empty removed), other keys kept. */
export function withSampling(metadata) {
  const kept = {...metadata};
  for (const field of SAMPLING) {
    const value = $(field.input).value;
    if (value !== "" && $(field.input).checkValidity()) kept[field.key] = value;
    else delete kept[field.key];
  }
  return kept;
}

/** Which sampling field is out of its range, as a sentence (null when all are fine). */
export function invalidSampling() {
  const wrong = SAMPLING.find((field) => !$(field.input).checkValidity());
  if (!wrong) return null;
  const input = $(wrong.input);
  return `${wrong.label} must be a number from ${input.min}${input.max ? ` to ${input.max}` : " up"}`;
}
