"""The value of selection on the FlashAttention sweep: per shape, the selected instance's time against
the best candidate (oracle), the median candidate and the single instance that is best overall.

    gemmgen generate --arch sm80 --all --filter 'd(64|128)_'
    python bench/selection_value.py [--dtype bf16 fp16] [--head-dim 64 128] [--reps 30]
                                    [--out bench/results/selection_value_h200.md]

For each shape: autotune (its own timing run, stored in a private tuning database) and its pick;
the heuristic's pick (empty database); then an independent measurement of every candidate, the
"truth" the picks are scored against. "best single" is, per dtype, head dim and mask, the one
instance with the best geometric mean of time ratios over that key's shapes. Ratios are oracle time
/ pick time (1.00 = the pick is the fastest). Targets: tuned >= 0.97 at every shape, heuristic >= 0.90
on average.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

import gemmgen
from gemmgen.select import tuner, registry, selection, shapes, tuning_db


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=list(shapes.DTYPES), choices=shapes.DTYPES)
    ap.add_argument("--head-dim", nargs="+", type=int, default=list(shapes.SWEEP_HEAD_DIMS))
    ap.add_argument("--seq-len", nargs="+", type=int, default=list(shapes.SEQLENS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    os.environ["GEMMGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemmgen-selection-value-")  # private database

    index = torch.cuda.current_device()
    sweep = shapes.fa_sweep(tuple(args.dtype), tuple(args.head_dim), tuple(args.seq_len))
    rows = []
    for n, shape in enumerate(sweep, 1):
        print(f"[{n}/{len(sweep)}] {shape.describe()}", file=sys.stderr, flush=True)
        problem = tuner.problem_of(shape, index)
        cands = registry.candidates(problem)[0]
        heuristic = selection.decide(problem, db=tuning_db.TuningDB(device=problem.device.fingerprint())).winner.name
        tuner.tune_shape(shape, index=index, reps=args.reps)
        tuned = selection.decide(problem)
        truth = {m.name: m.ms for m in tuner.measure(cands, shape, index=index, reps=args.reps) if m.ok}
        rows.append((shape, truth, heuristic, tuned.winner.name, tuned.source))

    by_key = defaultdict(list)
    for shape, truth, *_ in rows:
        by_key[(shape.dtype, shape.head_dim, shape.causal)].append(truth)
    single = {}
    for key, truths in by_key.items():
        names = set.intersection(*(set(t) for t in truths))
        single[key] = max(names, key=lambda nm: sum(math.log(min(t.values()) / t[nm]) for t in truths))

    dev = torch.cuda.get_device_properties(index)
    header = (f"{dev.name}, torch {torch.__version__}, gemmgen {gemmgen.__version__}, {datetime.date.today()}; "
              f"median of {args.reps} CUDA-event timings per candidate; ratio = oracle time / pick time")
    table = ["| dtype | d | causal | N | candidates | oracle | TFLOP/s | heuristic pick | heuristic | tuned pick "
             "| tuned | median | best single |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = defaultdict(list)
    for shape, truth, heuristic, tuned, source in rows:
        best = min(truth, key=truth.get)
        oracle = truth[best]
        r = {"heuristic": oracle / truth.get(heuristic, math.inf), "tuned": oracle / truth.get(tuned, math.inf),
             "median": oracle / statistics.median(truth.values()),
             "single": oracle / truth.get(single[(shape.dtype, shape.head_dim, shape.causal)], math.inf)}
        for k, x in r.items():
            ratios[k].append(x)
        tile = lambda nm: nm.split("_")[-1]  # noqa: E731
        table.append(f"| {shape.dtype} | {shape.head_dim} | {'Y' if shape.causal else 'N'} | {shape.seqlen_q} | "
                     f"{len(truth)} | {tile(best)} | {shape.flops / oracle / 1e9:.0f} | {tile(heuristic)} | "
                     f"{r['heuristic']:.3f} | {tile(tuned)}{'' if source == 'tuned' else f' ({source})'} | "
                     f"{r['tuned']:.3f} | {r['median']:.3f} | {r['single']:.3f} |")
    summary = ["", "| | tuned | heuristic | median | best single |", "|---|---|---|---|---|",
               "| mean | " + " | ".join(f"{statistics.mean(ratios[k]):.3f}" for k in ("tuned", "heuristic", "median", "single")) + " |",
               "| min | " + " | ".join(f"{min(ratios[k]):.3f}" for k in ("tuned", "heuristic", "median", "single")) + " |",
               "", "best single instance per key: " + ", ".join(
                   f"{dt} d{d}{' causal' if c else ''}: {nm}" for (dt, d, c), nm in sorted(single.items()))]
    text = header + "\n\n" + "\n".join(table + summary)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    met = min(ratios["tuned"]) >= 0.97 and statistics.mean(ratios["heuristic"]) >= 0.90
    print(f"targets (tuned >= 0.97 everywhere, heuristic >= 0.90 on average): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
