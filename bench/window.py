"""Sliding-window (local) attention: gemmgen.fused_attention(window=...) against torch SDPA's backends
given the window as a bool mask (what a model without a window argument passes), and against
gemmgen's own dense causal rate.

    python bench/window.py [--dtype bf16] [--head-dim 128 64] [--rounds 5] [--out FILE.md] [--candidates] [--backward]

Shapes: B * N = 16384 tokens, H = 32 query heads, Hkv = 8 (--kv-heads), N in 4096 to 16384, causal windows of 256,
1024 and 4096 keys (window=(w - 1, 0): the row's own key and w - 1 before it, as Mistral's and
Gemma's sliding-window layers) and one two-sided window (512, 512) without the causal mask.

TFLOP/s = 4 * B * H * d * (visible query-key pairs) / time. The issue's bar: the window's rate at
least 0.9x the dense Hopper rate at the same shape, counting only the visible pairs; the dense rate
is gemmgen's causal call at the same N, timed in the same rounds ("dense causal"). SDPA runs with
enable_gqa=True and the bool mask (a backend without GQA gets K and V expanded to H heads, outside
timing); a backend that cannot run it is shown as "-". Each side's calls are
eager and queued back to back, the host path included, the default build untuned; every side is
timed in --rounds rounds in alternating order (gemmgen.select.timing.rounds_ms), each round the
median of --reps CUDA-event timings, reported as its median over the rounds. With --candidates every
built local instance of the dtype and head dim joins the rounds (forced by name), and a second table
gives each one's rate: the data a default tile is chosen from.

With --backward every side is the backward alone of a forward whose inputs require grad
(torch.autograd.grad(o, (q, k, v), do, retain_graph=True), as bench/bwd_sweep.py times it), and
TFLOP/s is 2.5x the forward's count.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, backward_alone, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.select import calls, registry, selection, timing  # noqa: E402

H, HKV, TOKENS = 32, 8, 16384
BACKENDS = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}
SEQLENS = (4096, 8192, 16384)
WINDOWS = (((255, 0), True), ((1023, 0), True), ((4095, 0), True), ((512, 512), False))


def visible(n: int, window: tuple[int, int]) -> torch.Tensor:
    """The [N, N] bool mask of the window (top-left: Nq = Nk here)."""
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    left, right = window
    return ((j >= i - left) if left >= 0 else True) & ((j <= i + right) if right >= 0 else True)


def pairs(n: int, window: tuple[int, int]) -> int:
    """Visible query-key pairs of one head."""
    left, right = window
    return sum(min(n - 1, i + right if right >= 0 else n) - max(0, i - left if left >= 0 else 0) + 1
               for i in range(n))


def local_candidates(dtype: str, d: int) -> list[str]:
    """The built local (sliding-window) instances of a dtype and head dim, by name."""
    names = []
    for cand in registry.load()[0]:
        p = cand.entry.params
        if (cand.entry.state == "built" and p.get("mask") == "local" and p.get("dtype") == dtype
                and p.get("head_dim") == d):
            names.append(cand.name)
    return sorted(set(names))


def backward_instance(q: torch.Tensor, k: torch.Tensor, window: tuple[int, int]) -> str:
    """The backward instance the registry picks for a windowed call (K expanded to Q's heads, as the
    backward reads it)."""
    kk = k.detach().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    try:
        return selection.select(calls.problem_for_bwd(q.detach(), kk, False, window=window)).name
    except gemmgen.GemmgenError:
        return "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--candidates", action="store_true", help="also time every built local instance (forced)")
    ap.add_argument("--kv-heads", type=int, default=HKV, help=f"key/value heads (default {HKV}; {H}: no GQA)")
    ap.add_argument("--backward", action="store_true", help="time the backward alone (2.5x the forward's FLOPs)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    flop_factor = 2.5 if args.backward else 1.0

    def timed(attend):
        """The side's call: attend() itself, or with --backward the backward alone of its output."""
        return backward_alone(attend, (q, k, v)) if args.backward else attend
    rows = ["| shape | window | gemmgen instance | gemmgen | efficient (mask) | cuDNN (mask) | gemmgen/best SDPA "
            "| gemmgen dense causal | window/dense |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    ratios, dense_ratios = [], []
    tile_rows = ["| shape | window | instance | TFLOP/s | of the pick |", "|---|---|---|---|---|"]
    for d in args.head_dim:
        for n in args.seq_len:
            b = TOKENS // n
            q = torch.randn(b, H, n, d, device="cuda", dtype=dtype, requires_grad=args.backward)
            k, v = (torch.randn(b, args.kv_heads, n, d, device="cuda", dtype=dtype, requires_grad=args.backward)
                    for _ in range(2))
            expanded = None
            for window, causal in WINDOWS:
                mask = visible(n, window)
                sides = {"gemmgen": timed(lambda w=window: gemmgen.fused_attention(q, k, v, window=w)),
                         "dense": timed(lambda: gemmgen.fused_attention(q, k, v, causal=True))}
                for name, backend in BACKENDS.items():
                    def run(backend=backend, mask=mask, k=k, v=v, gqa=True):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                    try:
                        call = timed(run)
                        call()
                    except RuntimeError:  # no GQA in this backend: K and V expanded to H heads outside timing
                        if expanded is None:
                            expanded = [t.detach().repeat_interleave(H // args.kv_heads, dim=1)
                                        .requires_grad_(args.backward) for t in (k, v)]
                        try:
                            call = timed(functools.partial(run, k=expanded[0], v=expanded[1], gqa=False))
                            call()
                        except RuntimeError:  # a backend that cannot run this call is left out
                            continue
                    sides[name] = call
                names = local_candidates(args.dtype, d) if args.candidates else []
                for name in names:
                    sides[name] = timed(lambda w=window, name=name: gemmgen.fused_attention(q, k, v, window=w,
                                                                                           instance=name))
                ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=3)
                work = flop_factor * 4 * b * H * d * pairs(n, window)
                dense_work = flop_factor * 4 * b * H * d * n * (n + 1) // 2
                rate = {s: (dense_work if s == "dense" else work) / t / 1e9 for s, t in ms.items()}
                best = max((rate[s] for s in BACKENDS if s in rate), default=None)
                ratio = rate["gemmgen"] / best if best else None
                dense = rate["gemmgen"] / rate["dense"]
                label = f"d{d} B{b} N{n}"
                if ratio is not None:
                    ratios.append((ratio, f"{label} {window}"))
                dense_ratios.append((dense, f"{label} {window}"))
                instance = (backward_instance(q, k, window) if args.backward
                            else gemmgen.selected_instance(q, k, v, window=window))
                kind = "" if causal else " (two-sided)"
                row = (f"| {label} | {window}{kind} | {instance} | {fmt(rate['gemmgen'])} | "
                       f"{fmt(rate.get('efficient'))} | {fmt(rate.get('cuDNN'))} | "
                       f"{'-' if ratio is None else f'{ratio:.2f}'} | {fmt(rate['dense'])} | {dense:.2f} |")
                rows.append(row)
                print(row, flush=True)
                for name in names:
                    tile_rows.append(f"| {label} | {window} | {name} | {rate[name]:.0f} | "
                                     f"{rate[name] / rate['gemmgen']:.2f} |")
    what = "backward alone (torch.autograd.grad of a forward that requires grad), " if args.backward else ""
    head = header(f"{what}{args.dtype}, H={H} Hkv={args.kv_heads}, eager calls queued back to back, host path "
                  f"included, default build untuned; each side the median over {args.rounds} rounds in alternating "
                  f"order of the median of {args.reps} CUDA-event timings; TFLOP/s = {flop_factor:g}*4*B*H*d*visible "
                  f"pairs/t; SDPA with enable_gqa=True (K and V expanded for a backend without GQA) and the window as a bool mask; "
                  f"command: python bench/window.py {' '.join(sys.argv[1:])}".rstrip())
    summary = []
    if ratios:
        summary.append(f"- gemmgen / fastest SDPA backend (masked): min {min(ratios)[0]:.2f} ({min(ratios)[1]}), "
                       f"max {max(ratios)[0]:.2f} ({max(ratios)[1]})")
    summary.append("- window / dense causal rate at the same shape (visible pairs): "
                   + ", ".join(f"{label} {r:.2f}" for r, label in sorted(dense_ratios)[:4]) + " (lowest four); "
                   + f"{sum(r >= 0.9 for r, _ in dense_ratios)} of {len(dense_ratios)} at >= 0.9")
    text = head + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(summary) + "\n"
    if args.candidates:
        text += "\nEvery built local instance, forced, in the same rounds:\n\n" + "\n".join(tile_rows) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
