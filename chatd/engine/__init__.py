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
    StructuredOutput the grammar a request's output must follow (JSON schema...) params.py
    MAX_LOGPROBS     the most top_logprobs a request may ask for                params.py
    MAX_N            the most choices (n) a request may ask for                  params.py
    EngineStats      counters for metrics                                      core/scheduler.py
    STAGES           the stages of a step's host work, timed                   core/stage_times.py
    Tokenizer        chat template, tokens, incremental detokenizer            tokenizer.py
    Embedder         an embedding model beside the chat model, on its thread   embeddings.py

Reading order, following one request in:

    params.py          what a request asks for and what comes back               (no torch)
    tokenizer.py       chat template -> token ids; token ids -> text and stop strings
                       (chat_tokens.py: control tokens typed inside messages stay text)
    grammar.py         structured output: a request's grammar compiled, probed and cached
                       (grammar_threads.py: masks computed ahead, off the engine thread)
    async_engine.py    AsyncEngine.generate queues it; the engine thread steps
    request.py         what a request must pass before anything is allocated for it
    engine.py          LLMEngine.step: schedule -> launch -> postprocess -> detokenize (with
                       async scheduling, the next step launched before the last is waited for);
                       step_outputs.py: a step's tokens as each request's delta
    model_info.py      what the engine reports of its model; drain_rate.py, of its queue
    engine_process.py  the same engine in a child process, driven from AsyncEngine's thread
    loading.py         config -> model, tokenizer, KV pool, runner (LLMEngine.from_config)
    core/              no torch: sequence.py (one choice), block_manager.py (the paged KV pool
                       and prefix cache), scheduler.py (the step's batch, preemption, postprocess),
                       grammar_matcher.py (a sequence's place in its grammar), stage_times.py
                       (where a step's host time goes), ragged.py (ragged lists to numpy)
    worker/            torch: build.py (a runner, on every rank), runner.py (one forward over a
                       flat batch), sampler.py, cuda_graphs.py, host_kv.py (the host KV tier's
                       copies), parallel.py (tensor-parallel ranks: started, fed, supervised) and
                       parallel_worker.py (a rank's own process)
    attention/         backends over the paged KV cache: sdpa, torch-varlen, triton, flash-attn
    models/            llama.py (the Llama family; rope.py, layers.py), tensor_parallel.py (what
                       one rank holds), loader.py (checkpoints), demo.py
    llm.py             LLM: the same engine, stepped by the caller for offline use
    embeddings.py      the embedding model beside it, run in passes that embedding_queue.py
                       fills with waiting requests' inputs, tenant by tenant        (no torch there)

Imports run one way: params <- core <- attention, models <- worker <- the modules here
(tests/test_layout.py).

Importing this package loads no torch: loading.py, and through it the worker, is loaded when an
engine is built.
"""

from chatd.engine.async_engine import AsyncEngine, EngineClient, EngineUnavailable, RequestHandle, RequestStream
from chatd.engine.core.scheduler import EngineStats
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
    StructuredOutput,
)
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
