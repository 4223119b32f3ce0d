"""The safety pipeline in the server: inputs refused or masked, replies cut as they stream, an audit trail.

Views call `Safety.check_input` with the texts of a request before rendering it: a category
whose policy blocks is a 400 in OpenAI's shape (`code: "content_policy_violation"`, with the
categories and an appeal id beside OpenAI's fields), a guard that cannot judge what must fail
closed is a 503, and what passes comes back masked where a policy redacts. `Safety.watch` wraps
an engine request so its text is checked as it streams (chatd/safety/stream.py): at a blocked
match the choice ends with `finish_reason: "content_filter"` and the policy notice, and the
engine request is stopped at once; while it checks outputs, `Safety.check_prompt_shown` refuses to
show alternatives to prompt tokens (text no check judges). Every block, flag and redaction is
stored as a moderation event (its id is the appeal id: POST /v1/appeals), counted in /metrics and
logged.

The checks themselves are chatd/safety/; this module only applies them to requests and replies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from chatd.config import SafetyConfig
from chatd.engine import CompletionOutput, FinishReason, Logprob, RequestHandle, RequestOutput
from chatd.http.errors import APIError
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.telemetry.tracing import Tracing
from chatd.safety.pipeline import SafetyPipeline
from chatd.safety.policy import Decision
from chatd.safety.rules import ALL_CATEGORIES
from chatd.safety.stream import OutputWindow
from chatd.store.db import Store, Tenant

log = logging.getLogger("chatd.http")

ACTION_EVENTS = {"block": "blocked", "flag": "flagged", "redact": "redacted"}  # a policy's action, as recorded


class Safety:
    """The safety pipeline as the server applies it: checks, refusals, the audit trail, metrics."""

    def __init__(self, pipeline: SafetyPipeline, store: Store, metrics: ServerMetrics,
                 token_text: Callable[[int], str] = str, tracing: Tracing = Tracing()) -> None:
        """token_text: a token id's text (the served tokenizer's), to judge logprobs' alternatives;
        tracing: where each choice's last output check is a span."""
        self.pipeline, self.store, self.metrics, self.token_text = pipeline, store, metrics, token_text
        self.tracing = tracing
        self.config: SafetyConfig = pipeline.config
        metrics.declare_safety(ALL_CATEGORIES)

    # -- inputs -----------------------------------------------------------------------------------

    async def check_input(self, tenant: Tenant, endpoint: str, texts: list[str], request_id: str | None,
                          conversation_id: str | None = None, model_name: str | None = None) -> list[str]:
        """The request's texts as the model may see them (masked where a policy redacts); raises the
        refusal when a policy blocks, or when the guard failed on a category that fails closed.
        model_name: the model the request is for, as its series say (None: the first)."""
        if not self.config.check_input or not any(texts):
            return texts
        timings: dict[str, float] = {}
        decision = await self.pipeline.check_input(texts, tenant.tier, timings)
        for check, seconds in timings.items():
            self.metrics.safety_check(check, seconds, model_name)
        record = _Recorder(self, tenant, "input", endpoint, "\n\n".join(texts), request_id, conversation_id)
        if decision.guard_failed is not None:
            self.metrics.guard_failed(model_name)
            log.warning("the guard model could not judge a request (%s); policies decide by their failure mode",
                        decision.guard_failed, extra={"request_id": request_id, "tenant": tenant.id})
        if decision.refused_unchecked:
            await record("guard_failed", decision.refused_unchecked)
            raise APIError(503, "the safety check could not run, and this service refuses what it cannot check "
                                f"({', '.join(decision.refused_unchecked)}); try again shortly", None,
                           "safety_check_unavailable", headers={"Retry-After": "5"})
        self._count(decision, "input", model_name)
        blocked = decision.blocked
        if blocked:
            event = await record("blocked", blocked)
            raise APIError(400, f"this request was refused by the content policy ({', '.join(blocked)}); to contest "
                                f"it, POST /v1/appeals with appeal_id {event.id!r}", None, "content_policy_violation",
                           extra={"categories": blocked, "appeal_id": event.id})
        for action in ("flag", "redact"):
            if decision.categories(action):
                await record(ACTION_EVENTS[action], decision.categories(action))
        if decision.guard_failed is not None:
            await record("guard_failed", ())
        return decision.texts

    def check_prompt_shown(self, prompt_logprobs: int | None, echoed_logprobs: int | None) -> None:
        """While outputs are checked, a reply shows no alternatives to prompt tokens (vLLM's
        `prompt_logprobs`, or a completion's `logprobs` with `echo`): they are text the model did not
        write and no check has judged. The prompt's own tokens, which the input check read, it may show."""
        if not self.config.check_output:
            return
        for param, k in (("prompt_logprobs", prompt_logprobs), ("logprobs", echoed_logprobs)):
            if k:
                with_echo = " with echo" if param == "logprobs" else ""
                raise APIError(400, f"{param} must be 0{with_echo} while the output check is on: alternatives to prompt "
                                    f"tokens are text no check has judged; got {k}", param)

    def _count(self, decision: Decision, stage: str, model_name: str | None) -> None:
        for finding in {(f.category, f.action) for f in decision.findings}:
            self.metrics.safety_action(finding[0], stage, finding[1], model_name)

    # -- outputs ----------------------------------------------------------------------------------

    def watch(self, handle: RequestHandle, tenant: Tenant, endpoint: str, num_choices: int, request_id: str | None,
              conversation_id: str | None = None, message_id: str | None = None,
              token_text: Callable[[int], str] | None = None, model_name: str | None = None) -> RequestHandle:
        """The engine request with its text checked as it streams (as it was, when outputs are not checked).
        token_text, model_name: the serving model's token texts and name (else the first model's)."""
        if not self.config.check_output:
            return handle

        async def on_end(window: OutputWindow) -> None:
            """Record what one choice's window found, once it has ended."""
            record = _Recorder(self, tenant, "output", endpoint, window.text, request_id, conversation_id, message_id)
            for finding in {(f.category, f.action) for f in window.findings}:
                self.metrics.safety_action(finding[0], "output", finding[1], model_name)
            with self.tracing.stage("chatd.output_check") as span:
                if span is not None:  # what was found, by category: never the text
                    span.set_attribute("chatd.safety.categories", sorted({f.category for f in window.findings}))
                if window.violation is not None:  # as for inputs, a refusal is the one record of its text
                    if span is not None:
                        span.set_attribute("chatd.refused", True)
                    await record("blocked", sorted({f.category for f in window.findings if f.action == "block"}))
                    return
                for action in ("flag", "redact"):
                    found = sorted({f.category for f in window.findings if f.action == action})
                    if found:
                        await record(ACTION_EVENTS[action], found)

        return WatchedReply(handle, lambda: self.pipeline.output_window(tenant.tier), num_choices,
                            self.config.output_notice, on_end, token_text or self.token_text)


