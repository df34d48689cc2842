"""Additive masks (attn_mask): gemmgen.fused_attention(attn_mask=...) against the same call without a
mask, the family that ran masks before fmha_sm90's `_bias` instances (mea_sm80, forced), and torch
SDPA's backends that take a mask, in one process.

    python bench/bias.py [--dtype bf16] [--head-dim 64 128 256] [--seq-len 1024 4096 16384]
                         [--mask padding|float] [--rounds 3] [--out FILE.md]

Shapes: B * N = 16384 tokens, H * d = 2048, Hkv = H / 2. Masks: `padding`, the bool [B, 1, N, N]
mask a Hugging Face model builds for SDPA from a left-padded batch (causal, entry i's first
i * N / (2B) keys hidden); `float`, a float [B, H, N, N] bias (normal, 0.5) in the inputs' dtype.
The masked calls run the whole N x N (the mask carries the causality), so TFLOP/s = 4 * B * H * N^2 *
d / t for every side, the unmasked one included. Sides, each eager and queued back to back with the
host path (the bool mask's conversion included), default build untuned, in --rounds alternating
rounds (gemmgen.select.timing.rounds_ms) of the median of --reps CUDA-event timings:
  mask:           fused_attention(q, k, v, attn_mask=mask), the registry's pick
  no mask:        fused_attention(q, k, v), the registry's pick (the dense rate of the shape)
  mea_sm80:       the masked call on mea_sm80's instance for the head dim (forced; where built)
  SDPA eff/cuDNN: F.scaled_dot_product_attention(..., attn_mask=mask, enable_gqa=True) under the
                  efficient and cuDNN backends (where they run the call)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.select import registry, timing  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
SDPA = {"SDPA eff": SDPBackend.EFFICIENT_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}


def padding_mask(b: int, n: int) -> torch.Tensor:
    """[B, 1, N, N] bool, True where a query sees a key: causal, entry i's first i * N / (2B) keys
    hidden (left padding), as transformers builds it for SDPA."""
    causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    start = (torch.arange(b, device="cuda") * n) // (2 * b)
    real = torch.arange(n, device="cuda")[None, :] >= start[:, None]  # [B, N] keys that are tokens
    return (causal[None] & real[:, None, :])[:, None]


def mea_instance(dtype: str, d: int) -> str | None:
    """A built mea_sm80 instance that runs head dim d (the smallest bound), or None."""
    built = [c for c in registry.load()[0] if c.entry.family == "mea_sm80" and c.entry.state == "built"
             and c.entry.params.get("dtype") == dtype and c.entry.params.get("max_head_dim", 0) >= d]
    return min(built, key=lambda c: c.entry.params["max_head_dim"]).name if built else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seq-len", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--mask", default="padding", choices=["padding", "float"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    names = ["mask", "no mask", "mea_sm80", *SDPA]
    rows = ["| shape | mask instance | " + " | ".join(f"{s} TFLOP/s" for s in names)
            + " | mask / no mask | mask / mea_sm80 | mask / best SDPA |",
            "|---|---|" + "---|" * (len(names) + 3)]
    for d in args.head_dim:
        for n in args.seq_len:
            b, h = max(1, TOKENS // n), HIDDEN // d
            q = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, h // 2, n, d, device="cuda", dtype=dtype) for _ in range(2))
            mask = (padding_mask(b, n) if args.mask == "padding"
                    else (torch.randn(b, h, n, n, device="cuda") * 0.5).to(dtype))
            name = gemmgen.selected_instance(q, k, v, attn_mask=mask)
            sides = {"mask": lambda: gemmgen.fused_attention(q, k, v, attn_mask=mask),
                     "no mask": lambda: gemmgen.fused_attention(q, k, v)}
            if (mea := mea_instance(args.dtype, d)) is not None:
                sides["mea_sm80"] = lambda: gemmgen.fused_attention(q, k, v, attn_mask=mask, instance=mea)
            for side, backend in SDPA.items():
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                try:
                    sdpa()
                    torch.cuda.synchronize()
                except RuntimeError:
                    continue  # the backend refuses the call
                sides[side] = sdpa
            ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
            tf = {s: 4 * b * h * n * n * d / t / 1e9 for s, t in ms.items()}
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            best = max((tf[s] for s in SDPA if s in tf), default=None)
            ratio = lambda x: "-" if x is None else f"{tf['mask'] / x:.2f}"  # noqa: E731
            row = (f"| d{d} B{b} H{h} Hkv{h // 2} N{n} | {name} | " + " | ".join(fmt(tf.get(s)) for s in names)
                   + f" | {ratio(tf['no mask'])} | {ratio(tf.get('mea_sm80'))} | {ratio(best)} |")
            rows.append(row)
            print(row, flush=True)
            del q, k, v, mask
            torch.cuda.empty_cache()
    what = ("bool [B, 1, N, N] causal + left-padding mask (transformers' SDPA mask)" if args.mask == "padding"
            else f"float [B, H, N, N] bias in {args.dtype}")
    head = header(f"{args.dtype}, {what}, Hkv = H / 2, eager calls queued back to back, host path included, "
                  f"default build untuned; each side the median over {args.rounds} rounds in alternating order of "
                  f"the median of {args.reps} CUDA-event timings; TFLOP/s = 4*B*H*N^2*d/t (the whole N x N); "
                  f"command: python bench/bias.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
