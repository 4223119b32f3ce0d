"""A golden set: JSON lines, one item each, read and checked before anything is sent.

Each item is a `prompt` (a user message) or `messages` (a chat), and exactly one scoring key
saying how its reply passes:

    exact    the reply, stripped, equals this text
    regex    the pattern is found in the reply (Python's `re.search`)
    schema   the reply is JSON (alone, or the first {...} or [...] in it) valid under this JSON Schema
    number   the first number in the reply is within `tolerance` (default 0) of this value: a
             number, or {"value": 42, "tolerance": 0.5}
    rubric   a judge model (`--judge-base-url`, `--judge-model`) reads the rubric, the question
             and the reply, and says PASS or FAIL

Optional: `id` (else its line number), `max_tokens` (default 256), `source` (where it came from:
`chatd eval add` writes the rating or appeal), `failed_reply` (the reply that was reported, kept
for the reader and shown to the judge as what not to do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SCORING_KEYS = ("exact", "regex", "schema", "number", "rubric")
ITEM_KEYS = {"id", "prompt", "messages", "max_tokens", "source", "failed_reply", *SCORING_KEYS}
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class GoldenItem:
    """One question of a golden set and how its reply is scored."""

    id: str
    messages: tuple[dict, ...]
    scoring: str  # one of SCORING_KEYS
    expected: object  # that key's value
    max_tokens: int = DEFAULT_MAX_TOKENS
    failed_reply: str | None = None
    source: str | None = None

    @property
    def question(self) -> str:
        """The last user message: what a judge is shown as the question."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


def load_golden(path: Path) -> list[GoldenItem]:
    """Every item of a golden set; ValueError naming the line and the key of the first mistake."""
    items, seen = [], set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        item = _item(raw, where, str(number))
        if item.id in seen:
            raise ValueError(f"{where}: id {item.id!r} is used twice")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def _item(raw, where: str, number: str) -> GoldenItem:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an item must be a JSON object")
    unknown = sorted(set(raw) - ITEM_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; an item has {', '.join(sorted(ITEM_KEYS))}")
    scoring = [key for key in SCORING_KEYS if key in raw]
    if len(scoring) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(SCORING_KEYS)} (how the reply is scored), "
                         f"got {scoring or 'none'}")
    [key] = scoring
    _check_expected(key, raw[key], where)
    if ("prompt" in raw) == ("messages" in raw):
        raise ValueError(f"{where}: give a prompt (a user message) or messages (a chat), not both or neither")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str) or not raw["prompt"]:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        messages = ({"role": "user", "content": raw["prompt"]},)
    else:
        messages = raw["messages"]
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in messages)):
            raise ValueError(f"{where}: messages must be a list of {{\"role\": system|user|assistant, \"content\": "
                             "text}}")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 65536:
        raise ValueError(f"{where}: max_tokens must be an integer in [1, 65536], got {max_tokens!r}")
    item_id = raw.get("id", number)
    if not isinstance(item_id, str | int) or isinstance(item_id, bool):
        raise ValueError(f"{where}: id must be a string or an integer")
    return GoldenItem(str(item_id), messages, key, raw[key], max_tokens, raw.get("failed_reply"), raw.get("source"))


def _check_expected(key: str, value, where: str) -> None:
    if key in ("exact", "rubric") and (not isinstance(value, str) or not value):
        raise ValueError(f"{where}: {key} must be a non-empty string")
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: regex must be a non-empty pattern")
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{where}: regex is not a valid pattern ({exc})") from None
    if key == "schema" and not isinstance(value, dict):
        raise ValueError(f"{where}: schema must be a JSON Schema object")
    if key == "number":
        number = value.get("value") if isinstance(value, dict) else value
        tolerance = value.get("tolerance", 0) if isinstance(value, dict) else 0
        if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (number, tolerance)) or tolerance < 0:
            raise ValueError(f"{where}: number must be a number, or {{\"value\": number, \"tolerance\": number >= 0}}")
