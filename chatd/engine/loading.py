"""From a Config to the engine's parts: device, dtype, model, tokenizer, KV pool size, runner.

Kept apart from `engine.py` so the engine itself can be built around a fake runner in tests. It
sits beside the engine, above the worker: it loads the tokenizer as well as the model, and
assembles what `LLMEngine.from_config` needs. A tensor-parallel worker process needs only the
runner, which `worker/build.py` makes for every rank. Only `from_config` imports this module
(it loads torch).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from chatd.config import Config, ModelConfig, chatd_home
from chatd.engine.models.demo import DEMO_WARNING, ensure_demo_model, is_demo_model
from chatd.engine.models.matvec import MAX_ROWS_AS_REDUCTIONS
from chatd.engine.models.quantized.quantize_model import int8_blocks_per_row
from chatd.engine.models.loader import open_checkpoint
from chatd.engine.models.sources import DEFAULT_MODEL_INSTALL, default_model_path, resolve_model_path, sampling_defaults
from chatd.engine.models.tensor_parallel import TPGroup, check_head_layout
from chatd.engine.tokenizer import Tokenizer
from chatd.engine.worker.build import build_runner, resolve_device
from chatd.engine.worker.fast_steps.compile_job import CompileJob
from chatd.engine.worker.fast_steps.compiled import keep_compiled_in, unavailable_reason
from chatd.engine.worker.fast_steps.fast_steps import enable_compiled_steps, enable_decode_graphs, measure_eager_steps
from chatd.engine.worker.host_kv import allocate_host_kv
from chatd.engine.worker.parallel import ParallelError, ParallelRunner, Workers, check_gpus
from chatd.engine.worker.parallel_worker import (
    cpu_threads_per_rank,
    join_group,
    leave_group,
    parallel_backend,
    rank_device,
    runner_facts,
)
from chatd.engine.speculative import Speculator, build_speculator, flat_cost
from chatd.engine.speculative.draft_model import DraftModelProposer
from chatd.engine.worker.kv_memory import kv_block_bytes, profile_kv_blocks
from chatd.engine.worker.runner import ModelRunner

log = logging.getLogger("chatd.engine")

# A folder holds a tokenizer when it has one of these (fast tokenizer, SentencePiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class EngineParts:
    """Everything LLMEngine needs that had to be loaded or measured: its fields are LLMEngine's arguments."""

    runner: ModelRunner
    tokenizer: Tokenizer | None
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    model_path: Path
    is_demo: bool
    sampling_defaults: dict[str, float]  # what requests that leave a sampling field out get
    num_host_blocks: int = 0  # the host KV tier's size (0: off)
    compile_job: CompileJob | None = None  # steps compiling on a thread (compile_steps' background)
    speculator: Speculator | None = None  # speculative decoding (speculative.method), or None


