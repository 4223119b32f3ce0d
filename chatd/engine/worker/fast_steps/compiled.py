"""Decode steps on CPU through torch.compile: what CUDA graphs are to a GPU step.

An eager decode step at batch 1 spends its time in two places a compiler can fix: each float
projection goes to the matmul library's one-row path, which on the CPUs measured here streams the
weight at a third of the memory bandwidth; and some 25 small operations per layer (norms, rope,
residuals, the KV write, the context gather) each cost their dispatch and a pass over memory.
Compiled with inductor, a projection of a few rows becomes reduction loops that stream the
weight at memory speed (models/matvec.py), attention reads the pages where they lie
(attention/decode.py), and the small operations fuse into a few loops per layer.

What is compiled is a whole decode step, tokens to logits, with each decoder layer a nested
compiled region (`_layer`): torch.compile traces and compiles one layer and reuses that code for
every layer of the same structure (their weights are its inputs, not constants), so compiling
costs about what one layer costs, not what thirty do. Steps: batches 1 to 4 (to 8 where speculative
decoding verifies guesses: `max_rows`), each specialized (float and int8 projections as reductions
that read each weight once for all rows), and one for every larger decode batch (a dynamic size:
the projections stay matmuls), each with the context width dynamic. SmolLM2-135M's float32 steps
on two cores, against one row: 2 rows 1.1-1.4x, 4 rows 1.5-1.8x, 6 rows 2.2x, 8 rows 3.0x, and the
dynamic step at 9 rows 5.9x (the range is the machine's mood: when memory is fast, rows cost more).

Each step is compiled ahead of time (`aot_compile`) and called directly. A function compiled the
usual way pays torch.compile's per-call checks (guards) and wrappers, ~70 us a call: with a
compiled layer per call that was ~2 ms of a 9 ms int8 step of SmolLM2's 30 layers. Here a step
is one call, its guards are checked at start on dummy steps (and never again: which step a batch
takes is decided here), and the steps are saved under CHATD_HOME, named by what they depend on
(`_key`), so a later start reads them back rather than tracing the model again. All of them are
made at once (`warm_up`, logged with the time it took: SmolLM2-135M's Q4_1 file on two cores,
40-70 s the first time, ~4 s read back), before the first step offline, or on a thread of its own
while `chatd serve` answers with eager steps (compile_job.py); no request waits for a compile
(`compile_count` says whether a step compiled again later: tests check none does).

A step's input is one small tensor: each row's token, position and block table. The cache slots
it writes and reads, and the mask past each row's end, are computed inside the compiled code.
Between steps a decode streams every weight through the CPU's caches, so the host's Python and
numpy run cold: building the same slots and mask on the host took ~0.5 ms a step that way.

Steps of PREFILL_TOKENS or more, prefill chunks alone or beside decode rows, have each layer's
halves around attention compiled instead (compiled_prefill.py); smaller ones run eagerly. An
int4 layer's kernel (quant.py) is called from a decode step as it is: written as a reduction,
int4 was 8x slower than that kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from chatd.engine.attention import KVCache
from chatd.engine.attention.decode import DecodeAttention, DecodeContext
from chatd.engine.models.matvec import MAX_ROWS_AS_REDUCTIONS, ROWS_AS_REDUCTIONS

log = logging.getLogger("chatd.engine")
# Inductor says so for every fused loop that reads a float16 KV cache beside the bfloat16 results of
# quantized layers (the default cache beside quantized weights): each is widened to float32 first,
# so nothing is lost, and the warning would only fill the startup log.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)


def unavailable_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why decode steps cannot be compiled here; None when they can."""
    if device.type != "cpu":
        return "only CPU decode steps are compiled (CUDA replays CUDA graphs)"
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        return "tensor-parallel ranks run eagerly"
    if _compile_disabled():
        return "torch.compile is disabled in this process (TORCH_COMPILE_DISABLE=1)"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} cannot save a compiled step (it has no torch.compiler.load_compiled_function)"
    return None


