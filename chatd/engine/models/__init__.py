"""The model: one decoder for the Llama family, and the checkpoint loader.

The core: llama.py (the decoder: Llama, Mistral, Qwen2, Qwen3), layers.py (its linears, norm and
embedding), rope.py (rotary embeddings), loader.py (a Hugging Face checkpoint read and loaded).
Beside them: sources.py (the default model, hub ids, GGUF files opened), tensor_parallel.py (what
one rank holds), matvec.py and onednn.py (CPU matmul paths), demo.py (the tiny demo model), and
quantized/ (GGUF files read, weight-only quantization). Imports: attention, core and params; never the worker above.
"""

from chatd.engine.models.llama import LlamaForCausalLM
from chatd.engine.models.loader import SUPPORTED_ARCHITECTURES, load_model, max_model_len, resolve_dtype
from chatd.engine.models.sources import resolve_model_path

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "load_model",
    "max_model_len",
    "resolve_dtype",
    "resolve_model_path",
]