def load_engine_parts(config: Config, background_compile: bool = False) -> EngineParts:
    """Load the model (or build the demo model), size the KV pool and build the runner, in the steps
    below; with tensor_parallel_size N, start ranks 1..N-1 first and do every step on all ranks.
    `background_compile`: a CPU model's steps compile on a thread while eager steps serve (one rank only)."""
    model_path, demo = locate_model(config.model)
    checkpoint = open_checkpoint(model_path, chatd_home() / "gguf")
    device = resolve_device(config.model.device)
    tokenizer, eos = load_tokenizer(checkpoint.config_dir, checkpoint.hf_config, config.model)
    size = config.model.tensor_parallel_size
    runner: ModelRunner | ParallelRunner | None = None
    workers: Workers | None = None
    try:
        if size > 1:
            check_parallel_layout(checkpoint.hf_config, size, device)
            if device.type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(size))
            # The workers load from the folder or file rank 0 resolved (downloaded, or a GGUF's config made).
            workers = Workers(config, str(model_path), device)
            workers.collect("hello")
            tp = join_group(0, size, rank_device(device, 0), workers.rendezvous)
            local = build_runner(config, checkpoint, tp, rank_device(device, 0), eos)
            runner = ParallelRunner(local, workers)
            report_ranks(local, workers.collect(), size)
        else:
            local = runner = build_runner(config, checkpoint, TPGroup(), device, eos)
        model, context = local.model, local.max_model_len
        # Before the KV pool is sized: on a GPU the draft model and its pool count as memory in use.
        draft = load_draft(config, local.device, model.vocab_size, eos) if config.speculative.method == "draft_model" else None
        block_size = config.cache.block_size
        block_bytes = kv_block_bytes(model.num_layers, block_size, model.num_kv_heads, model.head_dim, local.kv_dtype)
        num_blocks = size_kv_pool(config, runner, block_bytes, context)
        runner.allocate_kv(num_blocks)
        log.info(
            "loaded %s: dtype %s, device %s, attention %s, %d KV blocks of %d tokens in %s (%.2f GiB%s), context %d",
            model_path, str(local.dtype).removeprefix("torch."), device, local.backend.name, num_blocks, block_size,
            str(local.kv_dtype).removeprefix("torch."), num_blocks * block_bytes * size / 2**30,
            f" over {size} ranks" if size > 1 else "", context,
        )
        num_host_blocks = size_host_tier(runner, config)
        compile_job = None
        if config.speculative.method and device.type == "cpu" and size == 1:
            local.fast.compiled_rows = MAX_ROWS_AS_REDUCTIONS  # verify steps are a few rows more than the batch
            if config.speculative.weigh_step_cost:
                measure_eager_steps(local)  # what guesses cost until (or unless) decode steps are compiled
                local.fast.measure_steps = True  # and once they are
        if device.type == "cuda":
            capture_cuda_graphs(runner, config)
        else:
            compile_job = compile_steps(local, config, background=background_compile and size == 1)
            if compile_job is not None:
                num_blocks -= 1  # the job's dummy steps write the pool's last block (worker/fast_steps/compile_job.py)
    except BaseException as exc:
        if runner is not None and hasattr(runner, "close"):
            runner.close()
        elif workers is not None:
            workers.close()
            leave_group()
        if isinstance(exc, ParallelError):  # a worker that could not start: said as plainly as rank 0's errors
            raise ValueError(f"tensor parallelism could not start: {exc}") from exc
        raise
    sampling = sampling_defaults(checkpoint.config_dir, model_path)
    if sampling:
        log.info("sampling defaults from the model (requests that leave them out): %s",
                 ", ".join(f"{name} {value:g}" for name, value in sampling.items()))
    step_cost = local.fast.step_cost if config.speculative.weigh_step_cost else flat_cost
    speculator = build_speculator(config.speculative, context, eos, model.vocab_size, draft, step_cost)
    if speculator is not None:
        log.info("speculative decoding: %s, up to %d tokens guessed a step, while at most %d sequences run",
                 config.speculative.method, config.speculative.num_speculative_tokens,
                 config.speculative.disable_by_batch_size)
    return EngineParts(runner, tokenizer, num_blocks, context, model.vocab_size, eos, model_path, demo, sampling,
                       num_host_blocks, compile_job, speculator)


