"""Which kernels torch SDPA's backends launch on the FlashAttention sweep's shapes, with their launch
shape: name, grid, block, registers per thread and shared memory, from torch.profiler's trace of one
warm call. It tells what a peer's tile and schedule are where it leads (bench/NOTES.md, experiment 40).

    python bench/sdpa_kernels.py --backend cuDNN --head-dim 64 --seq-len 512 1024
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from fa_sweep import BACKENDS, DTYPES  # the sweep's (same folder)
from gemmgen.select.shapes import HIDDEN, SEQLENS, TOKENS


def kernels(fn) -> list[dict]:
    """The CUDA kernels one call of fn launches, as torch.profiler's trace records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", nargs="+", default=["cuDNN"], choices=list(BACKENDS))
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--mask", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    args = ap.parse_args()

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; one warm call per shape "
          f"(B*N = {TOKENS}, H*d = {HIDDEN})")
    print("| backend | dtype | d | causal | N | us | kernel | grid | block | registers | shared memory |")
    print("|---" * 11 + "|")
    for backend in args.backend:
        for dname in args.dtype:
            for d in args.head_dim:
                for mask in args.mask:
                    for n in args.seq_len:
                        b, h, causal = TOKENS // n, HIDDEN // d, mask == "causal"
                        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPES[dname]) for _ in range(3))

                        def call():
                            with sdpa_kernel([BACKENDS[backend]]):
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        try:
                            for _ in range(3):
                                call()
                            torch.cuda.synchronize()
                        except RuntimeError as e:  # the backend does not run this shape
                            print(f"| {backend} | {dname} | {d} | {'Y' if causal else 'N'} | {n} | - | "
                                  f"not run: {str(e).splitlines()[0][:80]} | | | | |")
                            continue
                        for e in kernels(call):
                            a = e["args"]
                            print(f"| {backend} | {dname} | {d} | {'Y' if causal else 'N'} | {n} | {e['dur']:.1f} | "
                                  f"{e['name'][:100]} | {a.get('grid')} | {a.get('block')} | "
                                  f"{a.get('registers per thread')} | {a.get('shared memory')} |")
                        del q, k, v
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
