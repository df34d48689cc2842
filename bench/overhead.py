"""Host cost of small calls: gemmgen against torch SDPA's backends, per call, the way users queue them.

    python bench/overhead.py [--iters 5000] [--rounds 5] [--out bench/results/overhead_h200.md]

For each call (a small causal prefill, a decode step through the dense API and through the
key-value-cache API, at a short and a long context), after a first call has selected and loaded
the instance:

- kernel: GPU time per call from replays of a CUDA graph of 100 calls (no host work inside);
- queued: wall time per call of `iters` back-to-back eager calls, one synchronize at the end (the
  host is the bottleneck when this exceeds the kernel time), the median over `rounds` rounds with
  gemmgen and SDPA in alternating order; SDPA is timed with each backend that runs the call
  (enable_gqa=True for GQA) and the fastest is reported;
- host only: gemmgen's queued loop with the launch replaced by a no-op, so the Python path is
  measured without the GPU queue.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.kernels import abi  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cuDNN": SDPBackend.CUDNN_ATTENTION}


def kernel_us(fn: Callable[[], object], calls: int = 100, reps: int = 20) -> float:
    """GPU time per call from CUDA-graph replays of `calls` calls."""
    return common.graph_timer(fn, calls, reps=reps, warm=1)()


def calls() -> list[tuple[str, Callable[[], object], Callable[[], object], str]]:
    """(label, gemmgen call, SDPA call, gemmgen's instance) of each measured shape."""
    out = []
    b, h, n, d = 1, 8, 128, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    out.append((f"prefill B{b} H{h} N{n} d{d} fp16 causal",
                lambda q=q, k=k, v=v: gemmgen.fused_attention(q, k, v, causal=True),
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                gemmgen.selected_instance(q, k, v, causal=True)))
    for nk in (256, 8192):
        h, hkv, d = 32, 8, 128
        qc = torch.randn(1, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(1, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        qs, ks, vs = qc.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        sdpa = lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
        out.append((f"decode B1 H{h} Hkv{hkv} Nq1 Nk{nk} d{d} bf16, fused_attention",
                    lambda qs=qs, ks=ks, vs=vs: gemmgen.fused_attention(qs, ks, vs), sdpa,
                    gemmgen.selected_instance(qs, ks, vs)))
        out.append((f"decode B1 H{h} Hkv{hkv} Nq1 Nk{nk} d{d} bf16, fused_attention_with_kvcache",
                    lambda qc=qc, kc=kc, vc=vc, lens=lens: gemmgen.fused_attention_with_kvcache(qc, kc, vc, lens),
                    sdpa, "(decode family)"))
    return out


def best_sdpa(fn: Callable[[], object], iters: int) -> tuple[str, float]:
    """The fastest SDPA backend for `fn` (name, queued us per call); backends that refuse it are skipped."""
    best = ("-", float("inf"))
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                fn()
                us = common.queued_us(fn, iters)
        except RuntimeError:
            continue
        best = min(best, (name, us), key=lambda x: x[1])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()

    rows = []
    for label, call, sdpa, instance in calls():
        call()
        ours, theirs, backend = [], [], "-"
        for r in range(args.rounds):  # sides in alternating order
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                if side == 0:
                    ours.append(common.queued_us(call, args.iters))
                else:
                    backend, us = best_sdpa(sdpa, args.iters)
                    theirs.append(us)
        real_run = abi.Instance.run
        abi.Instance.run = lambda self, params, stream: None  # the launch becomes a no-op
        try:
            host = statistics.median(common.queued_us(call, args.iters) for _ in range(args.rounds))
        finally:
            abi.Instance.run = real_run
        g, s = statistics.median(ours), statistics.median(theirs)
        rows.append((label, instance, kernel_us(call), g, host, backend, s))
        print(f"{label}: gemmgen {g:.1f} us queued (host {host:.1f}), SDPA {backend} {s:.1f}", flush=True)

    header = common.header(f"eager calls queued back to back, wall time per call of {args.iters} calls, the median "
                           f"of {args.rounds} rounds with the sides in alternating order; host only: the launch "
                           f"made a no-op; kernel: CUDA graph replay of 100 calls; command: python "
                           f"bench/overhead.py {shlex.join(sys.argv[1:])}".rstrip())
    table = ["| call | gemmgen instance | kernel us | gemmgen queued us | gemmgen host only us | "
             "fastest SDPA | SDPA queued us | SDPA time / gemmgen time |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {label} | {inst} | {k:.2f} | {g:.1f} | {host:.1f} | {backend} | {s:.1f} | {s / g:.2f} |"
              for label, inst, k, g, host, backend, s in rows]
    text = header + "\n\n" + "\n".join(table) + "\n"
    common.publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
