"""Whether a reply passes its item (golden.py's scoring keys), and the judge that reads rubrics.

Every scorer returns (passed, why): `why` is what the report prints beside a failed item. The
judge is any OpenAI-compatible chat endpoint (chatd itself included): it is asked, at temperature
0, to end its answer with PASS or FAIL; an answer with neither counts as a failure, and says so.
"""

from __future__ import annotations

import json
import re

import aiohttp

from chatd.evals.golden import GoldenItem

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
VERDICT = re.compile(r"\b(PASS|FAIL)\b")
JUDGE_INSTRUCTIONS = (
    "You grade a reply against a rubric. Read the rubric, the question and the reply, then answer "
    "with one short reason and, on the last line, exactly PASS or FAIL.")


def score(item: GoldenItem, reply: str) -> tuple[bool, str]:
    """Score a reply by its item's key (not `rubric`: the judge's, `Judge.grade`)."""
    expected = item.expected
    if item.scoring == "exact":
        return (reply.strip() == expected.strip()), f"expected {expected.strip()!r}"
    if item.scoring == "regex":
        return (re.search(expected, reply) is not None), f"no match for /{expected}/"
    if item.scoring == "number":
        return _number(reply, expected)
    if item.scoring == "schema":
        return _schema(reply, expected)
    raise ValueError(f"{item.scoring} items are graded by the judge")


def _number(reply: str, expected) -> tuple[bool, str]:
    value = expected["value"] if isinstance(expected, dict) else expected
    tolerance = expected.get("tolerance", 0) if isinstance(expected, dict) else 0
    found = NUMBER.search(reply.replace(",", ""))
    if found is None:
        return False, f"no number in the reply (expected {value})"
    got = float(found.group())
    return abs(got - value) <= tolerance, f"{got:g} is not {value:g} ± {tolerance:g}"


def _schema(reply: str, schema: dict) -> tuple[bool, str]:
    import jsonschema

    document = _json_in(reply)
    if document is None:
        return False, "the reply holds no JSON"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as exc:
        return False, f"invalid under the schema: {exc.message}"
    return True, ""


def _json_in(reply: str):
    """The reply as JSON, or the first JSON object or array in it; None if there is none."""
    decoder = json.JSONDecoder()
    for start in [0] + [i for i, c in enumerate(reply) if c in "{["]:
        try:
            return decoder.raw_decode(reply.strip() if start == 0 else reply[start:])[0]
        except json.JSONDecodeError:
            continue
    return None


class Judge:
    """A chat model that grades rubric items: `base_url` (…/v1), `model`, an optional key."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, api_key: str | None = None) -> None:
        self.session, self.url, self.model = session, base_url.rstrip("/") + "/chat/completions", model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def grade(self, item: GoldenItem, reply: str) -> tuple[bool, str]:
        """PASS or FAIL from the judge, with its reason."""
        shown = f"Rubric: {item.expected}\n\nQuestion: {item.question}\n\nReply: {reply}"
        if item.failed_reply:
            shown += f"\n\nA reply users reported as bad, which this one must not repeat: {item.failed_reply}"
        body = {"model": self.model, "temperature": 0, "max_tokens": 256,
                "messages": [{"role": "system", "content": JUDGE_INSTRUCTIONS}, {"role": "user", "content": shown}]}
        async with self.session.post(self.url, json=body, headers=self.headers) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"the judge answered {response.status}: {answer}")
        text = answer["choices"][0]["message"]["content"] or ""
        verdicts = VERDICT.findall(text)
        if not verdicts:
            return False, f"the judge gave no PASS or FAIL: {text[:120]!r}"
        return verdicts[-1] == "PASS", text.strip()[:200]
