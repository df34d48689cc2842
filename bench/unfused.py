"""The unfused attention path (GEMM -> softmax -> GEMM, gemmgen.unfused_attention) against
gemmgen.fused_attention and manual PyTorch attention (matmul, softmax, matmul) on the
FlashAttention sweep of docs/perf.md: batch*seqlen = 16384 tokens, heads*head_dim = 2048, Nq = Nk = N.
TFLOP/s = 4*B*H*N^2*d / t, halved for causal. Lengths default to 512..4096 (the unfused path
materializes B*H*N^2 scores: 8 GB of fp32 at N = 8192), so the run takes a few minutes.

    python bench/unfused.py [--dtype bf16] [--out bench/results/unfused_h200.md]
"""
from __future__ import annotations

import argparse
import math

import torch

import gemmgen
from common import DTYPES, fa_shapes, header
from gemmgen.select import timing


def manual(q, k, v, causal):
    """PyTorch attention as written by hand: fp32 scores, softmax, cast, matmul."""
    s = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1).to(q.dtype) @ v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bench/results/unfused_h200.md")
    args = ap.parse_args()
    head = header(f"median of {args.reps} CUDA-event timings; TFLOP/s = 4*B*H*N^2*d/t (halved for causal)")
    print(head, flush=True)
    rows = ["| dtype | d | causal | N | unfused | fused | manual PyTorch | unfused/manual | fused/unfused |",
            "|---|---|---|---|---|---|---|---|---|"]
    for dname, dtype, d, causal, n, b, h, flops in fa_shapes(args.dtype, args.head_dim, args.seq_len):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        times = {}
        for label, fn in (("unfused", lambda: gemmgen.unfused_attention(q, k, v, causal=causal)),
                          ("fused", lambda: gemmgen.fused_attention(q, k, v, causal=causal)),
                          ("manual", lambda: manual(q, k, v, causal))):
            try:
                times[label] = timing.median_ms(lambda _i, fn=fn: fn(), 1, warmup=3, reps=args.reps)
            except (gemmgen.GemmgenError, torch.OutOfMemoryError) as exc:
                print(f"  {label} at N={n}: {str(exc).splitlines()[0]}", flush=True)
                times[label] = math.inf
        tf = {key: flops / ms / 1e9 if math.isfinite(ms) else 0.0 for key, ms in times.items()}
        row = (f"| {dname} | {d} | {'Y' if causal else 'N'} | {n} | {tf['unfused']:.1f} | "
               f"{tf['fused']:.1f} | {tf['manual']:.1f} | "
               f"{times['manual'] / times['unfused']:.2f} | {times['unfused'] / times['fused']:.2f} |")
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write(head + "\n\n" + "\n".join(rows) + "\n")
    print(f"\nwritten to {args.out}\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