def _compile_disabled() -> bool:
    """Dynamo's own `disable` setting, read without importing dynamo (half a second) where it was
    not imported yet: the setting comes from TORCH_COMPILE_DISABLE, as dynamo reads it."""
    if "torch._dynamo" in sys.modules:
        return bool(torch._dynamo.config.disable)
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def keep_compiled_in(folder: Path) -> None:
    """Inductor's on-disk cache in `folder` rather than its default under /tmp (gone at a reboot),
    unless TORCHINDUCTOR_CACHE_DIR names a place. Importing torch._dynamo sets that variable to
    the default itself, so the default counts as not named."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


@torch.compiler.nested_compile_region
def _layer(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
           slot_mapping: Tensor, context_slots: Tensor, context_bias: Tensor, k_scale: float, v_scale: float) -> Tensor:
    """One decoder layer: traced and compiled once, and that code runs every layer of the same
    structure (their weights are its inputs). Its inputs are tensors, numbers and the layer, which is
    what lets torch.compile reuse it."""
    context = DecodeContext(slot_mapping, context_slots, context_bias)
    return layer(x, cos, sin, (k_cache, v_cache), context, DecodeAttention(k_scale, v_scale))


def _step(model: nn.Module, rows: Tensor, kv_caches: list[KVCache], attention: DecodeAttention) -> Tensor:
    """A whole decode step, tokens to logits: what is compiled. `rows` [B, 2 + N] int64 holds each
    row's new token, its position and its block table (`_rows`); where its token goes in the cache
    and what it attends to are worked out here, inside the compiled code."""
    input_ids, positions, tables = rows[:, 0], rows[:, 1], rows[:, 2:]
    block_size = kv_caches[0][0].shape[1]
    context = DecodeContext.of_tables(positions, tables, block_size, model.embed_tokens.weight.dtype)
    x, cos, sin = model.embed(input_ids, positions)
    cos, sin = cos.clone(), sin.clone()  # halves of one tensor: a compiled region takes no inputs that overlap
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        x = _layer(layer, x, cos, sin, k_cache, v_cache, context.slot_mapping, context.context_slots,
                   context.context_bias, attention.k_scale, attention.v_scale)
    return model.compute_logits(model.norm(x))


def _rows(token_ids: list[int], positions: list[int], block_tables: list[list[int]], block_size: int) -> Tensor:
    """A decode step's rows as one tensor [B, 2 + N]: token, position, then the block table, cut to
    the blocks the longest context spans (shorter tables padded with block 0)."""
    blocks = max(positions) // block_size + 1
    rows = [[token, position, *table[:blocks], *[0] * (blocks - len(table))]
            for token, position, table in zip(token_ids, positions, block_tables, strict=True)]
    return torch.from_numpy(np.array(rows, dtype=np.int64))  # (half the time of torch.tensor on a cold cache)


def _saved_guards(guards: list) -> list[bool]:
    """The guards a compiled step keeps, saved with it and checked when a later start reads it back:
    each input's dtype, shape, strides and device, the dynamic sizes' ranges, and the grad mode.
    (With any other guard torch 2.13 saves a step it cannot read back.) The model's constants
    (norm eps, head counts, which layers are quantized and how) are in the file's name (`_key`)."""
    return torch.compiler.keep_portable_guards_unsafe(guards)


# Without size asserts: inductor's generated code checks every input's sizes and strides again on
# each call (~18 per layer; 0.4-0.7 ms of a 7-9 ms step on two cores, measured A/B in one process).
# A step's inputs are this module's own (its dummy steps' shapes, checked by the guards at start).
_OPTIONS = {"guard_filter_fn": _saved_guards, "size_asserts": False}

DYNAMIC_BATCH = ROWS_AS_REDUCTIONS + 1  # by default the step of this batch size serves every batch from it up


