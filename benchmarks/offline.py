"""Offline throughput: chatd's `LLM` next to transformers' two ways of batching, in one run.

Every engine gets the same random-weight model (built once into a temporary folder) and the
same workload: N prompts of random token ids, each with its own output length, greedy, EOS
ignored. Each engine runs the workload `--repeats` times; the table shows the median wall time,
useful output tokens per second, ratios to chatd, and the share of the machine's measured
matmul peak each engine turned into model FLOPs.

Peers (each driven the fastest way its documentation allows):
  chatd      LLM(...).generate(all prompts, one SamplingParams per prompt), on a fresh engine
             per repeat so the prefix cache starts empty each time.
  hf-cb      transformers' continuous batching: a ContinuousBatchingManager (what
             `generate_batch` uses inside), with each request's own max_new_tokens.
  hf-static  plain `model.generate` on static batches of 16, sorted by prompt length, left-padded;
             each batch decodes its longest output, only each sequence's own length counts.

After the throughput table, on CUDA (on CPU with --steps), the same run goes on with
benchmarks/steps.py: decode step time at several batch sizes against its memory and compute
rooflines, and time to first token with and without a cached prefix (--skip-steps: not).

This script knows nothing of chatd's internals; it only calls the offline API.

    python benchmarks/offline.py                      # CPU workload, all peers
    python benchmarks/offline.py --quick              # smoke test, seconds
    python benchmarks/offline.py --device cuda --json results.json   # Qwen3-0.6B shape, then steps.py
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# Weight-loading progress bars would bury the table; tqdm reads this when first imported.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from benchmarks.roofline import DTYPES, matmul_rate, sync  # noqa: E402

# Model shape and workload per preset; any flag given on the command line overrides its preset.
PRESETS = {
    "cpu": dict(
        family="llama", hidden=512, layers=8, heads=8, kv_heads=4, head_dim=None, intermediate=1536,
        vocab=32000, dtype="float32", num_seqs=64, prompt_len=(32, 256), output_len=(32, 128), tie_embeddings=False,
    ),
    # Qwen3-0.6B's shape (random weights); meant for a GPU.
    "qwen3-0.6b": dict(
        family="qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
        vocab=151936, dtype="bfloat16", num_seqs=256, prompt_len=(100, 1024), output_len=(100, 1024), tie_embeddings=True,
    ),
}
QUICK = dict(num_seqs=8, prompt_len=(16, 48), output_len=(8, 24))
PEERS = ("chatd", "hf-cb", "hf-static")
MATMUL_REPEATS = 7  # timed matmuls per peak measurement (after one untimed warm-up); the median is the peak


@dataclass
class Workload:
    """Prompts of random token ids and the number of tokens each must generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class PeerResult:
    """One engine's timed repeats and the tokens of its last repeat."""

    name: str
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # per prompt, in prompt order
    note: str = ""
    error: str | None = None

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


def make_workload(num_seqs: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int) -> Workload:
    """Lengths uniform in the given inclusive ranges, token ids uniform over the model's vocabulary."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(*output_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens)


def build_model(dir: Path, args: argparse.Namespace) -> Path:
    """Save a random-weight model of the benchmark's shape (and the demo tokenizer) into dir."""
    from chatd.engine.models.demo import build_model_dir

    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(2048, args.prompt_len[1] + args.output_len[1]),
        tie_word_embeddings=args.tie_embeddings,
    )
    if args.head_dim:
        shape["head_dim"] = args.head_dim
    return build_model_dir(dir, family=args.family, seed=0, **shape)


# -- model FLOPs --------------------------------------------------------------------------------
# The machine's peak they are set against is roofline.py's matmul_rate, as in benchmarks/steps.py.

FLOP_FORMULA = (
    "FLOPs = 2 * non_embedding_params * tokens_through_model"
    " + 2 * vocab * hidden * output_tokens"
    " + 4 * layers * heads * head_dim * sum(context of each token)"
)


def model_flops(hf_config, num_params_non_embedding: int, workload: Workload) -> float:
    """Useful model FLOPs of the workload (padding and recomputation not counted).

    FLOPs = 2 * non_embedding_params * tokens_through_model   (every weight: one multiply-add per token)
          + 2 * vocab * hidden * output_tokens                  (lm_head, only where a token is sampled)
          + 4 * layers * heads * head_dim * sum(context)        (q.k and p.v over each token's context)
    A sequence of P prompt and O output tokens passes P + O - 1 tokens through the model (the
    last sampled token is never fed back); the token at position i attends to i + 1 tokens.
    """
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    tokens = 0
    context = 0
    for prompt, num_out in zip(workload.prompts, workload.output_lens):
        length = len(prompt) + num_out - 1
        tokens += length
        context += length * (length + 1) // 2
    dense = 2 * num_params_non_embedding * tokens
    lm_head = 2 * hf_config.vocab_size * hf_config.hidden_size * workload.num_output_tokens
    attention = 4 * hf_config.num_hidden_layers * hf_config.num_attention_heads * head_dim * context
    return float(dense + lm_head + attention)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters of a transformers model minus the embedding and the (untied) output head."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total -= embedding.numel()
    if head is not None and head.weight is not embedding:  # a tied head is the embedding itself
        total -= head.weight.numel()
    return total


