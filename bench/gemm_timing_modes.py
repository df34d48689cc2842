"""One batched Q x K^T shape, gemmgen's strided instance against torch.matmul (cuBLAS), timed four
ways and the whole set twice, to separate the kernels' speed from the way they are timed:

- eager: CUDA events around each call (gemmgen.select.timing.median_ms), what bench/batched_gemm.py reports;
- hide_host: the same with a spin kernel ahead of each call, so the events time the kernels alone;
- graph: calls replayed from a CUDA graph, back to back;
- batch20: events around 20 calls queued back to back.

    python bench/gemm_timing_modes.py BH M K INSTANCE      (M = N; fp16; prints TFLOP/s and ratios)
"""
from __future__ import annotations

import argparse

import torch

import gemmgen
from gemmgen.select import timing


def batch_ms(fn, n: int = 20) -> float:
    """Milliseconds per call of n calls queued back to back between two events."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(0)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bh", type=int)
    ap.add_argument("m", type=int, help="M = N")
    ap.add_argument("k", type=int)
    ap.add_argument("instance", help="a built strided gemm instance (b_transposed, fp16)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    a = torch.randn(args.bh, 1, args.m, args.k, dtype=torch.float16, device="cuda")
    b = torch.randn(args.bh, 1, args.m, args.k, dtype=torch.float16, device="cuda")
    c = torch.empty(args.bh, 1, args.m, args.m, dtype=torch.float16, device="cuda")
    flops = 2.0 * args.bh * args.m * args.m * args.k
    sides = {"gemmgen": lambda _i: gemmgen.batched_gemm(a, b, b_transposed=True, out=c, instance=args.instance),
             "cuBLAS": lambda _i: torch.matmul(a, b.transpose(-2, -1), out=c)}
    modes = {"eager": lambda f: timing.median_ms(f, 1, reps=20),
             "hide_host": lambda f: timing.median_ms(f, 1, reps=20, hide_host=True),
             "graph": lambda f: timing.median_ms(f, 1, reps=10, graph=True),
             "batch20": batch_ms}
    print(f"BH={args.bh} M=N={args.m} K={args.k} {args.instance}")
    for rnd in range(args.rounds):
        for mode, time_ms in modes.items():
            tf = {name: flops / time_ms(fn) / 1e9 for name, fn in sides.items()}
            print(f"round {rnd} {mode:9} gemmgen {tf['gemmgen']:6.1f} cuBLAS {tf['cuBLAS']:6.1f} "
                  f"ratio {tf['gemmgen'] / tf['cuBLAS']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
