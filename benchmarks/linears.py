"""One layer's projections in each weight format, at each row count: where each kernel pays.

The 8B step benchmark (steps.py) showed on an H100 that int4 weights (torch's CUDA int4 kernel)
make one sequence 1.5x faster than bfloat16 but 64 sequences 3x slower and a 2000-token prefill
15x slower, and that fp8 weights are slower than bfloat16 at both. This script times, for the
four projections of one Llama-3.1-8B layer (or a smaller shape), at 1 to 8192 rows:

- `bf16`: F.linear with the bfloat16 weight;
- `int4`: chatd's Int4Linear (on CUDA torch's int4 kernel, on CPU its CPU kernel);
- `int4 unpacked`: the same groups kept as plain bytes (two values a byte), unpacked to a
  bfloat16 weight with torch ops and multiplied by F.linear (what a prefill could do instead);
- `fp8`: chatd's Fp8Linear (CUDA with compute capability 8.9+ only);
- `fp8 input scaling`: the per-token scaling of the input alone (what a fused kernel would save).

Each cell is the median of `--repeats` timed calls after warm-up, in microseconds, summed over the
four projections; each row also prints the ratio to bf16. Run it on the lent GPU with
`bash benchmarks/gpu_session.sh linears`; `--quick` is a CPU smoke test.

    python benchmarks/linears.py --device cuda
    python benchmarks/linears.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.engine.models.quantized.quant import GROUP_SIZE, Fp8Linear, Int4Linear, unavailable_reason  # noqa: E402

# (out_features, in_features) of one layer's projections: q/k/v fused, o, gate/up fused, down.
SHAPES = {"Llama-3.1-8B": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
          "tiny": [(384, 256), (256, 256), (1024, 256), (256, 512)]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of one call of fn, after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class PlainInt4:
    """int4 groups kept as plain bytes [out, in / 2] (even column in the low nibble), bfloat16 scales
    and zeros [out, groups]; each call unpacks the weight to bfloat16 and runs F.linear."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        q = q.to(torch.uint8)
        self.packed = (q[:, 0::2] | q[:, 1::2] << 4).contiguous()
        self.scales, self.zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)

    def weight(self) -> torch.Tensor:
        rows, half = self.packed.shape
        q = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).view(rows, -1, GROUP_SIZE)
        w = (q.to(torch.bfloat16) - 8) * self.scales[..., None] + self.zeros[..., None]
        return w.view(rows, 2 * half)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    layers = []
    for out_features, in_features in SHAPES[args.shape]:
        weight = torch.randn(out_features, in_features, device=device, generator=generator, dtype=torch.bfloat16) * 0.02
        groups = in_features // GROUP_SIZE
        q = torch.randint(0, 16, (out_features, in_features), device=device, generator=generator, dtype=torch.int32)
        scales = torch.rand(out_features, groups, device=device, generator=generator) * 0.01
        zeros = torch.randn(out_features, groups, device=device, generator=generator) * 0.01
        formats = {"bf16": lambda x, w=weight: F.linear(x, w), "int4": Int4Linear(q, scales, zeros, None),
                   "int4 unpacked": PlainInt4(q, scales, zeros)}
        # Both int4 forms hold the same weight (bfloat16 rounding apart): the timings compare like with like.
        same = formats["int4 unpacked"].weight().float() - formats["int4"].dequantized()
        if same.abs().max() > 2**-7 * formats["int4"].dequantized().abs().max():
            raise RuntimeError(f"the unpacked int4 weight of {out_features}x{in_features} is not the kernel's")
        if unavailable_reason("fp8", device) is None:
            formats["fp8"] = Fp8Linear.from_float(weight)
            formats["fp8 input scaling"] = Fp8Linear.scaled_input
        layers.append((in_features, formats))
    names = list(layers[0][1])
    print(f"torch {torch.__version__}, {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"{args.shape} layer: {SHAPES[args.shape]}; median of {args.repeats}, microseconds summed over the projections")
    print(f"{'rows':>6} " + " ".join(f"{name:>18}" for name in names) + "   (ratio to bf16)")
    table = []
    for rows in args.rows:
        cells = {}
        for name in names:
            total = 0.0
            for in_features, formats in layers:
                x = torch.randn(rows, in_features, device=device, generator=generator, dtype=torch.bfloat16)
                with torch.inference_mode():
                    total += timed(lambda f=formats[name], x=x: f(x), device, args.repeats)
            cells[name] = total
        table.append(dict(rows=rows, seconds=cells))
        print(f"{rows:>6} " + " ".join(f"{cells[n] * 1e6:>10.1f} ({cells[n] / cells['bf16']:>4.2f}x)" for n in names),
              flush=True)
    return dict(torch=torch.__version__, device=str(device), shape=args.shape, repeats=args.repeats, table=table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--shape", choices=SHAPES, help="the layer's shape (default Llama-3.1-8B; tiny with --quick)")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")],
                   help="row counts, comma-separated (default 1,8,16,32,64,128,256,512,2048,8192)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per cell (default 20)")
    p.add_argument("--quick", action="store_true", help="the tiny shape at 1, 16 and 256 rows, 3 repeats: a smoke test")
    p.add_argument("--json", help="write the table to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.rows, args.repeats = args.shape or "tiny", args.rows or [1, 16, 256], 3
    args.shape = args.shape or "Llama-3.1-8B"
    args.rows = args.rows or [1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192]
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
