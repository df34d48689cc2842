"""One attention shape of the FlashAttention sweep, every built fmha_sm90 candidate timed three ways,
to separate the kernels' speed from the way they are timed (bench/NOTES.md, experiment 37):

- tuner: gemmgen.select.tuner.measure, what `gemmgen profile` records (one pass, then the candidates within
  CONTEND_MARGIN of the fastest re-timed in rotating rounds), run --rounds times;
- eager: fused_attention with CUDA events around each call, calls back to back, in alternating rounds;
- kernels: the same with each call queued behind a spin kernel (the kernels alone), in alternating
  rounds: how bench/ab_sweep.py --kernels and bench/fa_sweep.py --kernels time them;
- graph: 20 calls replayed from a CUDA graph, back to back (no host path, no idle gaps), in
  alternating rounds.
With --peer an SDPA backend joins the eager, kernels and graph rounds.

    python bench/fmha_timing_modes.py --dtype fp16 --head-dim 64 --causal --seq-len 4096
"""
from __future__ import annotations

import argparse
import statistics

import torch

import gemmgen
from fa_sweep import BACKENDS, DTYPES, sdpa  # the sweep's peers and dtypes (same folder)
from gemmgen.select import registry, timing, tuner
from gemmgen.select.shapes import HIDDEN, TOKENS, Shape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peer", choices=list(BACKENDS), help="an SDPA backend timed beside them")
    args = ap.parse_args()

    n, d = args.seq_len, args.head_dim
    b, h = TOKENS // n, HIDDEN // d
    shape = Shape(b, h, n, n, d, causal=args.causal, dtype=args.dtype)
    problem = tuner.problem_of(shape, 0)
    cands = [c for c in registry.candidates(problem)[0] if c.entry.family == "fmha_sm90"]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPES[args.dtype]) for _ in range(3))
    runs = {c.name: (lambda name=c.name: gemmgen.fused_attention(q, k, v, causal=args.causal, instance=name))
            for c in cands}
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    tf = lambda ms: flops / ms / 1e9  # noqa: E731

    tuned = [{m.name: m.ms for m in tuner.measure(cands, shape, index=0, reps=args.reps)} for _ in range(args.rounds)]
    if args.peer:
        runs[args.peer] = sdpa(q, k, v, args.causal, BACKENDS[args.peer])
    graph = {name: (lambda f=f: timing.median_ms(lambda _i: f(), 1, warmup=1, reps=5, graph=True))
             for name, f in runs.items()}
    got = {"tuner": {name: tf(statistics.median(t[name] for t in tuned)) if name in tuned[0] else float("nan")
                     for name in runs},
           "eager": {name: tf(ms) for name, ms in timing.rounds_ms(runs, rounds=args.rounds, reps=args.reps).items()},
           "kernels": {name: tf(ms) for name, ms in
                       timing.rounds_ms(runs, rounds=args.rounds, reps=args.reps, hide_host=True).items()},
           "graph": {name: tf(statistics.median(t)) for name, t in timing.alternating_rounds(graph, args.rounds).items()}}
    print(f"{shape.describe()}: TFLOP/s, the median of {args.rounds} tuner runs or alternating rounds")
    print("| instance | " + " | ".join(got) + " |")
    print("|---" * (len(got) + 1) + "|")
    for name in sorted(runs, key=lambda x: -got["kernels"][x]):
        print(f"| {name} | " + " | ".join(f"{got[mode][name]:.0f}" for mode in got) + " |", flush=True)
    for i, t in enumerate(tuned):
        print(f"    tuner run {i}: " + ", ".join(f"{name}={tf(ms):.0f}" for name, ms in t.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
