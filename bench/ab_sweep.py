"""A/B on the FlashAttention sweep: one gemmgen instance against one torch SDPA backend, timed in
alternating order over several rounds, so that neither side is always measured in the GPU state
(clocks under the power cap, L2 contents) the other one left behind.

Shapes as bench/fa_sweep.py (batch*seqlen = 16384 tokens, heads*head_dim = 2048). Per shape:
the gemmgen side is the fastest built instance of --family (a first pass times each candidate
once), or the registry's pick without --family; the peer is --peer, or the fastest SDPA backend
of a first pass with --peer best. Then --rounds rounds, in odd rounds gemmgen first, in even
rounds the peer first, each side the median of --reps CUDA-event timings. Printed per shape: both
sides' median TFLOP/s over the rounds, and the median, lowest and highest per-round ratio.
With --all-candidates every built instance of --family joins the rounds (the order rotates by one
each round), the row shows the one with the lowest median, and every candidate's median goes to
stderr, so tiles are compared in the same alternating conditions as the peer.
With --kernels each timed call is queued behind a spin kernel (gemmgen.select.timing, hide_host), so the
events time the kernels alone, not the host path; without it they time what a caller waits for,
which for calls of about 100 us can include part of the host path (bench/NOTES.md, experiment 31).
With --graph each timing is of 20 calls replayed from a CUDA graph back to back (no host path and
no idle gap between calls, so the GPU runs as under steady use), divided by 20; the spin kernel of
--kernels leaves the GPU idle before each call, which moves some kernels by up to 8% against
calls back to back (bench/NOTES.md, experiment 37).
The last lines count the shapes whose median ratio is >= 1.00, and the rounds each side was ahead.

    python bench/ab_sweep.py --family fa2_sm80 --peer FA2 --head-dim 128 --seq-len 1024 2048 4096
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch

import gemmgen
from fa_sweep import BACKENDS, DTYPES, below_line, finish, sdpa, time_ms  # the sweep's (same folder)
from gemmgen.select import calls, registry, timing
from gemmgen.select.shapes import HIDDEN, SEQLENS, TOKENS


GRAPH_REPS = 5  # replays of a 20-call graph per timing with --graph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", help="the gemmgen side: the fastest built instance of this family "
                                     "(default: the registry's pick)")
    ap.add_argument("--all-candidates", action="store_true",
                    help="time every built instance of --family in the rounds, not only the fastest of a first pass")
    ap.add_argument("--peer", default="best", choices=[*BACKENDS, "best"])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--mask", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", action="store_true",
                    help="time the kernels alone: each call queued behind a spin kernel")
    ap.add_argument("--graph", action="store_true",
                    help="time 20 calls replayed back to back from a CUDA graph (per call: the time / 20)")
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    if args.all_candidates and not args.family:
        ap.error("--all-candidates needs --family")

    dev = torch.cuda.get_device_properties(0)
    header = (f"{dev.name}, torch {torch.__version__}, gemmgen {gemmgen.__version__}, {datetime.date.today()}; "
              f"gemmgen side: {'fastest ' + args.family if args.family else 'registry pick'}; peer: {args.peer}; "
              f"{args.rounds} rounds in alternating order, each side the median of "
              + (f"{GRAPH_REPS} CUDA-event timings of 20 calls replayed back to back from a CUDA graph; " if args.graph
                 else f"{args.reps} CUDA-event timings"
                 f"{' of the kernels alone (each call behind a spin kernel)' if args.kernels else ''}; ")
              + "TFLOP/s = 4*B*H*N^2*d/t (halved for causal)")
    rows = ["| dtype | d | causal | N | gemmgen instance | gemmgen | peer | peer TFLOP/s | ratio median "
            "| ratio min | ratio max | rounds ahead |", "|---" * 12 + "|"]
    medians, ahead, total = [], 0, 0

    def timed(fn) -> float:
        if args.graph:
            return timing.median_ms(lambda _i: fn(), 1, warmup=1, reps=GRAPH_REPS, graph=True)
        if args.kernels:
            return timing.median_ms(lambda _i: fn(), 1, warmup=3, reps=args.reps, hide_host=True)
        return time_ms(fn, 3, args.reps)

    print(header, flush=True)
    for dname in args.dtype:
        for d in args.head_dim:
            for mask in args.mask:
                causal = mask == "causal"
                for n in args.seq_len:
                    b, h = TOKENS // n, HIDDEN // d
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPES[dname]) for _ in range(3))
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    ours_fn = lambda name: (lambda: gemmgen.fused_attention(q, k, v, causal=causal,  # noqa: E731
                                                                            instance=name))
                    if args.family:
                        names = [c.name for c in registry.candidates(calls.problem_for(q, k, causal))[0]
                                 if c.entry.family == args.family]
                        if not names:
                            print(f"{dname} d{d} {mask} N={n}: no {args.family} instance built", flush=True)
                            continue
                        if args.all_candidates:
                            contenders = names
                        else:
                            contenders = [min(names, key=lambda name: timed(ours_fn(name)))]
                    else:
                        contenders = [gemmgen.selected_instance(q, k, v, causal=causal)]
                    if args.peer == "best":
                        peers = {}
                        for label, backend in BACKENDS.items():
                            try:
                                peers[label] = timed(sdpa(q, k, v, causal, backend))
                            except RuntimeError:
                                continue
                        peer = min(peers, key=peers.get)
                    else:
                        peer = args.peer
                    sides = {name: ours_fn(name) for name in contenders}
                    sides["peer"] = sdpa(q, k, v, causal, BACKENDS[peer])
                    order = list(sides)
                    times = {side: [] for side in order}
                    for rnd in range(args.rounds):  # each side first in turn
                        for side in order[rnd % len(order):] + order[:rnd % len(order)]:
                            times[side].append(timed(sides[side]))
                    ours = min(contenders, key=lambda name: statistics.median(times[name]))
                    ratios = [p / o for o, p in zip(times[ours], times["peer"])]
                    tf = lambda ms: flops / ms / 1e9  # noqa: E731
                    if args.all_candidates:
                        print("    all: " + ", ".join(f"{name}={tf(statistics.median(times[name])):.0f}"
                                                  for name in sorted(contenders, key=lambda x: statistics.median(times[x]))),
                              file=sys.stderr, flush=True)
                    row = (f"| {dname} | {d} | {'Y' if causal else 'N'} | {n} | {ours} | "
                           f"{tf(statistics.median(times[ours])):.0f} | {peer} | "
                           f"{tf(statistics.median(times['peer'])):.0f} | {statistics.median(ratios):.2f} | "
                           f"{min(ratios):.2f} | {max(ratios):.2f} | {sum(r >= 1.0 for r in ratios)} of {len(ratios)} |")
                    medians.append((statistics.median(ratios), f"{dname} d{d} {mask} N={n}"))
                    ahead += sum(r >= 1.0 for r in ratios)
                    total += len(ratios)
                    rows.append(row)
                    print(row, flush=True)
    at_least = sum(r >= 1.0 for r, _ in medians)
    finish(header, rows, [f"- median ratio >= 1.00 at {at_least} of {len(medians)} shapes; "
                          f"gemmgen ahead in {ahead} of {total} rounds", below_line(medians)], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