def load_draft(config: Config, device: torch.device, vocab_size: int, eos: frozenset[int]) -> DraftModelProposer:
    """The draft model (speculative.model) on the served model's device, whole (no tensor
    parallelism), with its own KV pool of speculative.draft_kv_cache_gb."""
    spec = config.speculative
    model_config = dataclasses.replace(config.model, path=spec.model, tensor_parallel_size=1, max_model_len=0,
                                       quantization="none")
    draft_path, _ = locate_model(model_config)
    checkpoint = open_checkpoint(draft_path, chatd_home() / "gguf")
    runner = build_runner(dataclasses.replace(config, model=model_config), checkpoint, TPGroup(), device, eos)
    model = runner.model
    if model.vocab_size != vocab_size:
        raise ValueError(f"speculative.model {spec.model!r} has a vocabulary of {model.vocab_size} tokens and the served "
                         f"model {vocab_size}: a draft model must share the served model's tokenizer")
    block_bytes = kv_block_bytes(model.num_layers, config.cache.block_size, model.num_kv_heads, model.head_dim,
                                 runner.kv_dtype)
    num_blocks = max(1, int(spec.draft_kv_cache_gb * 2**30 // block_bytes))
    runner.allocate_kv(num_blocks)
    log.info("draft model %s: dtype %s, %d KV blocks of its own (%.2f GiB)", draft_path,
             str(runner.dtype).removeprefix("torch."), num_blocks, num_blocks * block_bytes / 2**30)
    return DraftModelProposer(runner, num_blocks)


def check_parallel_layout(hf_config, size: int, device: torch.device) -> None:
    """Refuse, naming the numbers, a tensor-parallel layout that cannot work, before any process starts."""
    check_head_layout(hf_config.num_attention_heads, hf_config.num_key_value_heads, size)
    if hf_config.intermediate_size % size:
        raise ValueError(f"the model's intermediate_size ({hf_config.intermediate_size}) is not divisible by "
                         f"tensor_parallel_size {size}")
    if device.type == "cuda":
        check_gpus(device, size, torch.cuda.device_count())


def report_ranks(local: ModelRunner, workers: list[dict], size: int) -> None:
    """Log what each rank holds; refuse ranks that chose different attention backends."""
    facts = [runner_facts(local), *workers]
    backends = {f["backend"] for f in facts}
    if len(backends) > 1:
        raise ValueError(f"the ranks chose different attention backends ({', '.join(sorted(backends))}); "
                         "set model.attention_backend to one of them")
    hf = local.model.config
    log.info(
        "tensor parallel over %d ranks (%s): each holds %d of %d query heads, %d of %d key/value heads, %d of %d "
        "MLP rows and %d of %d vocabulary rows; weights per rank: %s",
        size, parallel_backend(local.device), hf.num_attention_heads // size, hf.num_attention_heads,
        local.model.num_kv_heads, hf.num_key_value_heads, hf.intermediate_size // size, hf.intermediate_size,
        local.model.embed_tokens.weight.shape[0], hf.vocab_size,
        ", ".join(f"{f['device']} {f['weights_bytes'] / 2**30:.2f} GiB" for f in facts),
    )


def size_host_tier(runner: ModelRunner, config: Config) -> int:
    """Allocate the host KV tier from cache.host_kv_cache_gb (blocks as the device pool stores
    them) and say what it holds; returns its blocks (0: off)."""
    if not config.cache.host_kv_cache_gb:
        return 0
    if not config.cache.enable_prefix_caching:
        raise ValueError("cache.host_kv_cache_gb keeps blocks by their prefix hash: it needs cache.enable_prefix_caching")
    # The size is for all ranks together: each keeps its part of every block.
    block_bytes = runner.kv_bytes_per_token * config.cache.block_size * config.model.tensor_parallel_size
    num_host_blocks = int(config.cache.host_kv_cache_gb * 2**30 // block_bytes)
    every_rank(runner, allocate_host_kv, num_host_blocks)
    log.info("host KV tier: %d blocks (%.2f GiB%s) keep blocks evicted from the device pool for reuse",
             num_host_blocks, num_host_blocks * block_bytes / 2**30, ", pinned" if runner.device.type == "cuda" else "")
    return num_host_blocks


def locate_model(config: ModelConfig) -> tuple[Path, bool]:
    """The model's folder or GGUF file, and whether it is the random demo model.

    No path: the default model where its package is installed, else (with the command that adds
    it) the demo model. `demo`: the demo model, built on first use.
    """
    if config.path == "demo":
        model_path = ensure_demo_model()
    elif config.path:
        model_path = resolve_model_path(config.path)
    elif (default := default_model_path()) is not None:
        model_path = default
    else:
        log.warning("the default model (SmolLM2-135M-Instruct) is not installed; `%s` adds it (98 MB). "
                    "Serving the random demo model meanwhile.", DEFAULT_MODEL_INSTALL)
        model_path = ensure_demo_model()
    demo = is_demo_model(model_path)
    if demo:
        log.warning(DEMO_WARNING)
    return model_path, demo


def load_tokenizer(model_path: Path, hf_config, config: ModelConfig) -> tuple[Tokenizer | None, frozenset[int]]:
    """The model's tokenizer (None for a weights-only folder) and its end-of-sequence ids."""
    tokenizer = None
    if not any((model_path / name).exists() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json's model type alone (Qwen2's
        # encodes every text to no tokens): a folder without tokenizer files has none.
        log.warning("no tokenizer files in %s; only token-id prompts will work", model_path)
    else:
        try:
            tokenizer = Tokenizer.from_pretrained(model_path, config.special_tokens_in_messages)
        except Exception as exc:  # a weights-only folder still serves token-id prompts
            log.warning("no usable tokenizer in %s (%s); only token-id prompts will work", model_path, exc)
    eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    if not eos:
        config_eos = hf_config.eos_token_id
        eos = frozenset(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return tokenizer, eos


def every_rank(runner, function, *args) -> list:
    """`function(runner, *args)` on every tensor-parallel rank's runner (just this one's without
    tensor parallelism): a set-up call every rank makes; each rank's result, rank 0's first."""
    return runner.everywhere(function, *args) if isinstance(runner, ParallelRunner) else [function(runner, *args)]


def profiled_kv_blocks(runner, config: Config, block_bytes: int) -> int:
    """On CUDA, the KV blocks every rank has room for beside the largest step (kv_memory.py): the least."""
    blocks = every_rank(runner, profile_kv_blocks, config.scheduler.max_num_batched_tokens,
                        config.scheduler.max_num_seqs, config.cache.gpu_memory_utilization, block_bytes)
    if len(blocks) > 1:
        log.info("KV blocks each rank has room for: %s; the pool takes the least", ", ".join(map(str, blocks)))
    return min(blocks)


def size_kv_pool(config: Config, runner, block_bytes: int, context: int) -> int:
    """How many KV blocks: as configured, else what the memory budget holds (measured on CUDA, on
    every rank: the least), never more than max_num_seqs full-length sequences could use; fewer
    than one such sequence is an error. `block_bytes`: one rank's block; on CPU the budget is for
    all ranks together."""
    if config.cache.num_blocks:
        return config.cache.num_blocks
    blocks_per_seq = -(-context // config.cache.block_size)
    max_useful = config.scheduler.max_num_seqs * blocks_per_seq
    cuda = runner.device.type == "cuda"
    if cuda:
        num_blocks = min(profiled_kv_blocks(runner, config, block_bytes), max_useful)
    else:
        size = config.model.tensor_parallel_size
        num_blocks = min(int(config.cache.cpu_kv_cache_gb * 2**30 // (block_bytes * size)), max_useful)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache budget gives {num_blocks} blocks of {config.cache.block_size} tokens, fewer than one sequence of "
            f"max_model_len {context} needs ({blocks_per_seq}); raise the KV memory budget "
            f"({'gpu_memory_utilization' if cuda else 'cpu_kv_cache_gb'}) or lower max_model_len"
        )
    return num_blocks


def compile_steps(runner: ModelRunner, config: Config, background: bool = False) -> CompileJob | None:
    """On CPU, compile decode and large prefill steps when configured (worker/fast_steps/compiled.py, compiled_prefill.py):
    now, or with `background` on a thread while the engine serves eagerly (the job, started; the
    caller keeps the pool's last block from the block manager). A failed compile serves eagerly."""
    if not config.model.compile:
        return _eager_steps(runner)
    reason = unavailable_reason(runner.model, runner.device)
    if reason:
        log.info("decode steps run eagerly: %s", reason)
        return _eager_steps(runner)
    keep_compiled_in(chatd_home() / "compiled")
    if background:
        log.info("compiling decode and prefill steps on a thread (torch.compile; the first time for a model this "
                 "takes a minute or two, later starts read it back); eager steps serve meanwhile")
        job = CompileJob(runner, chatd_home() / "compiled" / "steps")
        job.start()
        return job
    if not _compiled_steps(runner):
        _eager_steps(runner)
    return None


def _eager_steps(runner: ModelRunner) -> None:
    """Eager steps take int8 layers with a scale per row only: a GGUF file's blocks (Q8_0, Q6_K,
    Q5_*) are quantized again per row."""
    requantized = int8_blocks_per_row(runner.model)
    if requantized:
        log.info("%d int8 layers of GGUF blocks get a scale per row: eager decode steps have no kernel "
                 "for a scale per block (compiled steps keep the file's blocks)", requantized)


def _compiled_steps(runner: ModelRunner) -> bool:
    log.info("compiling decode and prefill steps (torch.compile; the first time for a model this takes a minute or "
             "two, later starts read it back; model.compile = false or --no-compile skips it)")
    try:
        seconds = enable_compiled_steps(runner, chatd_home() / "compiled" / "steps")
    except Exception as exc:  # no C++ compiler, an operation inductor refuses: serve eagerly, say why
        runner.fast.compiled = runner.fast.compiled_prefill = None
        log.warning("compiling decode and prefill steps failed (%s: %s); every step runs eagerly", type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return False
    decode, prefill = runner.fast.compiled, runner.fast.compiled_prefill
    log.info("compiled decode steps and prefill steps of %d tokens or more in %.1f s (%d of %d read back from an "
             "earlier start)", prefill.min_tokens, seconds, decode.read_back + prefill.read_back,
             len(decode.steps) + 2 * len(prefill.halves))
    return True


def capture_cuda_graphs(runner: ModelRunner, config: Config) -> None:
    """Capture decode graphs when configured and the backend allows it; a failed capture serves eagerly."""
    if not (config.model.cuda_graphs and config.model.cuda_graph_max_batch > 0):
        return
    if not runner.backend.capturable():
        log.info("CUDA graphs off: attention backend %s cannot be captured", runner.backend.name)
        return
    max_batch = min(config.model.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    try:
        seconds = every_rank(runner, enable_decode_graphs, max_batch)[0]
    except ParallelError as exc:  # a rank that failed mid-capture leaves the others in a collective
        raise ValueError(f"CUDA graph capture failed on a tensor-parallel rank ({exc}); "
                         "start with --no-cuda-graphs (model.cuda_graphs = false)") from exc
    except Exception as exc:  # serve eagerly rather than not at all; the log says why
        runner.fast.graphs = None
        log.warning("CUDA graph capture failed (%s: %s); every step runs eagerly", type(exc).__name__, exc)
    else:
        log.info("captured CUDA graphs for decode batches up to %d in %.1f s", max_batch, seconds)
