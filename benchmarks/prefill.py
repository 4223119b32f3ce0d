"""One prefill step eager and compiled, side by side in one process, on CPU.

chatd compiles each layer's halves around attention for steps of 192 tokens or more
(chatd/engine/worker/fast_steps/compiled_prefill.py). This loads a model once, builds one step of several
prompts (at least that many tokens in all) and runs it eagerly (`model(...)`) and compiled
(`CompiledPrefill.hidden`) in turn, `--pairs` times, so both meet the machine in the same state.
It prints each pair's times, the medians, the median of the paired ratios, and how far the
compiled hidden states are from the eager ones.

    python benchmarks/prefill.py                                  # the default model (its Q4_1 file), gguf
    python benchmarks/prefill.py --model F32.gguf --quantization none --pairs 6 --json p.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

import torch  # noqa: E402

from chatd.engine import LLM  # noqa: E402
from chatd.engine.attention import build_step  # noqa: E402
from chatd.engine.models.demo import ensure_demo_model  # noqa: E402
from chatd.engine.worker.fast_steps.compiled_prefill import CompiledPrefill  # noqa: E402
from chatd.engine.models.sources import default_model_path  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "chatd" / "engine" / "models" / "demo_corpus.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M if installed, else the demo model)")
    parser.add_argument("--quantization", default=None, help="model.quantization (default: gguf for a GGUF file, else none)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts in the step (default 4)")
    parser.add_argument("--words", type=int, default=200, help="words of the corpus per prompt (default 200)")
    parser.add_argument("--pairs", type=int, default=8, help="eager-then-compiled runs of the step (default 8)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = str(args.model or default_model_path() or ensure_demo_model())
    quantization = args.quantization or ("gguf" if model_path.lower().endswith(".gguf") else "none")
    with LLM(model_path, device="cpu", dtype="float32", quantization=quantization, compile=False,
             max_model_len=2048, num_blocks=64 * args.prompts) as llm:
        runner = llm.engine.runner
        model = runner.model
        with torch._dynamo.config.patch(disable=False):
            prefill = CompiledPrefill(model)
            compile_seconds = prefill.warm_up()
        words = CORPUS.read_text().split()
        rng = random.Random(0)
        prompts = []
        for _ in range(args.prompts):
            start = rng.randrange(len(words) - args.words)
            prompts.append(llm.tokenizer.encode(" ".join(words[start : start + args.words])))
        tokens = [token for prompt in prompts for token in prompt]
        if len(tokens) < prefill.min_tokens:
            raise SystemExit(f"the step has {len(tokens)} tokens; compiled prefill takes {prefill.min_tokens} or more")
        blocks_each = -(-max(map(len, prompts)) // runner.block_size)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
        step = build_step(tokens, [0] * len(prompts), [len(p) for p in prompts], tables, runner.block_size, runner.device)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        with torch.inference_mode():
            for _ in range(args.pairs):
                for name in times:
                    started = time.perf_counter()
                    if name == "eager":
                        eager = model(step.input_ids, step.positions, runner.kv_caches, step.meta, runner.backend)
                    else:
                        compiled = prefill.hidden(step, runner.kv_caches, runner.backend)
                    times[name].append(time.perf_counter() - started)
            same_argmax = (model.compute_logits(eager).argmax(-1) == model.compute_logits(compiled).argmax(-1)).float().mean()
        difference = ((compiled - eager).norm() / eager.norm()).item()
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"], strict=True)]
    result = {
        "model": Path(model_path).name, "quantization": quantization, "tokens": len(tokens), "prompts": len(prompts),
        "threads": torch.get_num_threads(), "compile_seconds": compile_seconds,
        "eager_ms": [t * 1e3 for t in times["eager"]], "compiled_ms": [t * 1e3 for t in times["compiled"]],
        "median_eager_ms": statistics.median(times["eager"]) * 1e3,
        "median_compiled_ms": statistics.median(times["compiled"]) * 1e3,
        "median_paired_ratio": statistics.median(ratios),
        "relative_difference": difference, "same_argmax": same_argmax.item(),
    }
    print(f"model {result['model']} ({quantization}), CPU, {result['threads']} threads: one step of {len(tokens)} "
          f"tokens ({len(prompts)} prompts); compiled in {compile_seconds:.1f} s")
    print("eager ms    ", " ".join(f"{t:.0f}" for t in result["eager_ms"]))
    print("compiled ms ", " ".join(f"{t:.0f}" for t in result["compiled_ms"]))
    print(f"median eager {result['median_eager_ms']:.0f} ms, compiled {result['median_compiled_ms']:.0f} ms, "
          f"median paired ratio {result['median_paired_ratio']:.3f}x")
    print(f"compiled hidden states vs eager: relative difference {difference:.2g}, "
          f"{result['same_argmax']:.1%} of positions with the same argmax")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
