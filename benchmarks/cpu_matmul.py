"""float32 projections on CPU: MKL (torch's F.linear) against oneDNN (what chatd calls), one process.

A decode or prefill step multiplies every projection of every layer, and the LM head, by the
step's rows. This times exactly that set of float32 products (SmolLM2-135M's shapes by default:
30 layers of q/k/v 576->960, o 576->576, gate/up 576->3072, down 1536->576, and a 49152-row head),
weights random and read from memory as a step reads them, at several row counts, each way in turn
(`--repeats` times, medians), and prints the times and MKL / oneDNN. oneDNN with the weights as
stored (models/onednn.py) and packed once into its layout for `--pack-rows` rows (16, as
models/quantized/packed.py packs them where memory allows).

    python benchmarks/cpu_matmul.py
    python benchmarks/cpu_matmul.py --rows 1,16 --repeats 3 --json m.json
    python benchmarks/cpu_matmul.py --hidden 2048 --intermediate 8192 --layers 16 --vocab 128256   # a 1B shape
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,256,1024", help="row counts, comma-separated")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv-width", type=int, default=192, help="k and v projections' width each (default 192)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pack-rows", type=int, default=16, help="the rows the packed weights are laid out for")
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args(argv)


def shapes(args) -> list[tuple[int, int]]:
    """(out, in) of every product of a step: each layer's fused q/k/v, o, fused gate/up, down; the head."""
    h, i = args.hidden, args.intermediate
    layer = [(h + 2 * args.kv_width, h), (h, h), (2 * i, h), (h, i)]
    return layer * args.layers + [(args.vocab, h)]


def timed(products, rows: int, repeats: int) -> float:
    """Median seconds of one pass over every product at `rows` rows."""
    inputs = {}
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        started = time.perf_counter()
        for multiply, in_features in products:
            x = inputs.setdefault(in_features, torch.randn(rows, in_features))
            multiply(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN")
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) for out, inp in shapes(args)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, args.pack_rows) for w in weights]
    ways = {
        "mkl": [(lambda x, w=w: F.linear(x, w), w.shape[1]) for w in weights],
        "onednn": [(lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), w.shape[1])
                   for w in weights],
        "onednn packed": [(lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), w.shape[1])
                          for w, p in zip(weights, packed)],
    }
    gib = sum(w.numel() for w in weights) * 4 / 2**30
    print(f"{len(weights)} float32 products, {gib:.2f} GiB of weights; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| rows | MKL ms | oneDNN ms | oneDNN packed ms | MKL / oneDNN |\n| ---: | ---: | ---: | ---: | ---: |")
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            ms = {name: 1e3 * timed(products, rows, args.repeats) for name, products in ways.items()}
            results.append({"rows": rows, "ms": ms})
            print(f"| {rows} | {ms['mkl']:.1f} | {ms['onednn']:.1f} | {ms['onednn packed']:.1f} | "
                  f"{ms['mkl'] / ms['onednn']:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