# -- the peers ----------------------------------------------------------------------------------
# Each peer loads in __init__ and times one pass over the whole workload in run(); main()
# interleaves the peers' repeats, so a burst of load on a shared machine hits them all alike.

Outputs = list[list[int]]  # generated token ids per prompt, in prompt order


class ChatdPeer:
    """chatd's offline `LLM`: one generate call with every prompt and its own SamplingParams."""

    name = "chatd"

    def __init__(self, path: Path, workload: Workload, args: argparse.Namespace) -> None:
        from chatd.engine import SamplingParams

        self.path, self.workload, self.args = path, workload, args
        self.block_size = 16
        # Room for every sequence at its full length at once: the run never preempts for lack of KV.
        self.num_blocks = 16 + sum(
            -(-(len(p) + o) // self.block_size) for p, o in zip(workload.prompts, workload.output_lens)
        )
        self.params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in workload.output_lens]
        self.warmup_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        self.note = (
            f"max_num_batched_tokens={args.max_num_batched_tokens or 'default'}, {self.num_blocks} KV blocks of "
            f"{self.block_size} tokens, a fresh engine per repeat (empty prefix cache)"
        )

    def run(self) -> tuple[float, Outputs]:
        from chatd import LLM

        # Built (and warmed up) untimed each repeat: a reused engine would find the prompts in its prefix cache.
        options = dict(
            device=self.args.device,
            dtype=self.args.dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=max(256, len(self.workload.prompts)),
            compile=not self.args.no_compile,  # compiling (on CPU, at start) is untimed, as the warm-up is
        )
        if self.args.max_num_batched_tokens is not None:  # None: chatd's own default
            options["max_num_batched_tokens"] = self.args.max_num_batched_tokens
        llm = LLM(str(self.path), **options)
        llm.generate([[1, 2, 3, 4], [5, 6, 7]], self.warmup_params)
        start = time.perf_counter()
        outs = llm.generate(self.workload.prompts, self.params)
        seconds = time.perf_counter() - start
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"chatd failed {len(errors)} requests; first: {errors[0]}")
        outputs = [o.outputs[0].token_ids for o in outs]
        del llm, outs
        gc.collect()
        return seconds, outputs

    def close(self) -> None:
        pass


