"""What the attention benchmark scripts share: the header line naming the GPU, the versions and
the date, and the FlashAttention sweep's shapes (16384 tokens, hidden 2048; bench scripts import
this module from their own folder)."""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

import gemmgen
from gemmgen.select.shapes import HIDDEN, SEQLENS, TOKENS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def header(method: str) -> str:
    """"<GPU>, <SMs> SMs, torch <v>, gemmgen <v>, <date>; <method>"."""
    dev = torch.cuda.get_device_properties(0)
    return (f"{dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, gemmgen {gemmgen.__version__}, "
            f"{datetime.date.today()}; {method}")


def fa_shapes(dtypes: list[str], head_dims: list[int], seq_lens: list[int]) -> Iterator[tuple]:
    """(dtype name, torch dtype, d, causal, N, B, H, forward FLOPs) for each sweep shape, in table
    order: B * N = TOKENS, H * d = HIDDEN, forward FLOPs 4*B*H*N^2*d, halved for causal."""
    for dname in dtypes:
        for d in head_dims:
            for causal in (False, True):
                for n in seq_lens:
                    b, h = TOKENS // n, HIDDEN // d
                    yield dname, DTYPES[dname], d, causal, n, b, h, 4 * b * h * n * n * d / (2 if causal else 1)


def add_sweep_args(ap: argparse.ArgumentParser, reps: int) -> None:
    """The FlashAttention sweep's options: --dtype, --head-dim, --seq-len (fa_shapes' arguments),
    --reps CUDA-event timings per round, --rounds in alternating order, --out FILE.md."""
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--rounds", type=int, default=3, help="rounds in alternating order per shape")
    ap.add_argument("--out", help="also write the tables to this markdown file")


def rounds_method(args: argparse.Namespace) -> str:
    """How add_sweep_args' --rounds and --reps time each side, for the table's header."""
    return (f"each side the median over {args.rounds} rounds in alternating order of the median of {args.reps} "
            f"CUDA-event timings")


def median_wall_s(fn: Callable[[], object], reps: int) -> float:
    """The median over `reps` calls of `fn`'s wall time in seconds, the GPU synchronized before and
    after each call (so its work is inside the time)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def queued_us(fn: Callable[[], object], iters: int) -> float:
    """Wall time per call of `iters` back-to-back eager calls, synchronized only before and after
    (microseconds): what a caller that queues work pays per call, host path included; the host is
    the bottleneck where this exceeds the kernel's time."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def queued_rounds_us(sides: dict[str, Callable[[], object]], rounds: int, burst_ms: float) -> dict[str, float]:
    """Each side's median over `rounds` rounds of queued_us, the sides in alternating order (forward,
    then reversed), each burst of enough calls to last about `burst_ms` (5 to 2000 calls)."""
    calls = {}
    for name, fn in sides.items():
        fn()
        calls[name] = max(5, min(2000, int(burst_ms * 1e3 / max(queued_us(fn, 3), 1.0))))
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(queued_us(sides[name], calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def backward_alone(attend: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    """The backward alone of attend()'s output, as the bench scripts time it with --backward:
    torch.autograd.grad(o, inputs, do, retain_graph=True) with one random dO (an input the side does
    not use, such as K before its expansion, gets no gradient)."""
    o = attend()
    do = torch.randn_like(o)
    return lambda: torch.autograd.grad(o, inputs, do, retain_graph=True, allow_unused=True)


def graph_timer(fn: Callable[[], object], calls: int, reps: int = 5, warm: int = 3) -> Callable[[], float]:
    """A timer of `fn` captured `calls` times in one CUDA graph (after `warm` calls on a side
    stream): each call of the timer replays the graph `reps` times and returns the median GPU
    microseconds per call (no host work inside)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()

    def time_once() -> float:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)
    return time_once


def publish(text: str, out: str | None) -> None:
    """Print a result table and, with --out, write it to that file."""
    print("\n" + text)
    if out:
        Path(out).write_text(text)
