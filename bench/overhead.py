"""Host overhead of gemmgen.fused_attention per call, against the kernel time of a small problem.

    python bench/overhead.py [--iters 20000] [--out bench/results/overhead_h200.md]

For a small problem (B=1 H=8 N=128 d=64 fp16, causal), after the first call has selected and loaded
the instance (the selection is then a dictionary hit):

- kernel: GPU time per call, from replays of a CUDA graph of 100 calls (no host work inside);
- call, synchronized loop: wall time per call of back-to-back calls, one synchronize at the end
  (the host is the bottleneck when it exceeds the kernel time);
- host only: the same loop with the launch replaced by a no-op, total and by stage (validation;
  the custom op's dispatch, allocation, cached selection and params), so the Python overhead
  is measured without the GPU queue;
- torch SDPA (flash backend) on the same problem, synchronized loop, for scale.

The issue's target: host overhead <= 20 us per call on the H200 host.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from gemmgen.kernels import abi, launch
from gemmgen.ops import attention as ops, torch_op


def per_call_us(fn: Callable[[], object], iters: int, rounds: int = 5, sync: bool = True) -> float:
    """Median over `rounds` of the wall time per call of `iters` back-to-back calls (us)."""
    results = []
    for _ in range(rounds):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync:
            torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(results)


def kernel_us(fn: Callable[[], object], calls: int = 100, reps: int = 20) -> float:
    """GPU time per call from CUDA-graph replays of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()

    b, h, n, d = 1, 8, 128, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    call = lambda: gemmgen.fused_attention(q, k, v, causal=True)  # noqa: E731
    call()
    name = gemmgen.selected_instance(q, k, v, causal=True)
    rows = [("kernel (CUDA graph replay)", kernel_us(call)),
            ("fused_attention, synchronized loop", per_call_us(call, args.iters))]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        sdpa()
        rows.append(("torch SDPA flash, synchronized loop", per_call_us(sdpa, args.iters)))

    real_run = abi.Instance.run
    abi.Instance.run = lambda self, params, stream: None  # the launch becomes a no-op
    try:
        rows.append(("host only: fused_attention", per_call_us(call, args.iters, sync=False)))
        rows.append(("host only: validation (ops._validate)",
                     per_call_us(lambda: ops._validate(q, k, v, None), args.iters, sync=False)))
        op = lambda: torch_op.fused_attention_op(q, k, v, True, "top_left", None, False, None)  # noqa: E731
        rows.append(("host only: custom op (dispatch, allocation, selection, params)",
                     per_call_us(op, args.iters, sync=False)))
        rows.append(("host only: params (launch.params)", per_call_us(
            lambda: launch.params(q, k, v, q, None, causal=True, causal_alignment="top_left", scale=None),
            args.iters, sync=False)))
        rows.append(("host only: torch.empty_like(q), for scale",
                     per_call_us(lambda: torch.empty_like(q), args.iters, sync=False)))
    finally:
        abi.Instance.run = real_run

    dev = torch.cuda.get_device_properties(0)
    header = (f"{dev.name}, torch {torch.__version__}, gemmgen {gemmgen.__version__}, {datetime.date.today()}; "
              f"B={b} H={h} N={n} d={d} fp16 causal, instance {name}; median of 5 rounds of {args.iters} calls")
    table = ["| what | us per call |", "|---|---|"] + [f"| {what} | {us:.2f} |" for what, us in rows]
    print(header + "\n\n" + "\n".join(table))
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
