"""The decode family's split count: the registry's rule against forced counts and a baseline rule.

For each key-value-cache shape (B, H = 32, Hkv, Nq, Nk, d; every sequence holds all Nk keys) the
call gemmgen.fused_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens) is timed with its
num_splits given by:

    rule        gemmgen.select.heuristic.num_splits, the registry's rule
    wave-fill   the rule before bench/NOTES.md experiment 94, kept here as the baseline: the count
                whose waves at the instance's residency are fullest, the fewest within 85% of the
                best, at most 128 and at least eight key tiles per split
    contiguous-rule
                with --page-size: the rule for a contiguous cache, on the paged one
    --counts    with --sweep, each of these counts forced

--page-size P reads the caches through a block table of P-key pages in a random order (the same
keys and values), as bench/decode.py's paged sides do.

Timing: one CUDA graph per side holding --calls calls, replayed; CUDA events around a replay, the
median of 5 replays per round, the sides in alternating order over --rounds rounds, each side the
median of its rounds. The graph removes the host path, so this shows what the split count changes:
the kernels. GB/s counts K and V read once. Every side's O is compared with the rule's (max abs diff).

    python bench/decode_splits.py [--quick] [--sweep] [--rounds 3] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_timer, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.ops import torch_op  # noqa: E402
from gemmgen.select import heuristic  # noqa: E402

RULE = heuristic.num_splits


def wave_fill(row_ctas: int, key_tiles: int, ctas_per_sm_: int, sm_count: int, **_) -> int:
    """The baseline: the split rule before experiment 94 (see the module doc)."""
    slots = max(1, sm_count * ctas_per_sm_)
    limit = min(128, key_tiles // 8)
    if row_ctas <= 0 or limit <= 1 or row_ctas >= slots:
        return 1

    def fill(s: int) -> float:
        ctas = row_ctas * s
        return ctas / (-(-ctas // slots) * slots)

    best = max(fill(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if fill(s) >= 0.85 * best)


def with_rule(rule: Callable[..., int], seen: dict) -> Callable[..., int]:
    def spy(*args, **kwargs):
        seen["splits"] = rule(*args, **kwargs)
        return seen["splits"]
    return spy


def measure(b: int, hkv: int, nq: int, nk: int, d: int, args) -> tuple[dict, dict, dict]:
    """(us per call, splits, max abs diff against the rule) per side of one shape."""
    q = torch.randn(b, nq, 32, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    table = None
    if args.page_size:
        pages = b * (nk // args.page_size)
        order = torch.randperm(pages, device="cuda")  # table[b, j] = order[b * pages per sequence + j]
        paged = [torch.empty(pages, args.page_size, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for dst, src in zip(paged, (k_cache, v_cache)):
            dst.index_copy_(0, order, src.view(pages, args.page_size, hkv, d))
        k_cache, v_cache = paged
        table = order.to(torch.int32).view(b, nk // args.page_size)

    def call():
        return gemmgen.fused_attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table)

    rules = {"rule": RULE, "wave-fill": wave_fill}
    if args.page_size:
        rules["contiguous-rule"] = lambda *a, **_: RULE(*a, paged=False)
    if args.sweep:
        rules.update({str(c): (lambda *a, c=c, **_: c) for c in args.counts})
    timers, splits, diffs, ref = {}, {}, {}, None
    try:
        for name, rule in rules.items():
            seen: dict = {}
            heuristic.num_splits = with_rule(rule, seen)
            torch_op.clear_cache()
            out = call().float()
            ref = out if ref is None else ref
            diffs[name] = (out - ref).abs().max().item()
            splits[name] = seen["splits"]
            timers[name] = graph_timer(call, args.calls)
    finally:
        heuristic.num_splits = RULE
        torch_op.clear_cache()
    times: dict[str, list[float]] = {n: [] for n in timers}
    for r in range(args.rounds):
        for name in (list(timers) if r % 2 == 0 else list(reversed(timers))):
            times[name].append(timers[name]())
    return {n: statistics.median(t) for n, t in times.items()}, splits, diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B 1 and 8, Nk 1024 and 8192, Hkv 8, d 128, Nq 1")
    ap.add_argument("--sweep", action="store_true", help="also time each of --counts forced")
    ap.add_argument("--counts", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="calls per graph")
    ap.add_argument("--max-cache-gib", type=float, default=8.0)
    ap.add_argument("--page-size", type=int, default=0, help="read the caches through pages of this many keys")
    ap.add_argument("--out", help="markdown file for the table")
    args = ap.parse_args()
    grid = ((1,), (128,), (8,), (1, 8), (1024, 8192)) if args.quick else \
        ((1, 4), (64, 128), (8, 32), (1, 8, 32, 128), (1024, 8192, 32768, 131072))
    sides = ["rule", "wave-fill"] + (["contiguous-rule"] if args.page_size else []) + \
        ([str(c) for c in args.counts] if args.sweep else [])
    cache = f"paged caches ({args.page_size}-key pages, random order)" if args.page_size else "contiguous caches"
    lines = [header(f"bf16, H = 32, {cache}; us per call from CUDA-graph replays of {args.calls} calls (no host path), "
                    f"median of {args.rounds} alternating rounds; splits in parentheses; GB/s = K + V read "
                    f"once; command: python bench/decode_splits.py {' '.join(sys.argv[1:])}"), "",
             "| shape | " + " | ".join(f"{s} us" for s in sides) + " | rule GB/s | " +
             " | ".join(f"{s} / rule time" for s in sides[1:3] if not s.isdigit()) + " | max abs diff |",
             "|---" * (len(sides) + 3 + sum(not s.isdigit() for s in sides[1:3])) + "|"]
    baselines = [s for s in sides[1:3] if not s.isdigit()]
    ratios: dict[str, list[float]] = {s: [] for s in baselines}
    for nq, d, hkv, b, nk in itertools.product(*grid):
        cache = 2 * b * nk * hkv * d * 2
        if cache > args.max_cache_gib * 2**30 or (args.page_size and nk % args.page_size):
            continue
        us, splits, diffs = measure(b, hkv, nq, nk, d, args)
        for s in baselines:
            ratios[s].append(us[s] / us["rule"])
        cells = [f"{us[s]:.1f} ({splits[s]})" if s in us else "-" for s in sides]
        line = (f"| B{b} Hkv{hkv} Nq{nq} Nk{nk} d{d} | " + " | ".join(cells) + f" | {cache / us['rule'] / 1e3:.0f} | " +
                " | ".join(f"{ratios[s][-1]:.2f}" for s in baselines) + f" | {max(diffs.values()):.1e} |")
        lines.append(line)
        print(line, flush=True)
    lines.append("")
    for s in baselines:
        r = sorted(ratios[s])
        lines.append(f"- {s} time / rule time over {len(r)} shapes: min {r[0]:.2f}, median {statistics.median(r):.2f}, "
                     f"max {r[-1]:.2f}; shapes where the rule is slower by more than 2%: {sum(x < 0.98 for x in r)}")
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
