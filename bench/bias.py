"""Additive masks (attn_mask): gemmgen.fused_attention(attn_mask=...) against the same call without a
mask, the family that ran masks before fmha_sm90's `_bias` instances (mea_sm80, forced), and torch
SDPA's backends that take a mask, in one process.

    python bench/bias.py [--dtype bf16] [--head-dim 64 128 256] [--seq-len 1024 4096 16384]
                         [--mask padding|float] [--backward] [--rounds 3] [--out FILE.md]

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
--backward times a training step instead, the forward and o.backward(do) (the mask takes no
gradient), TFLOP/s = 3.5 * 4 * B * H * N^2 * d / t; the mea_sm80 side is left out (forcing the
forward's instance does not choose the backward's), and the table names the backward instance the
registry picks for the masked call.
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
from gemmgen.select import calls, registry, selection, timing  # noqa: E402
from gemmgen.ops.attention import _prepare_mask  # noqa: E402

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


def backward_instance(q, k, mask) -> str:
    """The backward instance the registry picks for a masked training call (K with Q's heads, as the
    selection sees it), or "-"."""
    try:
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        return selection.select(calls.problem_for_bwd(q, kk, False, bias=_prepare_mask(mask, q, kk))).name
    except gemmgen.GemmgenError:
        return "-"


def step(fn, leaves, do):
    """A training step of `fn`'s attention: forward, then the backward of sum(O * dO)."""
    def run():
        for t in leaves:
            t.grad = None
        fn().backward(do)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seq-len", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--mask", default="padding", choices=["padding", "float"])
    ap.add_argument("--backward", action="store_true", help="time forward + backward training steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    names = ["mask", "no mask", *([] if args.backward else ["mea_sm80"]), *SDPA]
    rows = ["| shape | mask instance | " + " | ".join(f"{s} TFLOP/s" for s in names)
            + " | mask / no mask |" + ("" if args.backward else " mask / mea_sm80 |") + " mask / best SDPA |",
            "|---|---|" + "---|" * (len(names) + (2 if args.backward else 3))]
    for d in args.head_dim:
        for n in args.seq_len:
            b, h = max(1, TOKENS // n), HIDDEN // d
            q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=args.backward)
            k, v = (torch.randn(b, h // 2, n, d, device="cuda", dtype=dtype, requires_grad=args.backward)
                    for _ in range(2))
            do = torch.randn_like(q)
            mask = (padding_mask(b, n) if args.mask == "padding"
                    else (torch.randn(b, h, n, n, device="cuda") * 0.5).to(dtype))
            name = gemmgen.selected_instance(q, k, v, attn_mask=mask)
            if args.backward:
                name = f"{name}, {backward_instance(q.detach(), k.detach(), mask)}"
            sides = {"mask": lambda: gemmgen.fused_attention(q, k, v, attn_mask=mask),
                     "no mask": lambda: gemmgen.fused_attention(q, k, v)}
            if not args.backward and (mea := mea_instance(args.dtype, d)) is not None:
                sides["mea_sm80"] = lambda: gemmgen.fused_attention(q, k, v, attn_mask=mask, instance=mea)
            for side, backend in SDPA.items():
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                try:
                    step(sdpa, (q, k, v), do)() if args.backward else sdpa()
                    torch.cuda.synchronize()
                except RuntimeError:
                    continue  # the backend refuses the call
                sides[side] = sdpa
            if args.backward:
                sides = {s: step(fn, (q, k, v), do) for s, fn in sides.items()}
            ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
            flops = (3.5 if args.backward else 1.0) * 4 * b * h * n * n * d
            tf = {s: flops / t / 1e9 for s, t in ms.items()}
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            best = max((tf[s] for s in SDPA if s in tf), default=None)
            ratio = lambda x: "-" if x is None else f"{tf['mask'] / x:.2f}"  # noqa: E731
            row = (f"| d{d} B{b} H{h} Hkv{h // 2} N{n} | {name} | " + " | ".join(fmt(tf.get(s)) for s in names)
                   + f" | {ratio(tf['no mask'])} |" + ("" if args.backward else f" {ratio(tf.get('mea_sm80'))} |")
                   + f" {ratio(best)} |")
            rows.append(row)
            print(row, flush=True)
            del q, k, v, do, mask
            torch.cuda.empty_cache()
    what = ("bool [B, 1, N, N] causal + left-padding mask (transformers' SDPA mask)" if args.mask == "padding"
            else f"float [B, H, N, N] bias in {args.dtype}")
    measured = ("training steps (forward + backward), TFLOP/s = 3.5*4*B*H*N^2*d/t" if args.backward
                else "forward calls, TFLOP/s = 4*B*H*N^2*d/t")
    head = header(f"{args.dtype}, {what}, Hkv = H / 2, eager {measured} (the whole N x N), queued back to back, "
                  f"host path included, default build untuned; each side the median over {args.rounds} rounds in "
                  f"alternating order of the median of {args.reps} CUDA-event timings; "
                  f"command: python bench/bias.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
