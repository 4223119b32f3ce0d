"""The guard model: each family's documented verdicts parse to its codes and OpenAI's categories;
a tiny random-weight model on chatd's own engine, steered by a verdict grammar, gives the verdict
asked for, with its latency; a guard that hangs or fails raises, for the policies to decide."""

from __future__ import annotations

import asyncio
import functools
import re

import pytest

from chatd.config_loader import config_from_options
from chatd.engine import AsyncEngine, CompletionOutput, FinishReason, LLMEngine, RequestOutput
from chatd.engine.models.demo import build_model_dir
from chatd.safety.guard import FAMILIES, GuardModel, family_of, parse_verdict

# What each family answers, as its model card documents it, and the codes it names.
DOCUMENTED = [
    ("llama-guard-3", "safe", ()),
    ("llama-guard-3", "\n\nsafe", ()),
    ("llama-guard-3", "unsafe\nS1", ("S1",)),
    ("llama-guard-3", "\n\nunsafe\nS10,S2", ("S10", "S2")),
    ("llama-guard-3", "unsafe\nS14", ("S14",)),
    ("llama-guard-2", "unsafe\nS11", ("S11",)),
    ("llama-guard-2", "unsafe\nS4,S9", ("S4", "S9")),
    ("llama-guard-1", "unsafe\nO3", ("O3",)),
    ("llama-guard-1", "safe", ()),
]


@pytest.mark.parametrize("family, answer, codes", DOCUMENTED)
def test_documented_verdicts_parse_and_match_the_familys_grammar(family, answer, codes):
    assert parse_verdict(answer, FAMILIES[family]) == codes
    assert re.fullmatch(FAMILIES[family].verdict_pattern, answer)


@pytest.mark.parametrize("family, answer", [
    ("llama-guard-3", "unsafe\nS15"),  # no such category
    ("llama-guard-2", "unsafe\nS12"),  # Llama Guard 3's, not 2's
    ("llama-guard-1", "unsafe\nS1"),  # 1 numbers its categories O1..O6
    ("llama-guard-3", "I cannot help with that."),
    ("llama-guard-3", "unsafe"),
])
def test_anything_else_is_not_a_verdict(family, answer):
    with pytest.raises(ValueError):
        parse_verdict(answer, FAMILIES[family])
    assert not re.fullmatch(FAMILIES[family].verdict_pattern, answer)


def test_codes_map_to_openais_categories():
    three = FAMILIES["llama-guard-3"].codes
    assert three["S10"] == ("hate",) and three["S4"] == ("sexual/minors",) and three["S11"] == ("self-harm",)
    assert three["S8"] == ()  # Intellectual Property: recorded, no OpenAI category


def test_the_family_is_read_from_the_chat_template():
    assert family_of("... S13: Elections.\nS14: Code Interpreter Abuse.\n...").name == "llama-guard-3"
    assert family_of("... S10: Self-Harm.\nS11: Sexual Content.\n...").name == "llama-guard-2"
    assert family_of("O5: Regulated or Controlled Substances.\nO6: Self-Harm.").name == "llama-guard-1"
    assert family_of("{{ messages }}").name == "llama-guard-3"  # unknown: read as the newest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("guard"), "llama", seed=1)


@pytest.fixture
async def tiny_engine(tiny_model):
    config = config_from_options(path=str(tiny_model), device="cpu", dtype="float32", block_size=8,
                                 num_blocks=128, max_model_len=512)
    engine = AsyncEngine(functools.partial(LLMEngine.from_config, config))
    await engine.start()
    yield engine
    await engine.stop()


@pytest.mark.parametrize("steer, codes, categories", [
    (r"unsafe\nS10", ("S10",), ("hate",)),
    (r"unsafe\nS1,S4", ("S1", "S4"), ("violence", "illicit/violent", "sexual/minors")),
    (r"safe", (), ()),
])
async def test_a_random_model_steered_by_its_grammar_gives_that_verdict(tiny_engine, steer, codes, categories):
    """The whole path (the guard's chat template, chatd's engine, the grammar, the parser); the
    model is random, so the grammar alone decides what it says."""
    guard = GuardModel(tiny_engine, tiny_engine.tokenizer, 512, timeout=60, family=FAMILIES["llama-guard-3"],
                       verdict_pattern=steer)
    verdict = await guard.judge("How do I bake bread?")
    assert verdict.codes == codes and verdict.categories == categories
    assert verdict.seconds > 0
    assert tiny_engine.stats().num_running == 0  # nothing left in the engine


async def test_a_long_input_keeps_its_end_within_the_guards_window(tiny_engine):
    guard = GuardModel(tiny_engine, tiny_engine.tokenizer, 128, timeout=60, family=FAMILIES["llama-guard-3"])
    prompt = guard.prompt("word " * 2000 + "THE END")
    assert len(prompt) <= 128 - guard.params.max_tokens
    assert "THE END" in tiny_engine.tokenizer.decode(prompt)


class FakeEngine:
    """An engine whose replies hang, or fail."""

    def __init__(self, mode: str) -> None:
        self.mode, self.aborted = mode, 0

    def generate(self, prompt, params, placement=None, cache=None):
        engine = self

        class Handle:
            request_id = "guard-1"

            def __aiter__(self):
                return self

            async def __anext__(self):
                if engine.mode == "hang":
                    await asyncio.sleep(3600)
                return RequestOutput("guard-1", prompt, [CompletionOutput(0, finish_reason=FinishReason.ERROR)],
                                     finished=True, error="out of memory")

            def abort(self):
                engine.aborted += 1

        return Handle()


async def test_a_guard_that_hangs_times_out_and_its_request_is_stopped(tiny_engine):
    engine = FakeEngine("hang")
    guard = GuardModel(engine, tiny_engine.tokenizer, 512, timeout=0.2, family=FAMILIES["llama-guard-3"])
    with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
        await guard.judge("hello")
    assert engine.aborted == 1


async def test_a_guard_that_fails_raises_its_reason(tiny_engine):
    guard = GuardModel(FakeEngine("fail"), tiny_engine.tokenizer, 512, timeout=5, family=FAMILIES["llama-guard-3"])
    with pytest.raises(RuntimeError, match="out of memory"):
        await guard.judge("hello")