def load_hf_model(path: Path, args: argparse.Namespace):
    """The same folder through transformers, with torch's SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    return model.to(args.device).eval()


class HfContinuousBatchingPeer:
    """transformers' continuous batching, fed as `generate_batch` feeds it, but with per-request lengths.

    `generate_batch` takes one max_new_tokens for every prompt; the manager it drives takes one per
    request (`add_request(..., max_new_tokens=)`), so every sequence stops at its own length, as
    with chatd. The manager is built, warmed up and started before the clock starts, and
    torn down after it stops (chatd's engine is also built untimed).
    """

    name = "hf-cb"

    def __init__(self, path: Path, workload: Workload, args: argparse.Namespace) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.workload, self.device = workload, torch.device(args.device)
        # sdpa: transformers 5.23 pages it itself ("paged|sdpa" is deprecated there).
        self.model = load_hf_model(path, args)
        # Its fields moved between releases (5.17 has no page_size): pass what this one takes.
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        size_field = "page_size" if "page_size" in fields else "block_size"
        default_size = fields[size_field].default
        page_size = args.hf_page_size or (default_size if isinstance(default_size, int) else 256)
        num_blocks = 4 + sum(-(-(len(p) + o) // page_size) for p, o in zip(workload.prompts, workload.output_lens))
        wanted = {
            size_field: page_size,
            "num_blocks": num_blocks,
            "max_batch_tokens": args.hf_max_batch_tokens,
            "max_requests_per_batch": len(workload.prompts),
            "use_cuda_graph": None if self.device.type == "cuda" else False,  # None: transformers decides
        }
        self.cb_config = {name: value for name, value in wanted.items() if name in fields}
        if len(self.cb_config) < len(wanted):
            print(f"  hf-cb: this transformers' ContinuousBatchingConfig takes no {', '.join(sorted(set(wanted) - set(fields)))}")
        self.ContinuousBatchingConfig = ContinuousBatchingConfig
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(workload.output_lens))
        self.hints = {}
        try:  # sizing hints, as generate_batch passes them (not in every transformers release)
            from transformers.generation.continuous_batching.utils import WorkloadHints

            self.hints["workload_hints"] = WorkloadHints(
                max_prompt_length=max(len(p) for p in workload.prompts),
                max_generated_length=max(workload.output_lens),
                num_requests=len(workload.prompts),
            )
        except ImportError:
            pass
        self.note = (
            f"page_size={page_size}, num_blocks={num_blocks}, max_batch_tokens={args.hf_max_batch_tokens or 'auto'}, "
            "sdpa, per-request max_new_tokens"
        )
        self._generate([[1, 2, 3, 4], [5, 6, 7]], [4, 4])  # warm-up

    def run(self) -> tuple[float, Outputs]:
        return self._generate(self.workload.prompts, self.workload.output_lens)

    def _generate(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, Outputs]:
        with self.model.continuous_batching_context_manager(
            generation_config=self.generation_config,
            continuous_batching_config=self.ContinuousBatchingConfig(**self.cb_config),
            **self.hints,
        ) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lens)]
            finished: dict[str, list[int]] = {}
            while len(finished) < len(ids):
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' generation thread stopped early")
                    continue
                if out.is_finished():
                    if out.error:
                        raise RuntimeError(f"transformers failed request {out.request_id}: {out.error}")
                    finished[out.request_id] = out.generated_tokens
            sync(self.device)
            seconds = time.perf_counter() - start
        return seconds, [finished[i] for i in ids]

    def close(self) -> None:
        del self.model
        gc.collect()


class HfStaticPeer:
    """`model.generate` on static batches sorted by prompt length; a batch decodes to its longest output."""

    name = "hf-static"

    def __init__(self, path: Path, workload: Workload, args: argparse.Namespace) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # eos_token_id=-1 (never stop early) draws a warning on every batch
        self.workload, self.device = workload, torch.device(args.device)
        self.model = load_hf_model(path, args)
        order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
        self.batches = [order[i : i + args.static_batch] for i in range(0, len(order), args.static_batch)]
        self.note = f"batches of {args.static_batch} sorted by prompt length, left-padded, sdpa"
        self._generate([[1, 2, 3, 4], [5, 6, 7]], [4, 4])  # warm-up

    def run(self) -> tuple[float, Outputs]:
        prompts, output_lens = self.workload.prompts, self.workload.output_lens
        outputs: Outputs = [[] for _ in prompts]
        start = time.perf_counter()
        for batch in self.batches:
            tokens = self._generate([prompts[i] for i in batch], [output_lens[i] for i in batch])
            for i, t in zip(batch, tokens):
                outputs[i] = t
        sync(self.device)
        return time.perf_counter() - start, outputs

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], output_lens: list[int]) -> Outputs:
        from transformers import GenerationConfig

        pad_id = 0  # masked out, so any id will do
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), eos_token_id=-1, pad_token_id=pad_id)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), generation_config=config
        )
        # Every row ran the batch's longest output; keep each sequence's own length.
        return [tokens[:n] for tokens, n in zip(out[:, width:].tolist(), output_lens)]

    def close(self) -> None:
        del self.model
        gc.collect()


PEER_CLASSES = {peer.name: peer for peer in (ChatdPeer, HfContinuousBatchingPeer, HfStaticPeer)}


# -- report -------------------------------------------------------------------------------------


def report(results: list[PeerResult], workload: Workload, flops: float, peak: float) -> list[dict]:
    """Print the table; return its rows for --json."""
    useful = workload.num_output_tokens
    by_name = {r.name: r for r in results}
    chatd = by_name.get("chatd")
    chatd_ok = chatd is not None and chatd.error is None and chatd.seconds
    rows = []
    print(f"\n{'engine':<10} {'wall s':>8} {'output tok/s':>13} {'vs chatd':>9} {'peak share':>11}  runs (s)")
    for r in results:
        if r.error or not r.seconds:
            print(f"{r.name:<10} {'failed':>8}  {r.error}")
            rows.append(dict(engine=r.name, error=r.error))
            continue
        seconds = r.median_seconds
        tok_s = useful / seconds
        vs_chatd = tok_s / (useful / chatd.median_seconds) if chatd_ok else None
        share = flops / seconds / peak
        runs = ", ".join(f"{s:.2f}" for s in r.seconds)
        vs = f"{vs_chatd:.2f}x" if vs_chatd is not None else "-"
        print(f"{r.name:<10} {seconds:>8.2f} {tok_s:>13.1f} {vs:>9} {share:>10.1%}  {runs}")
        matches = None
        if chatd_ok and r is not chatd:
            matches = sum(a == b for a, b in zip(r.outputs, chatd.outputs))
        rows.append(
            dict(engine=r.name, seconds=r.seconds, median_seconds=seconds, output_tokens_per_s=tok_s,
                 ratio_vs_chatd=vs_chatd, peak_share=share, note=r.note, same_tokens_as_chatd=matches)
        )
    peers = [row for row in rows if row["engine"] != "chatd" and "error" not in row]
    if chatd_ok and peers:
        best = max(peers, key=lambda row: row["output_tokens_per_s"])
        print(f"\nchatd / fastest peer ({best['engine']}): {1 / best['ratio_vs_chatd']:.2f}x")
    for row in rows:
        if row.get("same_tokens_as_chatd") is not None:
            print(f"{row['engine']}: {row['same_tokens_as_chatd']}/{len(workload.prompts)} sequences token-identical to chatd's")
    print("\nHow each peer ran:")
    for r in results:
        print(f"  {r.name}: {r.note}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--preset", choices=PRESETS, help="model shape and workload (default: cpu on CPU, qwen3-0.6b on CUDA)")
    p.add_argument("--num-seqs", dest="num_seqs", type=int, help="sequences in the workload (cpu preset: 64)")
    p.add_argument("--prompt-len", dest="prompt_len", type=int, nargs=2, metavar=("MIN", "MAX"), help="cpu preset: 32 256")
    p.add_argument("--output-len", dest="output_len", type=int, nargs=2, metavar=("MIN", "MAX"), help="cpu preset: 32 128")
    p.add_argument("--hidden", type=int, help="hidden size (cpu preset: 512)")
    p.add_argument("--layers", type=int, help="decoder layers (cpu preset: 8)")
    p.add_argument("--heads", type=int, help="attention heads (cpu preset: 8)")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="key/value heads (cpu preset: 4)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="head size (default hidden / heads)")
    p.add_argument("--intermediate", type=int, help="MLP size (cpu preset: 1536)")
    p.add_argument("--vocab", type=int, help="vocabulary size (cpu preset: 32000)")
    p.add_argument("--dtype", choices=DTYPES, help="cpu preset: float32")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {','.join(PEERS)}")
    p.add_argument("--no-compile", dest="no_compile", action="store_true",
                   help="chatd: on CPU, decode steps eagerly (chatd's --no-compile)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--quick", action="store_true", help="8 short sequences: a smoke test")
    # Step budgets: 1024 tokens for both continuous batchers on CPU (tried 512-4096 on the 2-core
    # machine: within noise of each other from 1024 up); on CUDA each engine's own default.
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int,
                   help="chatd's per-step token budget (default 1024 on CPU, chatd's default on CUDA)")
    p.add_argument("--hf-max-batch-tokens", dest="hf_max_batch_tokens", type=int,
                   help="transformers' continuous batching step budget (default 1024 on CPU, its own on CUDA)")
    p.add_argument("--hf-page-size", dest="hf_page_size", type=int,
                   help="transformers' continuous batching page size (default 16 on CPU, its own on CUDA)")
    p.add_argument("--static-batch", dest="static_batch", type=int, default=16, help="hf-static batch size (default 16)")
    p.add_argument("--gemm-size", dest="gemm_size", type=int, help="matmul peak size (default 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--steps", action="store_true", help="also run benchmarks/steps.py on CPU (on CUDA it runs unless skipped)")
    p.add_argument("--skip-steps", dest="skip_steps", action="store_true", help="do not run benchmarks/steps.py after the table")
    args = p.parse_args(argv)
    args.run_steps = not args.skip_steps and (args.steps or torch.device(args.device).type == "cuda")
    if args.preset is None:
        args.preset = "qwen3-0.6b" if torch.device(args.device).type == "cuda" else "cpu"
    for key, value in {**PRESETS[args.preset], **(QUICK if args.quick else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if torch.device(args.device).type == "cpu":
        for key, value in dict(max_num_batched_tokens=1024, hf_max_batch_tokens=1024, hf_page_size=16).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.prompt_len, args.output_len = tuple(args.prompt_len), tuple(args.output_len)
    args.peers = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = [name for name in args.peers if name not in PEER_CLASSES]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}, dtype {args.dtype}")
    # Other processes on the machine slow every engine alike, but make the numbers noisier.
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    workload = make_workload(args.num_seqs, args.prompt_len, args.output_len, args.vocab, args.seed)
    print(
        f"workload: {len(workload.prompts)} sequences, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"({workload.num_prompt_tokens} tokens), outputs {args.output_len[0]}-{args.output_len[1]} "
        f"({workload.num_output_tokens} tokens), greedy, EOS ignored"
    )

    gemm_size = args.gemm_size or (8192 if device.type == "cuda" else 2048)
    gemm_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    peak = matmul_rate(device, gemm_dtype, gemm_size, MATMUL_REPEATS)
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s ({str(gemm_dtype).removeprefix('torch.')} {gemm_size}^3, median of {MATMUL_REPEATS})")

    with tempfile.TemporaryDirectory(prefix="chatd-bench-") as tmp:
        path = build_model(Path(tmp) / "model", args)
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            params = non_embedding_params(AutoModelForCausalLM.from_config(hf_config))
        flops = model_flops(hf_config, params, workload)
        print(
            f"model: {hf_config.model_type}, hidden {hf_config.hidden_size}, {hf_config.num_hidden_layers} layers, "
            f"vocab {hf_config.vocab_size}, {params / 1e6:.1f}M non-embedding parameters"
        )
        print(f"useful work: {flops / 1e12:.3f} TFLOP, where {FLOP_FORMULA}")

        results = {name: PeerResult(name) for name in args.peers}
        peers = {}
        for name in args.peers:
            print(f"loading {name} ...", flush=True)
            try:
                peers[name] = PEER_CLASSES[name](path, workload, args)
                results[name].note = peers[name].note
            except Exception as exc:  # report the failure in the table and keep measuring the others
                traceback.print_exc()
                results[name].error = f"{type(exc).__name__}: {exc}"
        # Repeats are interleaved (and the order rotated) so that load from other processes on a
        # shared machine falls on every engine alike; the matmul peak is measured in each round too.
        peaks = []
        for repeat in range(args.repeats):
            peaks.append(matmul_rate(device, gemm_dtype, gemm_size, MATMUL_REPEATS))
            names = list(peers)
            for name in names[repeat % max(len(names), 1) :] + names[: repeat % max(len(names), 1)]:
                result = results[name]
                if result.error:
                    continue
                try:
                    seconds, result.outputs = peers[name].run()
                except Exception as exc:
                    traceback.print_exc()
                    result.error = f"{type(exc).__name__}: {exc}"
                    continue
                result.seconds.append(seconds)
                print(f"round {repeat + 1}/{args.repeats}: {name} {seconds:.2f} s", flush=True)
                wrong = sum(len(t) != n for t, n in zip(result.outputs, workload.output_lens))
                if wrong or len(result.outputs) != len(workload.prompts):
                    result.error = f"{wrong} sequences did not get their own output length; throughput not comparable"
        for peer in peers.values():
            peer.close()

    peak = statistics.median([peak, *peaks])
    print(f"matmul peak per round: {', '.join(f'{p / 1e9:.1f}' for p in peaks)} GFLOP/s; median used: {peak / 1e9:.1f}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"output tok/s counts each sequence's own output length ({workload.num_output_tokens} tokens in all).")
    print(f"peak share = model FLOPs / wall time / matmul peak; {FLOP_FORMULA}")
    rows = report(list(results.values()), workload, flops, peak)
    summary = dict(
        args={k: v for k, v in vars(args).items()},
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        matmul_peak_flops=peak,
        matmul_peak_per_round=peaks,
        model_flops=flops,
        non_embedding_params=params,
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=workload.num_output_tokens,
        results=rows,
    )
    if args.json:  # written now too, so a crash in the steps section below does not lose the table
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    failed = any(r.error for r in results.values())
    if args.run_steps:
        summary["steps"] = run_steps(args)
        failed = failed or bool(summary["steps"].get("errors"))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if failed else 0


def run_steps(args: argparse.Namespace) -> dict:
    """benchmarks/steps.py on the same device (its own model and defaults; --quick and --seed passed on)."""
    from benchmarks import steps

    print("\n-- decode steps against their rooflines, and time to first token (benchmarks/steps.py) --", flush=True)
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()  # the peers' memory, back for the steps' model
    p = argparse.ArgumentParser()
    steps.add_arguments(p)
    steps_args = steps.finish_arguments(
        p.parse_args(["--device", args.device, "--seed", str(args.seed)] + (["--quick"] if args.quick else []))
    )
    try:
        return steps.run(steps_args)
    except Exception as exc:  # the throughput table above still stands
        traceback.print_exc()
        return dict(errors=[f"{type(exc).__name__}: {exc}"])


if __name__ == "__main__":
    sys.exit(main())
