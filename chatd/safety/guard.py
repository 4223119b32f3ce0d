"""The guard model: a Llama Guard checkpoint, served by chatd's own engine, judging inputs.

The guard reads the text to judge as a user turn, rendered by its own chat template (which
writes the guard's instructions and category list), and answers `safe`, or `unsafe` and the
codes of the categories it saw (`unsafe\\nS1,S10`). Each family numbers its categories its own
way; FAMILIES maps each code to OpenAI's moderation categories (a code with no counterpart,
such as Llama Guard 3's S8 "Intellectual Property", maps to none and is recorded only). The
answer is generated under a grammar of the family's verdicts, so it always parses.

It runs on a second engine in the same process, at the best priority, and knows nothing of
HTTP: it gets an `EngineClient` and a tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from chatd.engine import EngineClient, Placement, SamplingParams, StructuredOutput, Tokenizer

log = logging.getLogger("chatd.safety")


@dataclass(frozen=True)
class GuardFamily:
    """One family of guard models: its category codes (and what they mean in OpenAI's terms)."""

    name: str
    codes: dict[str, tuple[str, ...]]  # the family's code -> OpenAI moderation categories
    marker: str  # a line its chat template writes, by which the family is recognised

    @property
    def verdict_pattern(self) -> str:
        """What the guard may answer: `safe`, or `unsafe` and one or more of its codes."""
        code = "(" + "|".join(sorted(self.codes, key=len, reverse=True)) + ")"
        return rf"\s*(safe|unsafe\n{code}(,{code})*)"


_LLAMA_GUARD_2 = {
    "S1": ("violence", "illicit/violent"),  # Violent Crimes
    "S2": ("illicit",),  # Non-Violent Crimes
    "S3": ("sexual",),  # Sex Crimes
    "S4": ("sexual/minors",),  # Child Exploitation
    "S5": (),  # Specialized Advice
    "S6": (),  # Privacy
    "S7": (),  # Intellectual Property
    "S8": ("illicit/violent",),  # Indiscriminate Weapons
    "S9": ("hate",),  # Hate
    "S10": ("self-harm",),  # Self-Harm
    "S11": ("sexual",),  # Sexual Content
}

FAMILIES = {
    "llama-guard-3": GuardFamily("llama-guard-3", {
        "S1": ("violence", "illicit/violent"),  # Violent Crimes
        "S2": ("illicit",),  # Non-Violent Crimes
        "S3": ("sexual",),  # Sex-Related Crimes
        "S4": ("sexual/minors",),  # Child Sexual Exploitation
        "S5": ("harassment",),  # Defamation
        "S6": (),  # Specialized Advice
        "S7": (),  # Privacy
        "S8": (),  # Intellectual Property
        "S9": ("illicit/violent",),  # Indiscriminate Weapons
        "S10": ("hate",),  # Hate
        "S11": ("self-harm",),  # Suicide & Self-Harm
        "S12": ("sexual",),  # Sexual Content
        "S13": (),  # Elections
        "S14": ("illicit",),  # Code Interpreter Abuse
    }, marker="S14: Code Interpreter Abuse"),
    "llama-guard-2": GuardFamily("llama-guard-2", _LLAMA_GUARD_2, marker="S11: Sexual Content"),
    "llama-guard-1": GuardFamily("llama-guard-1", {
        "O1": ("violence", "hate"),  # Violence and Hate
        "O2": ("sexual",),  # Sexual Content
        "O3": ("illicit",),  # Criminal Planning
        "O4": ("illicit/violent",),  # Guns and Illegal Weapons
        "O5": ("illicit",),  # Regulated or Controlled Substances
        "O6": ("self-harm",),  # Self-Harm
    }, marker="O6: Self-Harm"),
}


def family_of(chat_template: str | None) -> GuardFamily:
    """The family whose category list the checkpoint's chat template writes (Llama Guard 3 when none is recognised)."""
    for family in FAMILIES.values():
        if chat_template and family.marker in chat_template:
            return family
    log.warning("the guard model's chat template names no known guard family; reading its verdicts as Llama Guard 3's")
    return FAMILIES["llama-guard-3"]


def parse_verdict(text: str, family: GuardFamily) -> tuple[str, ...]:
    """The codes an answer names (empty: safe); ValueError for an answer that is neither."""
    answer = text.strip()
    if answer == "safe":
        return ()
    lines = answer.split("\n")
    if lines[0].strip() != "unsafe" or len(lines) != 2:
        raise ValueError(f"the guard answered {text[:80]!r}, not a verdict")
    codes = tuple(code.strip() for code in lines[1].split(","))
    unknown = [code for code in codes if code not in family.codes]
    if unknown:
        raise ValueError(f"the guard named {unknown[0]!r}, not a {family.name} category")
    return codes


@dataclass(frozen=True)
class GuardVerdict:
    """The guard's answer: its codes, what they mean as OpenAI categories, and how long it took."""

    codes: tuple[str, ...]
    categories: tuple[str, ...]
    seconds: float


class GuardModel:
    """Judges texts with a guard model on its own engine; `judge` raises when it cannot (failed, timed out)."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, max_model_len: int, timeout: float,
                 family: GuardFamily | None = None, verdict_pattern: str | None = None, clock=time.perf_counter) -> None:
        """`verdict_pattern` replaces the family's grammar (tests steer a random model with it)."""
        self.engine, self.tokenizer = engine, tokenizer
        self.family = family or family_of(tokenizer.hf.chat_template)
        self.max_model_len, self.timeout, self.clock = max_model_len, timeout, clock
        self.params = SamplingParams(temperature=0.0, max_tokens=16, structured=StructuredOutput(
            regex=verdict_pattern or self.family.verdict_pattern, param="safety.guard_model"))

    def prompt(self, text: str) -> list[int]:
        """`text` as the user turn of the guard's own template, cut from the front to fit its window."""
        prompt = self.tokenizer.encode_chat([{"role": "user", "content": text}])
        budget = self.max_model_len - self.params.max_tokens
        while len(prompt) > budget and text:  # keep the end: the newest turn is what is judged
            text = text[len(text) // 4 :]
            prompt = self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return prompt

    async def judge(self, text: str) -> GuardVerdict:
        started = self.clock()
        prompt = await asyncio.to_thread(self.prompt, text)
        handle = self.engine.generate(prompt, self.params, Placement(priority=0))
        try:
            answer = await asyncio.wait_for(_collect(handle), self.timeout)
        except TimeoutError:
            raise TimeoutError(f"the guard model did not answer within {self.timeout:g} s") from None
        finally:
            with contextlib.suppress(Exception):
                handle.abort()
        codes = parse_verdict(answer, self.family)
        categories = tuple(dict.fromkeys(c for code in codes for c in self.family.codes[code]))
        return GuardVerdict(codes, categories, self.clock() - started)


async def _collect(handle) -> str:
    text = []
    async for out in handle:
        if out.error:
            raise RuntimeError(f"the guard model failed: {out.error}")
        text.append(out.outputs[0].text)
    return "".join(text)
