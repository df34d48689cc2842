"""Batched GEMM under sustained load: every built strided gemm_sm90 candidate against cuBLAS, after
the GPU has settled at its power cap.

Experiment 10 (bench/NOTES.md) found the H200's power cap lowering the SM clock within a second of
heavy load, and our output-bound Q Kᵀ kernels slowing more than cuBLAS's; bench/batched_gemm.py
times only the pick there. This script times every candidate in that state, with
timing.sustained_ms: all candidates and cuBLAS cycle for --settle seconds, then --rounds rounds
in alternating order each time one burst of back-to-back calls per side, queued behind a spin
kernel and lasting at least --min-burst-ms (the load a training step puts on these GEMMs).

    python bench/gemm_sustained.py [--shape BH M N K ...] [--rounds 3] [--min-burst-ms 40]
                                   [--out bench/results/x.md]

Prints, per shape, each candidate's median TFLOP/s over the rounds and its ratio to cuBLAS's
median, best first; with --per-call also each side timed as bench/batched_gemm.py's eager column
does (median of 20 CUDA-event timings after 5 warm-up calls), before the shape's sustained
rounds, so that a tile's standing over a few calls shows beside its standing at the power cap.
"""
from __future__ import annotations

import argparse
import datetime

import torch

import gemmgen
from gemmgen.select import registry, timing

# The output-bound Q Kᵀ shapes of bench/results/batched_gemm_h200.md (device ratio < 0.9).
SHAPES = ((4096, 512, 512, 128), (512, 1024, 1024, 128), (512, 2048, 2048, 128), (64, 4096, 4096, 128))


def candidates(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """Built strided gemm_sm90 instances that run this Q Kᵀ call."""
    names = []
    for c in registry.load()[0]:
        if c.entry.family == "gemm_sm90" and c.entry.state == "built" and "_strided_" in c.name:
            try:
                gemmgen.batched_gemm(a, b, b_transposed=True, instance=c.name)
                names.append(c.name)
            except Exception:  # a layout or dtype this instance does not run
                pass
    torch.cuda.synchronize()
    return sorted(names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs=4, type=int, action="append", metavar=("BH", "M", "N", "K"),
                    help="a Q Kᵀ shape (repeatable; default: the four output-bound ones)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst", type=int, default=10, help="calls per burst, at least")
    ap.add_argument("--min-burst-ms", type=float, default=40.0, help="bursts last this long, at least")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of load before timing")
    ap.add_argument("--per-call", action="store_true", help="also time each side per call before the load")
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()

    dev = torch.cuda.get_device_properties(0)
    header = (f"{dev.name}, torch {torch.__version__}, gemmgen {gemmgen.__version__}, {datetime.date.today()}, "
              f"fp16 Q Kᵀ; after {args.settle:g} s of load, {args.rounds} rounds in alternating order, each a "
              f"burst of >= {args.burst} calls lasting >= {args.min_burst_ms:g} ms; TFLOP/s = 2*BH*M*N*K/t")
    cols = "| BH | M | N | K | instance | TFLOP/s | cuBLAS | ratio |" + (" per call | cuBLAS | ratio |" if args.per_call else "")
    lines = [header, "", cols, "|---" * (cols.count("|") - 1) + "|"]
    print(header, flush=True)
    for bh, m, n, k in args.shape or SHAPES:
        a = torch.randn(bh, 1, m, k, dtype=torch.float16, device="cuda")
        b = torch.randn(bh, 1, n, k, dtype=torch.float16, device="cuda")
        c = torch.empty(bh, 1, m, n, dtype=torch.float16, device="cuda")
        tflops = 2.0 * bh * m * n * k / 1e9
        sides = {"cuBLAS": lambda: torch.matmul(a, b.transpose(-2, -1), out=c)}
        for name in candidates(a, b):
            sides[name] = lambda name=name: gemmgen.batched_gemm(a, b, b_transposed=True, out=c, instance=name)
        eager = {name: tflops / timing.median_ms(lambda _i, f=f: f(), 1, reps=20) for name, f in sides.items()
                 } if args.per_call else {}
        ms = timing.sustained_ms(sides, rounds=args.rounds, burst=args.burst, settle_s=args.settle,
                                 min_burst_ms=args.min_burst_ms)
        med = {name: tflops / t for name, t in ms.items()}
        ref = med.pop("cuBLAS")
        for name, t in sorted(med.items(), key=lambda kv: -kv[1]):
            row = f"| {bh} | {m} | {n} | {k} | {name} | {t:.1f} | {ref:.1f} | {t / ref:.2f} |"
            if eager:
                row += f" {eager[name]:.1f} | {eager['cuBLAS']:.1f} | {eager[name] / eager['cuBLAS']:.2f} |"
            lines.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
