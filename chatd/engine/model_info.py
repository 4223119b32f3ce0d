"""ModelInfo: what a server may know of the loaded model and its cache, and where each fact is read.

`AsyncEngine.start` returns it; `/v1/models`, the logs and the metrics read it. Apart from
engine.py because it is the engine's description, not its work: every fact is read off the
runner (which a test's fake may lack: it then reads as empty), the scheduler and the compile job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelInfo:
    """What a server may know of the loaded model and its cache (`AsyncEngine.start` returns it)."""

    path: str
    max_model_len: int  # the context window, in tokens
    vocab_size: int
    dtype: str
    device: str
    attention_backend: str
    cuda_graph_max_batch: int  # decode batches up to this size replay CUDA graphs; 0 = every step runs eagerly
    num_kv_blocks: int
    block_size: int
    is_demo: bool  # the random-weight demo model: its replies are noise
    # What a request that leaves a sampling field out gets: the model's recommendation
    # (temperature, top_p, top_k, min_p, repetition_penalty), from its generation config.
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    kv_cache_dtype: str = ""  # how the KV pool stores values
    kv_bytes_per_token: int = 0  # keys and values of one token, all layers (and all ranks)
    num_host_kv_blocks: int = 0  # the host tier's blocks (0: off)
    tensor_parallel_size: int = 1  # ranks the model is split over
    quantization: str = "none"  # model.quantization: how the weights are stored and computed
    compiled_decode: bool = False  # decode steps run through torch.compile (CPU; worker/fast_steps/compiled.py)
    compiled_prefill_tokens: int = 0  # steps of this many tokens or more do too (worker/fast_steps/compiled_prefill.py); 0: none

    @property
    def name(self) -> str:
        """The folder's or file's name (without .gguf): what the server serves it as unless configured."""
        path = Path(self.path)
        return path.stem if path.suffix.lower() == ".gguf" else path.name

    def details(self) -> dict:
        """chatd's own facts about the model, for logs and /v1/models."""
        return {
            "dtype": self.dtype,
            "device": self.device,
            "attention_backend": self.attention_backend,
            "cuda_graph_max_batch": self.cuda_graph_max_batch,
            "compiled_decode": self.compiled_decode,
            "compiled_prefill_tokens": self.compiled_prefill_tokens,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "quantization": self.quantization,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_gib": round(self.num_kv_blocks * self.block_size * self.kv_bytes_per_token / 2**30, 3),
            "num_host_kv_blocks": self.num_host_kv_blocks,
            "host_kv_cache_gib": round(self.num_host_kv_blocks * self.block_size * self.kv_bytes_per_token / 2**30, 3),
            "max_model_len": self.max_model_len,
            "demo_model": self.is_demo,
            "sampling_defaults": dict(self.sampling_defaults),
        }


def read_model_info(engine) -> ModelInfo:
    """An LLMEngine's ModelInfo, read now off its runner, scheduler and compile job."""
    runner = engine.runner
    fast = getattr(runner, "fast", None)  # worker/fast_steps/fast_steps.py's FastSteps (a test's fake runner has none)
    graphs = fast.graphs if fast is not None else None
    kv_caches = getattr(runner, "kv_caches", [])
    tensor_parallel_size = getattr(runner, "tensor_parallel_size", 1)
    return ModelInfo(
        path=engine.model_path,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        dtype=str(getattr(runner, "dtype", "")).removeprefix("torch."),
        device=str(getattr(runner, "device", "")),
        attention_backend=getattr(getattr(runner, "backend", None), "name", ""),
        cuda_graph_max_batch=graphs.max_batch if graphs else 0,
        num_kv_blocks=engine.scheduler.num_kv_blocks,
        block_size=engine.scheduler.block_size,
        is_demo=engine.is_demo,
        sampling_defaults=dict(engine.sampling_defaults),
        kv_cache_dtype=str(kv_caches[0][0].dtype).removeprefix("torch.") if kv_caches else "",
        kv_bytes_per_token=getattr(runner, "kv_bytes_per_token", 0) * tensor_parallel_size,
        num_host_kv_blocks=engine.scheduler.block_manager.host.num_blocks,
        tensor_parallel_size=tensor_parallel_size,
        quantization=getattr(getattr(runner, "model", None), "quantization", "none"),
        compiled_decode=fast is not None and fast.compiled is not None,
        compiled_prefill_tokens=(engine.compile_job.prefill_tokens if engine.compile_job is not None
                                 else getattr(getattr(fast, "compiled_prefill", None), "min_tokens", 0)),
    )