class WatchedReply:
    """An engine request (a RequestHandle) whose choices' text passes through OutputWindows.

    Text is held back a few dozen characters, and each token's logprobs with it, until all the
    text the token wrote has been judged and sent: a blocked phrase leaves in no field. A choice
    cut by a blocked match ends with `content_filter` and the notice, later deltas of it are
    dropped (their tokens still count), and once every choice has ended the engine request is
    aborted so it computes no more."""

    def __init__(self, handle: RequestHandle, make_window: Callable[[], OutputWindow], num_choices: int,
                 notice: str, on_end: Callable[[OutputWindow], Awaitable[None]],
                 token_text: Callable[[int], str] = str) -> None:
        self.handle, self.request_id = handle, handle.request_id
        self.make_window, self.num_choices, self.notice, self.on_end = make_window, num_choices, notice, on_end
        self.token_text = token_text
        self.windows: dict[int, OutputWindow] = {}
        self.held: dict[int, HeldLogprobs] = {}
        self.ended: set[int] = set()
        self._iterator = handle.__aiter__()
        self._finished = False

    def abort(self) -> None:
        self.handle.abort()

    def __aiter__(self) -> WatchedReply:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        out = await self._iterator.__anext__()
        outputs = []
        for choice in out.outputs:
            window = self.windows.setdefault(choice.index, self.make_window())
            if choice.index in self.ended:  # cut earlier: nothing more is sent, its tokens still count
                outputs.append(dataclasses.replace(choice, text="", finish_reason=None, stop_reason=None, logprobs=None))
                continue
            final = choice.finish_reason is not None
            text = window.feed(choice.text, final=final)
            logprobs = self._logprobs(choice, window, final)
            if window.stopped:
                choice = dataclasses.replace(choice, text=text + _notice(window, self.notice), logprobs=logprobs,
                                             finish_reason=FinishReason.CONTENT_FILTER, stop_reason=None)
            else:
                choice = dataclasses.replace(choice, text=text, logprobs=logprobs)
            if choice.finish_reason is not None:
                self.ended.add(choice.index)
                await self.on_end(window)
            outputs.append(choice)
        finished = out.finished or len(self.ended) >= self.num_choices
        if finished and not out.finished:
            self.handle.abort()  # every choice was cut: stop computing the rest now
        self._finished = finished
        return dataclasses.replace(out, outputs=outputs, finished=finished)


    def _logprobs(self, choice: CompletionOutput, window: OutputWindow, final: bool) -> list[Logprob] | None:
        """The choice's logprobs that may leave now (None when none may)."""
        held = self.held.setdefault(choice.index, HeldLogprobs())
        if choice.logprobs is not None:
            held.add(choice.logprobs)
        if choice.text or final:  # the text of every token so far has reached the window
            held.text_ends_at(len(window.text))
        released = held.release(window, self.token_text)
        return released or None