class CompiledDecode:
    """A model's decode steps, each compiled whole: `logits(token_ids, positions, block_tables)`.

    One compiled step per batch size from 1 to `max_rows` and one for every larger batch.
    Each is called directly, without torch.compile's per-call checks (guards): which step a batch
    takes is decided here, and each step's guards are checked once, at start, on two dummy steps of
    different context widths (and batch sizes, for the dynamic one). Compiled steps are saved in
    `folder` and read back by a later start of the same model, code and torch."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, k_scale: float = 1.0,
                 v_scale: float = 1.0, folder: Path | None = None, measure: bool = False,
                 max_rows: int = ROWS_AS_REDUCTIONS) -> None:
        if not 1 <= max_rows <= MAX_ROWS_AS_REDUCTIONS:
            raise ValueError(f"compiled decode steps of fixed size take 1 to {MAX_ROWS_AS_REDUCTIONS} rows, not {max_rows}")
        self.model = model
        self.dynamic_batch = max_rows + 1  # the step of this batch size serves every batch from it up
        self.measure = measure  # time each step at start (`step_seconds`)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attention = DecodeAttention(k_scale, v_scale)
        self.folder = folder
        self.steps: dict[int, Callable[..., Tensor]] = {}  # batch size (dynamic_batch: and up) -> its step
        self.read_back = 0  # steps warm_up read from `folder` rather than compiled
        # With `measure`, seconds a step of each batch size took on a dummy step at start (the dynamic
        # step's at dynamic_batch and at dynamic_batch + 3 rows): what speculative decoding weighs guesses by.
        self.step_seconds: dict[int, float] = {}

    @torch.inference_mode()
    def logits(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> Tensor:
        """Logits [B, vocab] of a decode-only step, in float32: row i's new token `token_ids[i]`
        at `positions[i]`, its blocks `block_tables[i]`."""
        step = self.steps[min(len(token_ids), self.dynamic_batch)]
        return step(self.model, _rows(token_ids, positions, block_tables, self.block_size), self.kv_caches, self.attention)

    @torch.inference_mode()  # as the runner's steps run: inference tensors are a guard of the steps
    def warm_up(self) -> float:
        """Compile (or read back) every step and run each on dummy steps; returns the seconds it took.

        The dummy steps' tables name the pool's last block again and again (so a pool of one block
        will do); their K/V go into it, and it is zeroed afterwards. A server compiling while it
        serves (compile_job.py) keeps that block from its block manager, so no sequence holds it."""
        started = time.perf_counter()
        key = self._key()
        dynamic = self.dynamic_batch
        for batch in range(1, dynamic + 1):
            self.steps[batch] = self._ready_step(batch, key)
        for batch in (*range(1, dynamic + 1), dynamic + 3) if self.measure else ():
            args = self._dummy(batch, 16)
            step = self.steps[min(batch, dynamic)]
            times = []
            for _ in range(3):
                started = time.perf_counter()
                step(*args)
                times.append(time.perf_counter() - started)
            self.step_seconds[batch] = sorted(times)[1]
        for cache in self.kv_caches:
            for pool in cache:
                pool[self.scratch_block].zero_()
        return time.perf_counter() - started

    def step_cost(self, rows: int) -> float:
        """A decode step of `rows` rows, in steps of one row (as measured at start)."""
        return step_cost(self.step_seconds, rows)

    @property
    def scratch_block(self) -> int:
        """The block the dummy steps write: the pool's last."""
        return self.kv_caches[0][0].shape[0] - 1

    def _ready_step(self, batch: int, key: str) -> Callable[..., Tensor]:
        """The step of `batch`, read back or compiled, its guards checked on two dummy steps, then run on them."""
        examples = [self._dummy(batch, 2), self._dummy(batch if batch < self.dynamic_batch else batch + 3, 5)]
        name = f"{batch}" if batch < self.dynamic_batch else f"{batch}-up"  # (batch 5 is either, by max_rows)
        path = self.folder / f"decode-{key}-{name}.bin" if self.folder is not None else None
        step, read_back = ready_compiled(_step, lambda: self._dummy(batch, 2, marked=True), examples, path,
                                         f"decode step for batch {batch}")
        self.read_back += read_back
        return step

    def _dummy(self, batch: int, blocks: int, marked: bool = False) -> tuple:
        """A step's arguments: `batch` rows whose contexts span `blocks` blocks (the scratch block each
        time). `marked`: its sizes that are dynamic are marked so, for the compiler (a guard rejects the mark)."""
        position = (blocks - 1) * self.block_size + 1
        rows = _rows([0] * batch, [position] * batch, [[self.scratch_block] * blocks] * batch, self.block_size)
        if marked:
            torch._dynamo.maybe_mark_dynamic(rows, 1)  # the blocks a context spans
            if batch >= self.dynamic_batch:
                torch._dynamo.maybe_mark_dynamic(rows, 0)
        return self.model, rows, self.kv_caches, self.attention

    def _key(self) -> str:
        """Names this model's steps on disk: what a compiled step depends on and its guards do not
        check. That is chatd's engine code, torch, the CPU's vector width, the settings of every
        module of the model (the constants a step was compiled with), and the shapes and dtypes of
        its weights and KV cache."""
        digest = code_digest()
        digest.update(f"{self.block_size} {self.attention.k_scale} {self.attention.v_scale};".encode())
        for name, module in self.model.named_modules():
            digest.update(f"{name}={described(module)};".encode())
        tensors = [*self.model.named_parameters(), *self.model.named_buffers(),
                   *((f"kv{i}", pool) for i, cache in enumerate(self.kv_caches) for pool in cache)]
        for name, tensor in tensors:
            digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype};".encode())
        return digest.hexdigest()[:20]


