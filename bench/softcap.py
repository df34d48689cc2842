"""The logit softcap (Gemma 2's attn_logit_softcapping): gemmgen.fused_attention(softcap=c) against
the same call without a cap, and against the eager attention a model with a softcap runs today
(torch SDPA refuses softcaps; transformers runs them eagerly: Q K^T, tanh, mask, softmax, P V).

    python bench/softcap.py [--dtype bf16] [--head-dim 128 256] [--seq-len 1024 4096 16384] [--rounds 3] [--out FILE.md]
    python bench/softcap.py --backward [...]   # the backward alone of each side (2.5x the FLOPs)

Shapes: B * N = 16384 tokens, H * d = 2048, Hkv = H / 2, causal, softcap 50. Sides, each eager and
queued back to back with the host path, default build untuned, in --rounds alternating rounds
(gemmgen.select.timing.rounds_ms) of the median of --reps CUDA-event timings:
  softcap:        fused_attention(q, k, v, causal=True, softcap=50.0) (the registry's `_sc` instance)
  no cap, same:   the same instance's family without a cap (fa2_sm80's default tile, forced)
  no cap, pick:   fused_attention(q, k, v, causal=True), the registry's pick (fmha_sm90 on Hopper)
  eager:          the eager attention, K and V repeated to H heads outside the timing
TFLOP/s = 2 * B * H * N^2 * d / t (causal: half of 4 B H N^2 d). With --backward every side is the
backward alone of a forward that requires grad (torch.autograd.grad(o, (q, k, v), do,
retain_graph=True)), 2.5x the FLOPs, and "no cap, same" is left out (the backward takes no instance=).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, backward_alone, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.select import calls, selection, timing  # noqa: E402

TOKENS, HIDDEN, CAP = 16384, 2048, 50.0


def eager(q, k, v, cap):
    """Causal attention with a logit softcap as transformers' eager path computes it."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = torch.tanh(s / cap) * cap
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--seq-len", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--backward", action="store_true", help="time the backward alone (2.5x the FLOPs)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]

    def timed(attend, inputs):
        """The side's call, or with --backward the backward alone of its output."""
        return backward_alone(attend, inputs) if args.backward else attend
    rows = ["| shape | softcap instance | softcap | no cap, same family | no cap, pick | eager | softcap / same "
            "| softcap / pick | softcap / eager |", "|---|---|---|---|---|---|---|---|---|"]
    for d in args.head_dim:
        for n in args.seq_len:
            b, h = TOKENS // n, HIDDEN // d
            grad = args.backward
            q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad)
            k, v = (torch.randn(b, h // 2, n, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(2))
            name = gemmgen.selected_instance(q, k, v, causal=True, softcap=CAP)
            same = name.removesuffix("_sc")
            if grad:  # the backward's instance (K and V as the backward selects them: with Q's heads)
                kk = k.detach().repeat_interleave(2, dim=1)
                name = selection.select(calls.problem_for_bwd(q.detach(), kk, True, softcap=True)).name
            kx, vx = (t.detach().repeat_interleave(2, dim=1).requires_grad_(grad) for t in (k, v))
            sides = {"softcap": timed(lambda: gemmgen.fused_attention(q, k, v, causal=True, softcap=CAP), (q, k, v)),
                     "pick": timed(lambda: gemmgen.fused_attention(q, k, v, causal=True), (q, k, v))}
            if not grad:
                sides["same"] = lambda: gemmgen.fused_attention(q, k, v, causal=True, instance=same)
            if b * h * n * n * (2 if not grad else 8) <= 8 << 30:  # the eager side's scores (and grads) in memory
                sides["eager"] = timed(lambda: eager(q, kx, vx, CAP), (q, kx, vx))
            ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
            flops = (2.5 if grad else 1.0) * 2 * b * h * n * n * d
            tf = {s: flops / t / 1e9 for s, t in ms.items()}
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            ratio = lambda s: "-" if s not in tf else f"{tf['softcap'] / tf[s]:.2f}"  # noqa: E731
            row = (f"| d{d} B{b} H{h} Hkv{h // 2} N{n} | {name} | {fmt(tf['softcap'])} | {fmt(tf.get('same'))} | "
                   f"{fmt(tf['pick'])} | {fmt(tf.get('eager'))} | {ratio('same')} | {ratio('pick')} | "
                   f"{ratio('eager')} |")
            rows.append(row)
            print(row, flush=True)
            del q, k, v, kx, vx
    what = "backward alone (torch.autograd.grad of a forward that requires grad), " if args.backward else ""
    factor = 2.5 if args.backward else 1
    head = header(f"{what}{args.dtype}, causal, softcap {CAP:g}, eager calls queued back to back, host path included, "
                  f"default build untuned; each side the median over {args.rounds} rounds in alternating order of "
                  f"the median of {args.reps} CUDA-event timings; TFLOP/s = {factor:g}*2*B*H*N^2*d/t; "
                  f"command: python bench/softcap.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