class HeldLogprobs:
    """One choice's logprobs, held back with its text. A token's entry leaves once the window has
    sent all of the text up to the end of the delta that brought it (a token whose bytes the
    detokenizer held back waits for the next text); entries over text a block cut off never leave,
    those over masked text leave without it, and alternatives that would complete a blocked or
    masked match are left out."""

    def __init__(self) -> None:
        self._entries: list[list] = []  # [Logprob, where its text ends in window.text (None: not known yet)]
        self._sent_upto = 0  # where the text of the entries released so far ends

    def add(self, logprobs: list[Logprob]) -> None:
        self._entries += [[logprob, None] for logprob in logprobs]

    def text_ends_at(self, end: int) -> None:
        for entry in self._entries:
            if entry[1] is None:
                entry[1] = end

    def release(self, window: OutputWindow, token_text: Callable[[int], str]) -> list[Logprob]:
        out = []
        while self._entries and self._entries[0][1] is not None and self._entries[0][1] <= window.released:
            logprob, end = self._entries.pop(0)
            start, self._sent_upto = self._sent_upto, end
            if window.masks(start, end):
                continue  # its token spelled (part of) masked text
            out.append(self._judged_alternatives(logprob, window, start, token_text))
        if window.stopped:
            self._entries.clear()  # they spell what the block cut off
        return out

    @staticmethod
    def _judged_alternatives(logprob: Logprob, window: OutputWindow, start: int,
                             token_text: Callable[[int], str]) -> Logprob:
        others = [token_id for token_id in logprob.top if token_id != logprob.token_id]
        if not others:
            return logprob
        refused = window.refused(start, [token_text(token_id) for token_id in others])
        if not refused:
            return logprob
        dropped = {others[i] for i in refused}
        return dataclasses.replace(logprob, top={t: v for t, v in logprob.top.items() if t not in dropped})


def input_strings(messages: list[dict], tools: list[dict] | None) -> tuple[list[str], Callable[[list[str]], None]]:
    """Every string of a chat request that reaches the model, for the input check: each message's
    content first (in order, so a guard reads the conversation as written), then the messages'
    other strings (names, tool call ids, call arguments) and the tools' names, descriptions and
    parameter schemas, keys included. Returns the texts, and a function that puts checked texts
    (masked where a policy redacts) back where they came from; a masked key is refused by name."""
    texts = [message["content"] for message in messages]
    slots: list[tuple[Any, Any, str]] = []  # (container, key, where) of each string after the contents
    stack: list[tuple[Any, str]] = [(tool, f"tools[{i}]") for i, tool in reversed(list(enumerate(tools or [])))]
    stack += [(message, f"messages[{i}]") for i, message in reversed(list(enumerate(messages)))]
    keys: list[tuple[str, str]] = []  # (key, where) of schema keys, checked but not masked
    while stack:
        node, where = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
        if where.startswith("messages") and "." not in where:  # a message: its role is a name, its content is above
            items = [(key, value) for key, value in items if key not in ("role", "content")]
        children = []
        for key, value in items:
            at = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            if isinstance(key, str) and ".parameters" in where:
                keys.append((key, at))
            if isinstance(value, str):
                slots.append((node, key, at))
            elif isinstance(value, (dict, list)):
                children.append((value, at))
        stack += reversed(children)
    texts += [container[key] for container, key, _ in slots] + [key for key, _ in keys]
    originals = list(texts)

    def write_back(checked: list[str]) -> None:
        for message, text in zip(messages, checked):
            message["content"] = text
        rest = checked[len(messages):]
        for (container, key, _), text in zip(slots, rest):
            container[key] = text
        for (key, where), text, before in zip(keys, rest[len(slots):], originals[len(messages) + len(slots):]):
            if text != before:
                raise APIError(400, f"{where} names a property with text the content policy masks", where,
                               "content_policy_violation")

    return texts, write_back


def _notice(window: OutputWindow, notice: str) -> str:
    """The notice, in a paragraph of its own unless nothing of the reply was sent."""
    if not notice:
        return ""
    return notice if not window.text[: window.released].strip() else "\n\n" + notice


class _Recorder:
    """Stores moderation events for one request's text, keeping of it what [safety] audit_text says."""

    def __init__(self, safety: Safety, tenant: Tenant, stage: str, endpoint: str, text: str, request_id: str | None,
                 conversation_id: str | None = None, message_id: str | None = None) -> None:
        self.safety, self.tenant, self.stage, self.endpoint = safety, tenant, stage, endpoint
        self.text, self.request_id, self.conversation_id, self.message_id = text, request_id, conversation_id, message_id

    async def __call__(self, action: str, categories) -> object:
        keep = self.safety.config.audit_text
        event = await self.safety.store.add_moderation_event(
            self.tenant.id, stage=self.stage, action=action, categories=list(categories), endpoint=self.endpoint,
            excerpt=self.text if keep == "excerpt" else None,
            text_sha256=hashlib.sha256(self.text.encode()).hexdigest() if keep == "hash" else None,
            request_id=self.request_id, conversation_id=self.conversation_id, message_id=self.message_id)
        log.info("safety %s", action, extra={"request_id": self.request_id, "tenant": self.tenant.id, "stage": self.stage,
                                             "categories": ",".join(categories), "appeal_id": event.id})
        return event
