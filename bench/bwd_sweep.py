"""Backward sweep: gemmgen.fused_attention's backward against torch SDPA's backends' backward.

Shapes as in FlashAttention's benchmark: batch*seqlen = 16384 tokens, heads*head_dim = 2048,
Nq = Nk = N. Backward FLOPs = 2.5 x the forward's (4*B*H*N^2*d, halved for causal); forward +
backward = 3.5 x. Each side is what a user runs, eager and untuned, host path included:

    backward alone:      torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    forward + backward:  o = attention(q, k, v); torch.autograd.grad(o, (q, k, v), do)

for gemmgen (the instance the registry picks by default) and for SDPA restricted to each of its
flash (FlashAttention-2), efficient and cuDNN backends, all in the same process on the same
inputs, timed in --rounds rounds whose order alternates (gemmgen.select.timing.rounds_ms), each
round the median of --reps CUDA-event timings, reported as the median over the rounds.

    python bench/bwd_sweep.py [--dtype bf16 fp16] [--head-dim 64 128] [--seq-len 512 ...] [--deterministic] [--out FILE.md]

Prints one markdown table per mode and summary lines: at how many shapes with N >= 1024 gemmgen's
backward is at or above the fastest SDPA backend's, and which shapes fall below.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from common import add_sweep_args, fa_shapes, header, rounds_method
from gemmgen.ops import padding
from gemmgen.select import calls, selection, timing

BACKENDS = {"FA2": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cuDNN": SDPBackend.CUDNN_ATTENTION}
MODES = ("bwd", "fwd+bwd")
BAR_MIN_N = 1024


def attend(backend, deterministic=False):
    """The attention of one side: gemmgen's (with `deterministic`), or SDPA restricted to `backend`."""
    if backend is None:
        return lambda q, k, v, causal: gemmgen.fused_attention(q, k, v, causal=causal, deterministic=deterministic)

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def backward_instance(q, k, causal, deterministic=False) -> str:
    """The backward instance the registry picks for this call (what the gemmgen column ran); a head
    dim without tiles runs padded (gemmgen.ops.padding), and so is its backward."""
    dp = padding.needs_padding(q, k)
    if dp is not None:
        q, k = padding.pad(q, dp), padding.pad(k, dp)
    try:
        problem = calls.problem_for_bwd(q, k, causal, deterministic=deterministic)
        at = selection.padded_backward_head_dim(problem)  # the backward pads on its own account too
        if at == problem.head_dim:
            return selection.select(problem).name
        return f"{selection.select(selection.at_head_dim(problem, at)).name} (padded to d{at})"
    except gemmgen.GemmgenError:
        return "-"


def sides_for(q, k, v, do, causal, mode, deterministic=False):
    """{label: callable} of the sides that run this shape (a backend that cannot is left out)."""
    sides = {}
    for label, backend in {"gemmgen": None, **BACKENDS}.items():
        fn = attend(backend, deterministic)
        try:
            if mode == "bwd":
                o = fn(q, k, v, causal)

                def run(o=o):
                    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            else:
                def run(fn=fn):
                    torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)
            run()
        except (RuntimeError, gemmgen.GemmgenError) as exc:
            print(f"    {label}: not run ({str(exc).splitlines()[0]})", file=sys.stderr, flush=True)
            continue
        sides[label] = run
    return sides


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(ap, reps=10)
    ap.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--deterministic", action="store_true",
                    help="gemmgen's side with deterministic=True (SDPA's sides unchanged)")
    args = ap.parse_args()

    deterministic = "; gemmgen with deterministic=True" if args.deterministic else ""
    head = header(f"eager calls with the host path, default build untuned; {rounds_method(args)}; "
                  f"TFLOP/s = 2.5 (bwd) or 3.5 (fwd+bwd) x 4*B*H*N^2*d/t, halved for causal{deterministic}")
    print(head, flush=True)
    tables, summary = [], []
    for mode in args.mode:
        rows = [f"### {mode}", "", "| dtype | d | causal | N | gemmgen | FA2 | efficient | cuDNN | gemmgen/best | backward instance |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        ratios = []
        for dname, dtype, d, causal, n, b, h, fwd_flops in fa_shapes(args.dtype, args.head_dim, args.seq_len):
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            sides = sides_for(q, k, v, do, causal, mode, args.deterministic)
            ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2) if sides else {}
            flops = (2.5 if mode == "bwd" else 3.5) * fwd_flops
            tf = {label: flops / t / 1e9 for label, t in ms.items()}
            peer = max((tf[x] for x in BACKENDS if x in tf), default=None)
            ratio = tf["gemmgen"] / peer if "gemmgen" in tf and peer else None
            if ratio is not None and n >= BAR_MIN_N:
                ratios.append((ratio, f"{dname} d{d} {'causal' if causal else 'none'} N={n}"))
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            row = (f"| {dname} | {d} | {'Y' if causal else 'N'} | {n} | {fmt(tf.get('gemmgen'))} | "
                   f"{fmt(tf.get('FA2'))} | {fmt(tf.get('efficient'))} | {fmt(tf.get('cuDNN'))} | "
                   f"{'-' if ratio is None else f'{ratio:.2f}'} | {backward_instance(q, k, causal, args.deterministic)} |")
            rows.append(row)
            print(f"{mode} {row}", flush=True)
            del q, k, v, do, sides
        ahead = sum(r >= 1.0 for r, _ in ratios)
        below = sorted(r for r in ratios if r[0] < 1.0)
        summary += [f"- {mode}: gemmgen >= fastest SDPA backend at {ahead} of {len(ratios)} shapes with N >= "
                    f"{BAR_MIN_N}",
                    f"- {mode} below 1.00: " + (", ".join(f"{label} {r:.2f}" for r, label in below) or "none")]
        tables.append("\n".join(rows))
    print("\n".join(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + "\n\n" + "\n\n".join(tables) + "\n\n" + "\n".join(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
