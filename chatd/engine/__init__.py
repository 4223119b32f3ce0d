"""chatd's engine: continuous batching over a paged KV cache. It knows nothing of HTTP or SQLite.

Public names (the rest is internal; `chatd.http` imports only these):

    LLM              offline batch generation                                 llm.py
    AsyncEngine      the engine on its own thread, streamed to coroutines     async_engine.py
    EngineClient     what a server needs of an engine (generate, abort, ...)  async_engine.py
    EngineUnavailable  the engine cannot take requests now (and why)          async_engine.py
    LLMEngine        the synchronous engine: add_request, abort, step          engine.py
    EngineProcess    an LLMEngine in a child process (--engine-process)        engine_process.py
    engine_process_wanted  whether "auto" runs it so on this machine        engine_process.py
    ModelInfo        what the loaded model is (name, context, dtype, ...)      model_info.py
    SamplingParams, RequestOutput, CompletionOutput, FinishReason, ParamError  params.py
    StructuredOutput the grammar a request's output must follow (JSON schema...) structured/spec.py
    MAX_LOGPROBS     the most top_logprobs a request may ask for                params.py
    MAX_N            the most choices (n) a request may ask for                  params.py
    EngineStats      counters for metrics                                      core/engine_stats.py
    STAGES           the stages of a step's host work, timed                   core/stage_times.py
    Tokenizer        chat template, tokens, incremental detokenizer            tokenizer.py
    Embedder         an embedding model beside the chat model, on its thread   embeddings.py

The core path: the files that serve one greedy request on a Llama, read in this order
(tests/test_layout.py CORE_PATH holds the same list, and its line budget):

    chatd/engine/params.py                 what a request asks for and what comes back (no torch)
    chatd/engine/tokenizer.py              chat template -> token ids; ids -> text, stop strings
    chatd/engine/engine.py                 LLMEngine: add_request, then step: schedule -> launch ->
                                           postprocess -> detokenize
    chatd/engine/step_outputs.py           a step's tokens as each request's delta
    chatd/engine/core/sequence.py          one choice: its tokens, counters and block table
    chatd/engine/core/block_manager.py     the paged KV pool and the prefix cache
    chatd/engine/core/scheduler.py         the step's batch under a token budget, preemption,
                                           postprocess
    chatd/engine/worker/runner.py          one flat forward over the step's tokens, then sampling
    chatd/engine/worker/forward_inputs.py  the step as the forward's inputs
    chatd/engine/worker/sampling_rows.py   each sequence's row of the sampler, and its RNG
    chatd/engine/worker/sampler.py         logits -> tokens (greedy: the argmax)
    chatd/engine/attention/common.py       the step's batch layout, the backend interface
    chatd/engine/attention/sdpa.py         the portable attention backend over the pages
    chatd/engine/models/llama.py           the Llama family's decoder
    chatd/engine/models/layers.py          its linears, norm and embedding
    chatd/engine/models/rope.py            rotary position embeddings
    chatd/engine/models/loader.py          a safetensors checkpoint into the model

Beside them, small helpers the core calls: request.py (what a request must pass), core/fairness.py
(who goes first), loading.py and worker/build.py (config -> model, tokenizer, KV pool, runner).

The extensions, each readable without the core's details and never needed to read the core:

    async_engine.py, llm.py      the engine on its own thread for a server; offline use
    engine_process.py            the engine in a child process (--engine-process)
    chat_tokens.py               control tokens typed inside messages stay text; stored replies
                                 put back as the ids the model made (ChatEncoder)
    window_detokenizer.py        streaming text for tokenizers without a Rust decoder
    structured/                  structured output: the grammar a request asks for (spec.py),
                                 compiled, its masks computed ahead (core/grammar_matcher.py and
                                 worker/grammar_masks.py are its hooks below)
    speculative/                 speculative decoding: n-gram and draft-model proposers
                                 (core/drafts.py: which guesses a decode verifies, how many it
                                 keeps; worker/verify_rows.py: a verify step's rows, RNG rewinds)
    embeddings.py                an embedding model beside the chat model (embedding_queue.py)
    core/host_tier.py            the host KV tier's bookkeeping (worker/host_kv.py: its tensors)
    engine_reports.py            what LLMEngine reports: stats (core/engine_stats.py), model_info
                                 (model_info.py), stage_times (core/stage_times.py), health;
                                 drain_rate.py, frame_room.py, gc_freeze.py: how steps stay lean
    worker/fast_steps/           compiled decode and prefill steps, CUDA graphs, what a step costs
                                 (fast_steps.py: what the runner asks once a step)
    worker/parallel.py           tensor-parallel ranks: started, fed, supervised
                                 (parallel_worker.py: a rank's process; models/tensor_parallel.py:
                                 what one rank holds)
    worker/full_sampling.py      sampling beyond a plain argmax: bans, penalties, grammar masks,
                                 draws, logprobs (penalties.py, sampling_choices.py,
                                 host_sampling.py, logprobs.py); prompt_logprobs.py
    worker/kv_memory.py, heap.py sizing the KV pool on a GPU; keeping a CPU step's memory
    attention/kv_dtypes.py       float16 and fp8 KV caches
    attention/gpu.py, select.py  triton, torch-varlen and flash-attn backends; choosing one
                                 (gpu_io.py: a step's inputs in one pinned copy, the triton KV write)
    models/sources.py            where a model comes from: the default model, hub ids, GGUF files
    models/quantized/            GGUF weights and weight-only quantization (int8, int4, fp8)
    models/matvec.py, onednn.py  CPU matmul paths; models/demo.py: the demo model

Imports run one way: params <- core <- attention, models <- worker <- the modules here and
structured/, speculative/ (tests/test_layout.py).

Importing this package loads no torch: loading.py, and through it the worker, is loaded when an
engine is built.
"""

from chatd.engine.async_engine import AsyncEngine, EngineClient, EngineUnavailable, RequestHandle, RequestStream
from chatd.engine.core.engine_stats import EngineStats
from chatd.engine.core.stage_times import STAGES
from chatd.engine.embeddings import Embedder
from chatd.engine.engine import LLMEngine
from chatd.engine.engine_process import EngineProcess, engine_process_wanted
from chatd.engine.llm import LLM
from chatd.engine.model_info import ModelInfo
from chatd.engine.params import (
    MAX_LOGPROBS,
    MAX_N,
    CacheScope,
    CompletionOutput,
    FinishReason,
    LimitError,
    Logprob,
    ParamError,
    Placement,
    RequestOutput,
    SamplingParams,
)
from chatd.engine.structured.spec import StructuredOutput
from chatd.engine.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "MAX_LOGPROBS",
    "MAX_N",
    "STAGES",
    "AsyncEngine",
    "CacheScope",
    "CompletionOutput",
    "Embedder",
    "EngineClient",
    "EngineProcess",
    "EngineStats",
    "EngineUnavailable",
    "FinishReason",
    "LLMEngine",
    "LimitError",
    "Logprob",
    "ModelInfo",
    "ParamError",
    "Placement",
    "RequestHandle",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutput",
    "Tokenizer",
    "engine_process_wanted",
]
