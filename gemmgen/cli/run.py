"""`gemmgen run`: random inputs on the GPU, fused_attention, optional verification and timing."""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from gemmgen.ops import attention as ops
from gemmgen.select import registry
from gemmgen.ops.reference import attention_reference

TOLERANCE = {"fp16": 2e-3, "bf16": 1e-2}  # relative Frobenius error ||O - ref|| / ||ref||
WARMUP = 10


def relative_error(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   alignment: str) -> float:
    """||O - ref|| / ||ref|| with the float64 reference, one batch at a time to bound memory (NaN stays NaN)."""
    num = den = 0.0
    for b in range(q.shape[0]):
        ref, _ = attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal, alignment)
        num += float((o[b:b + 1].double() - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-300)


def time_ms(fn, iters: int) -> float:
    """Median milliseconds of `fn` over `iters` runs after a warm-up, with CUDA events."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    """Run one problem as the arguments say; returns the exit status (1 on a failed --verify)."""
    if not torch.cuda.is_available():
        print(f"gemmgen: error: `gemmgen run` needs a CUDA GPU; this torch ({torch.__version__}) sees none",
              file=sys.stderr)
        return 1
    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    heads_kv = args.heads_kv or args.heads
    seq_k = args.seq_len_k or args.seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads: int, seq: int) -> torch.Tensor:
        return torch.randn(args.batch, heads, seq, args.head_dim, device="cuda", dtype=dtype, generator=gen)

    q, k, v = randn(args.heads, args.seq_len), randn(heads_kv, seq_k), randn(heads_kv, seq_k)
    alignment = "bottom_right" if args.bottom_right else "top_left"
    name = ops.selected_instance(q, k, v, causal=args.causal, instance=args.instance)

    def call() -> torch.Tensor:
        return ops.fused_attention(q, k, v, causal=args.causal, causal_alignment=alignment,
                                   instance=name)

    o = call()
    torch.cuda.synchronize()
    print(f"instance {name}: B={args.batch} H={args.heads} Hkv={heads_kv} Nq={args.seq_len} Nk={seq_k} "
          f"d={args.head_dim} {args.dtype}{' causal ' + alignment if args.causal else ''}")
    status = 0
    if args.verify:
        err = relative_error(o, q, k, v, causal=args.causal, alignment=alignment)
        ok = err <= TOLERANCE[args.dtype]  # False for NaN
        print(f"verify: relative error {err:.3e} (tolerance {TOLERANCE[args.dtype]:.0e}) "
              f"{'PASS' if ok else 'FAIL'}")
        status = 0 if ok else 1
    if args.time:
        ms = time_ms(call, args.iters)
        flops = 4 * args.batch * args.heads * args.seq_len * seq_k * args.head_dim
        flops /= 2 if args.causal else 1
        print(f"time: {name} {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s (median of {args.iters})")
    return status
