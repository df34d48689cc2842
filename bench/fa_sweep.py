"""FlashAttention sweep: every built gemmgen candidate against torch SDPA's backends.

Shapes as in FlashAttention's benchmark: batch*seqlen = 16384 tokens, heads*head_dim = 2048,
Nq = Nk = N. TFLOP/s = 4*B*H*N^2*d / time, halved for causal. Every tensor is 64 MB, larger
than the H200's 60 MB L2, so no input stays cache-resident between repeats.

    python bench/fa_sweep.py [--dtype bf16 fp16] [--head-dim 64 128] [--out bench/results/x.md]

Prints one markdown table (and writes it to --out): per shape, the best gemmgen instance and
its TFLOP/s, the instance the registry picks by default, and the SDPA flash (FlashAttention-2),
efficient and cuDNN backends, all measured in the same process on the same inputs.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from gemmgen import registry
from gemmgen.shapes import HIDDEN, SEQLENS, TOKENS  # the sweep's shapes, shared with `gemmgen profile`

BACKENDS = {"FA2": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cuDNN": SDPBackend.CUDNN_ATTENTION}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def time_ms(fn, warmup: int, reps: int) -> float:
    """Median of `reps` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def built_instances(dtype: str, head_dim: int, causal: bool) -> list[str]:
    """Names of the built instances (any family) for this dtype, head dim and mask."""
    mask = "causal" if causal else "none"
    return [c.name for c in registry.load()[0] if c.entry.state == "built" and
            (c.entry.params["dtype"], c.entry.params["head_dim"], c.entry.params["mask"]) == (dtype, head_dim, mask)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()

    dev = torch.cuda.get_device_properties(0)
    header = (f"{dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, "
              f"gemmgen {gemmgen.__version__}, {datetime.date.today()}; median of {args.reps} CUDA-event "
              f"timings; TFLOP/s = 4*B*H*N^2*d/t (halved for causal)")
    rows = ["| dtype | d | causal | N | best gemmgen | instance | default pick | FA2 | efficient | cuDNN | best/FA2 |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    for dname in args.dtype:
        dtype = DTYPES[dname]
        for d in args.head_dim:
            for causal in (False, True):
                for n in args.seq_len:
                    b, h = TOKENS // n, HIDDEN // d
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    tflops = lambda ms: flops / ms / 1e9  # noqa: E731
                    measured = {}
                    for name in built_instances(dname, d, causal):
                        fn = lambda name=name: gemmgen.fused_attention(q, k, v, causal=causal, instance=name)  # noqa: E731
                        measured[name] = tflops(time_ms(fn, 3, args.reps))
                    peers = {}
                    for label, backend in BACKENDS.items():
                        try:
                            with sdpa_kernel([backend]):
                                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                                peers[label] = tflops(time_ms(fn, 3, args.reps))
                        except RuntimeError:
                            peers[label] = None
                    best = max(measured, key=measured.get) if measured else None
                    pick = gemmgen.selected_instance(q, k, v, causal=causal) if measured else None
                    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
                    ratio = (f"{measured[best] / peers['FA2']:.2f}" if best and peers["FA2"] else "-")
                    row = (f"| {dname} | {d} | {'Y' if causal else 'N'} | {n} | {fmt(measured.get(best))} | "
                           f"{best or '-'} | {fmt(measured.get(pick))} | {fmt(peers['FA2'])} | "
                           f"{fmt(peers['efficient'])} | {fmt(peers['cuDNN'])} | {ratio} |")
                    rows.append(row)
                    print(row, flush=True)
                    print("    all: " + ", ".join(f"{name.split('_')[-1]}={t:.0f}" for name, t in
                                              sorted(measured.items(), key=lambda kv: -kv[1])), file=sys.stderr,
                          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
