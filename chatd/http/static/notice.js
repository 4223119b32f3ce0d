// The page's one error line, above the composer: what went wrong as a user should read it (the
// server unreachable, a 429 or 503 with how long to wait, a refusal's own message), and a Retry
// button that does again what failed. It knows nothing of what is retried.

const $ = (id) => document.getElementById(id);

let retrying = null; // what the Retry button does now

/** An ApiError as a user should read it: what happened, and when to try again if the server said. */
export function describe(error) {
  const said = error.message.replace(/\.$/, "");
  const wait = error.retryAfter ? ` Try again in ${error.retryAfter} s.` : "";
  if (error.status === 0) return `Cannot reach the chatd server at ${location.origin}: is it running?`;
  if (error.status === 429) return `Too many requests: ${said}.${wait}`;
  if (error.status === 503) return `The server cannot take this now: ${said}.${wait}`;
  return `${said}.`;
}

/** What to type, from a 401: the server says where its keys come from, in parentheses (auth.py):
 * `chatd keys create` with the key database, the key it was started with when it has one shared key. */
export function keyAdvice(error, keyWasSent) {
  const where = error.message.match(/\(([^()]*)\)$/)?.[1];
  const said = keyWasSent ? "The server refused this API key" : "This server needs an API key";
  return where ? `${said}: ${where}.` : `${said}.`;
}

/** Show `message` (null hides it); with `retry`, a Retry button that calls it. */
export function showError(message, retry = null) {
  retrying = message ? retry : null;
  $("error").hidden = !message;
  $("error-text").textContent = message || "";
  $("retry").hidden = !retrying;
}

$("retry").addEventListener("click", () => {
  const retry = retrying;
  showError(null);
  retry?.();
});
