"""LLM: offline batch generation, as vLLM's `LLM` does it: build an engine, add every prompt, step to the end.

`LLM(model, **engine_options).generate(prompts, sampling_params)`; the options are config keys
by name (`device="cpu"`, `block_size=8`, ...). No threads, no asyncio: the caller's thread steps.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as SequenceOf

from chatd.config_loader import config_from_options
from chatd.engine.engine import LLMEngine
from chatd.engine.gc_freeze import freeze_startup_objects
from chatd.engine.frame_room import with_frame_room
from chatd.engine.params import RequestOutput, SamplingParams
from chatd.engine.tokenizer import Tokenizer


class LLM:
    """Offline batch generation: `LLM(model, **engine_options).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_options) -> None:
        if model is not None:
            engine_options["path"] = str(model)
        self.engine = LLMEngine.from_config(config_from_options(**engine_options))
        freeze_startup_objects()
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit; `with LLM(...) as llm:` too)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceOf[str] | SequenceOf[list[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        # All validated before any is queued: a bad prompt leaves the engine as it was.
        prepared = [self.engine.prepare_request(rid, p, sp) for rid, p, sp in zip(request_ids, prompts, sampling_params)]
        for request in prepared:
            self.engine.add_prepared(request)
        results: dict[str, RequestOutput] = {}

        def step_to_the_end() -> None:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in results:
                        results[out.request_id].merge(out)
                    else:
                        results[out.request_id] = out

        with_frame_room(step_to_the_end)  # no step maps memory for its frames (frame_room.py)
        return [results[rid] for rid in request_ids]