def step_cost(seconds: dict[int, float], rows: int) -> float:
    """A step of `rows` rows in steps of one row, from measured steps (`seconds`: rows -> seconds,
    1 among them): straight lines between the sizes measured, and past the largest."""
    sizes = sorted(seconds)
    below = max([b for b in sizes if b <= rows], default=sizes[0])
    above = min([b for b in sizes if b > rows], default=None)
    if above is None:  # past the largest: on the line through the last two
        below, above = sizes[-2], sizes[-1]
    slope = (seconds[above] - seconds[below]) / (above - below)
    return (seconds[below] + slope * (rows - below)) / seconds[1]


def code_digest() -> hashlib._Hash:
    """A digest of what every compiled function depends on and its guards do not check: chatd's
    engine code, torch, and the CPU's vector width."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):  # chatd/engine
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()};".encode())
    return digest


def ready_compiled(function: Callable, marked: Callable[[], tuple], examples: list[tuple], path: Path | None,
                   what: str) -> tuple[Callable, bool]:
    """`function` read back from `path` (when it was saved there and its guards take the examples) or
    compiled ahead of time on `marked()`'s arguments (their dynamic sizes marked) and saved; then,
    its guards checked once, run on each example without them. Returns it and whether it was read back."""
    compiled = read_compiled(path, function, examples) if path is not None and path.exists() else None
    read_back = compiled is not None
    if compiled is None:
        compiler = torch.compile(function, fullgraph=True, dynamic=False, options=_OPTIONS)
        compiled = compiler.aot_compile((marked(), {}))
        if not all(compiled.guard_check(*args) for args in examples):  # a size that should be dynamic got fixed
            raise RuntimeError(f"the compiled {what} does not take every step it must")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
    compiled.disable_guard_check()
    for args in examples:
        compiled(*args)
    return compiled, read_back


def read_compiled(path: Path, function: Callable, examples: list[tuple]) -> Callable[..., Tensor] | None:
    """`function` compiled and saved by an earlier start, if it reads back and its guards take these
    examples' arguments; else None (compile it again)."""
    try:
        with path.open("rb") as file:
            compiled = torch.compiler.load_compiled_function(file, f_globals=function.__globals__)
    except Exception as exc:  # written by another torch, cut short: compile it again
        log.info("compiling again: %s does not read back (%s: %s)", path.name, type(exc).__name__, exc)
        return None
    if not all(compiled.guard_check(*args) for args in examples):
        log.info("compiling again: %s does not fit this model's steps", path.name)
        return None
    return compiled


def described(value: object, depth: int = 0) -> str:
    """A value as text that is the same in every process: plain values as they are, other objects
    as their type and public attributes (two levels deep), never an address."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(described(item, depth) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key!r}:{described(item, depth)}" for key, item in sorted(value.items(), key=str)) + "}"
    if isinstance(value, Tensor) or depth >= 2 or not hasattr(value, "__dict__"):
        return type(value).__qualname__
    attributes = sorted((name, item) for name, item in vars(value).items() if not name.startswith("_"))
    return type(value).__qualname__ + "(" + ",".join(f"{name}={described(item, depth + 1)}" for name, item in attributes) + ")"


def compile_count() -> int:
    """Frames torch.compile has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
