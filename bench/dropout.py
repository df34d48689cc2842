"""Attention dropout on Hopper: gemmgen.fused_attention(dropout_p=p) (fmha_sm90's `_dropout`
instances) against the same call without dropout, mea_sm80's dropout (where built) and torch SDPA's
backends that run dropout.

    python bench/dropout.py [--dtype bf16] [--head-dim 64 128] [--seq-len 1024 4096 16384] [--rounds 3] [--out FILE.md]
    python bench/dropout.py --backward [...]   # the backward alone of each side (2.5x the FLOPs)

Shapes: B * N = 16384 tokens, H * d = 2048, H = Hkv, causal or not, p = 0.1. Sides, each eager and
queued back to back with the host path, default build untuned, in --rounds alternating rounds
(gemmgen.select.timing.rounds_ms) of the median of --reps CUDA-event timings:
  dropout:     fused_attention(q, k, v, causal=c, dropout_p=0.1, seed=1) (the registry's pick)
  no dropout:  fused_attention(q, k, v, causal=c), the registry's pick
  mea_sm80:    the dropout call forced onto mea_sm80's default instance (where built)
  SDPA:        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=c) under each of the
               flash, efficient and cuDNN backends (those that run it), the fastest reported
TFLOP/s = 4 * B * H * N^2 * d / t, halved for causal. With --backward every side is the backward
alone of a forward that requires grad (torch.autograd.grad(o, (q, k, v), do, retain_graph=True);
fmha_bwd_sm90's `_dropout` instances on Hopper), 2.5x the FLOPs, and mea_sm80 is left out (the
backward takes no instance=).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, backward_alone, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.generator.families import mea_sm80  # noqa: E402
from gemmgen.select import calls, registry, selection, timing  # noqa: E402

TOKENS, HIDDEN, P = 16384, 2048, 0.1
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cuDNN": SDPBackend.CUDNN_ATTENTION}


def sdpa(backend, q, k, v, causal):
    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=causal)
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--backward", action="store_true", help="time the backward alone (2.5x the FLOPs)")
    args = ap.parse_args()
    grad = args.backward

    def timed(attend, inputs):
        """The side's call, or with --backward the backward alone of its output."""
        return backward_alone(attend, inputs) if grad else attend
    dtype = DTYPES[args.dtype]
    built = {c.name for c in registry.load()[0] if c.entry.state == "built"}
    rows = [f"| shape | dropout {'backward ' if grad else ''}instance | dropout | no dropout | mea_sm80 | best SDPA "
            "| dropout / no dropout | dropout / SDPA | dropout / mea_sm80 |", "|---|---|---|---|---|---|---|---|---|"]
    for d in args.head_dim:
        mea = next((i.name for i in mea_sm80.DEFAULT if i.dtype.value == args.dtype and i.max_head_dim >= d
                    and i.name in built), None)
        for causal in (False, True):
            for n in args.seq_len:
                b, h = TOKENS // n, HIDDEN // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3))
                name = gemmgen.selected_instance(q, k, v, causal=causal, dropout_p=P)
                if grad:  # the backward's instance
                    name = selection.select(calls.problem_for_bwd(q.detach(), k.detach(), causal, dropout=True)).name
                qkv = (q, k, v)
                sides = {"dropout": timed(lambda: gemmgen.fused_attention(q, k, v, causal=causal, dropout_p=P, seed=1),
                                          qkv),
                         "plain": timed(lambda: gemmgen.fused_attention(q, k, v, causal=causal), qkv)}
                if mea is not None and not grad:
                    sides["mea"] = lambda: gemmgen.fused_attention(q, k, v, causal=causal, dropout_p=P, seed=1,
                                                                   instance=mea)
                for label, backend in BACKENDS.items():
                    try:
                        sides[label] = timed(sdpa(backend, q, k, v, causal), qkv)
                        sides[label]()
                    except RuntimeError:  # the backend does not run this call
                        sides.pop(label, None)
                ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
                flops = (2.5 if grad else 1.0) * 4 * b * h * n * n * d / (2 if causal else 1)
                tf = {s: flops / t / 1e9 for s, t in ms.items()}
                best = max((s for s in BACKENDS if s in tf), key=lambda s: tf[s], default=None)
                fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
                ratio = lambda s: "-" if s not in tf else f"{tf['dropout'] / tf[s]:.2f}"  # noqa: E731
                sdpa_cell = "-" if best is None else f"{best} {tf[best]:.0f}"
                row = (f"| d{d} B{b} H{h} N{n}{' causal' if causal else ''} | {name} | {fmt(tf['dropout'])} | "
                       f"{fmt(tf['plain'])} | {fmt(tf.get('mea'))} | {sdpa_cell} | {ratio('plain')} | "
                       f"{'-' if best is None else ratio(best)} | {ratio('mea')} |")
                rows.append(row)
                print(row, flush=True)
                del q, k, v
    what = "backward alone (torch.autograd.grad of a forward that requires grad), " if grad else ""
    head = header(f"{what}{args.dtype}, dropout_p {P:g}, eager calls queued back to back, host path included, default "
                  f"build untuned; each side the median over {args.rounds} rounds in alternating order of the median "
                  f"of {args.reps} CUDA-event timings; TFLOP/s = {'2.5*' if grad else ''}4*B*H*N^2*d/t "
                  f"(halved for causal); command: python bench/dropout.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
