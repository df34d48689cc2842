"""Every built strided GEMM tile on attention shapes, timed as users call them: the data the GEMM
default set and the heuristic's tile constants are chosen from.

    gemmgen generate --arch sm90 --family gemm_sm90 --all --filter '<tiles>'   # the pool to compare
    python bench/gemm_tiles.py [--dtype fp16] [--rounds 3] [--csv bench/results/gemm_tiles_h200.csv]
    python bench/gemm_tiles.py --score bench/results/gemm_tiles_h200.csv [--out FILE.md]
    python bench/gemm_tiles.py --fit bench/results/gemm_tiles_h200.csv

Timing: per shape, each strided candidate (forced by name) and torch.matmul on the same operands,
eager calls queued back to back with one synchronize before and after (the host path included, as
a caller that queues work pays it), enough calls to last --burst-ms; the sides in alternating order
(forward, then reversed) over --rounds rounds, the median per side. Shapes: Q Kᵀ (b_transposed) and
P V at B*H in --bh, M = N in --mn, K in --k, plus the long-K shapes of LONG_K; operands over --max-gb
skipped.

--score reads such a CSV and, per shape, scores the heuristic's pick among the family's DEFAULT
tiles of that layout (gemmgen.select.gemm_select.estimate, as the untuned library picks) against the
fastest tile of the pool and against cuBLAS: the measured time of each, no new timing. Tiles of the
DEFAULT set missing from the CSV are reported, not guessed.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# (B*H, M = N, K) of Q x K^T shapes with a long K; P x V reads the same triples as (B*H, M = K, N).
LONG_K = ((32, 2048, 2048), (8, 1024, 4096), (64, 512, 1024))
DTYPES = ("fp16", "bf16")


def shapes(args) -> list[tuple[str, int, int, int]]:
    """(op, B*H, M = N, K) of the grid, operands within --max-gb."""
    out = []
    for op in args.op:
        grid = [(bh, mn, k) for k in args.k for mn in args.mn for bh in args.bh] + list(LONG_K)
        for bh, mn, k in grid:
            a_elems = bh * mn * k if op == "qk" else bh * mn * mn
            b_elems = bh * mn * k if op == "qk" else bh * mn * k
            c_elems = bh * mn * mn if op == "qk" else bh * mn * k
            if 2 * (a_elems + b_elems + c_elems) <= args.max_gb * 2**30:
                out.append((op, bh, mn, k))
    return out


def operands(op: str, bh: int, mn: int, k: int, dtype):
    """(a, b, c, b as torch.matmul takes it) of one shape on the GPU: Q x K^T is [M, K] x [N = M, K]^T,
    P x V is [M, M] probabilities x [M, K] (C is [M, K])."""
    import torch

    if op == "qk":
        a, b = (torch.randn(bh, 1, mn, k, dtype=dtype, device="cuda") for _ in range(2))
        return a, b, torch.empty(bh, 1, mn, mn, dtype=dtype, device="cuda"), b.transpose(-2, -1)
    a = torch.randn(bh, 1, mn, mn, dtype=dtype, device="cuda")
    b = torch.randn(bh, 1, mn, k, dtype=dtype, device="cuda")
    return a, b, torch.empty(bh, 1, mn, k, dtype=dtype, device="cuda"), b


def measure(args) -> int:
    import torch

    import gemmgen
    from gemmgen.ops import gemm
    from gemmgen.select import gemm_select

    dtype = common.DTYPES[args.dtype]
    method = (f"{args.dtype}; per side the median over {args.rounds} rounds in alternating order of the wall time "
              f"per call of eager calls queued back to back (bursts of >= {args.burst_ms:g} ms)")
    print(common.header(method), flush=True)
    rows = []
    for op, bh, mn, k in shapes(args):
        bt = op == "qk"
        a, b, c, bmat = operands(op, bh, mn, k, dtype)
        n = c.shape[3]
        problem = gemm.strided_problem(a, b, c, b_transposed=bt)
        cands = [cand for cand in gemm_select.candidates(problem)[0] if cand.entry.family == "gemm_sm90"]
        sides = {cand.name: (lambda name=cand.name: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c, instance=name))
                 for cand in cands}
        sides["cuBLAS"] = lambda: torch.matmul(a, bmat, out=c)
        t = common.queued_rounds_us(sides, args.rounds, args.burst_ms)
        flops = 2.0 * bh * mn * n * a.shape[3]
        smem = {cand.name: cand.entry.smem_bytes for cand in cands}
        for name, us in t.items():
            rows.append({"op": op, "bh": bh, "m": mn, "n": n, "k": a.shape[3], "side": name, "us": f"{us:.3f}",
                         "smem": smem.get(name, 0)})
        best = min((us, name) for name, us in t.items() if name != "cuBLAS")
        print(f"{op} BH={bh} M={mn} N={n} K={a.shape[3]}: cuBLAS {flops / t['cuBLAS'] / 1e6:.1f} TFLOP/s, best tile "
              f"{best[1].removeprefix('gemm_sm90_strided_')} {flops / best[0] / 1e6:.1f} ({len(cands)} tiles)", flush=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"written {args.csv}")
    return 0


@dataclasses.dataclass(frozen=True)
class _Entry:
    smem_bytes: int
    gencode: tuple[str, ...] = ("sm_90a",)
    family: str = "gemm_sm90"


@dataclasses.dataclass(frozen=True)
class _Cand:
    """What gemm_select.estimate reads of a candidate, rebuilt from the CSV."""

    name: str
    instance: object
    entry: _Entry


def _read(path: str) -> dict[tuple, dict[str, tuple[float, int]]]:
    """{(op, bh, m, n, k): {side: (us, smem bytes)}} of a measured CSV."""
    by_shape: dict[tuple, dict[str, tuple[float, int]]] = {}
    for r in csv.DictReader(open(path)):
        key = (r["op"], int(r["bh"]), int(r["m"]), int(r["n"]), int(r["k"]))
        by_shape.setdefault(key, {})[r["side"]] = (float(r["us"]), int(r["smem"]))
    return by_shape


def fit(args) -> int:
    from gemmgen.generator.families import gemm_sm90
    from gemmgen.select import gemm_select
    from gemmgen.select.device import synthetic

    by_shape = _read(args.fit)
    device = synthetic((9, 0), args.sms, args.gpu)
    keys = [gemm_sm90.REFERENCE_TILE, *gemm_sm90.STRIDED_DEFAULT_TILES]
    ratios: dict[tuple, dict[str, list[float]]] = {key: {} for key in keys}
    for (op, bh, m, n, k), sides in by_shape.items():
        if n < 256:
            continue
        problem = gemm_select.GemmProblem(dtype=args.dtype, out_dtype=args.dtype, b_transposed=op == "qk",
                                          strategy="strided", device=device, m=m, n=n, k=k, batch_count=bh)
        rate = {}
        for inst in gemm_sm90.SPACE:
            key = gemm_sm90.tile_key(inst)
            if key in ratios and inst.name in sides and inst.strategy.value == "strided" \
                    and inst.dtype.value == args.dtype and not inst.out_fp32 and inst.b_transposed == (op == "qk"):
                us, smem = sides[inst.name]
                rate[key] = (gemm_select.padded_work(_Cand(inst.name, inst, _Entry(smem)), problem) / us, us)
        if gemm_sm90.REFERENCE_TILE not in rate or min(us for _, us in rate.values()) < args.min_us:
            continue
        for key, (r, _) in rate.items():
            ratios[key].setdefault(gemm_sm90.regime(problem), []).append(r / rate[gemm_sm90.REFERENCE_TILE][0])
    label = {gemm_sm90.tile_key(i): i.name.rsplit("_n", 1)[1][2:] for i in gemm_sm90.SPACE if i.dtype.value == args.dtype}
    for key in keys:
        speeds = ", ".join(f'"{reg}": {statistics.median(ratios[key][reg]):.2f}' if ratios[key].get(reg) else f'"{reg}": -'
                           for reg in gemm_sm90.REGIMES)
        print(f"{label[key]}: {{{speeds}}}")
    return 0


def score(args) -> int:
    from gemmgen.generator.families import gemm_sm90
    from gemmgen.select import gemm_select
    from gemmgen.select.device import synthetic

    by_shape = _read(args.score)
    space = {i.name: i for i in gemm_sm90.SPACE}
    device = synthetic((9, 0), args.sms, args.gpu)
    lines = [f"Scored from {args.score}: per shape the heuristic's pick among gemm_sm90.DEFAULT's strided tiles "
             f"of the layout (dtype {args.dtype}), its measured time against the pool's fastest and cuBLAS's "
             f"(ratios > 1: faster than it).", "",
             "| op | BH | M | N | K | pick | pick/best | pick/cuBLAS | best tile | best/cuBLAS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios, best_ratios, missing = [], [], set()
    for (op, bh, m, n, k), sides in by_shape.items():
        layout = "nt" if op == "qk" else "nn"
        defaults = [i for i in gemm_sm90.DEFAULT if i.strategy.value == "strided" and i.dtype.value == args.dtype
                    and not i.out_fp32 and i.b_transposed == (op == "qk")]
        cands = []
        for inst in defaults:
            if inst.name not in sides:
                missing.add(inst.name)
                continue
            cands.append(_Cand(inst.name, inst, _Entry(sides[inst.name][1])))
        if not cands:
            continue
        problem = gemm_select.GemmProblem(dtype=args.dtype, out_dtype=args.dtype, b_transposed=op == "qk",
                                          strategy="strided", device=device, m=m, n=n, k=k, batch_count=bh)
        pick = min(cands, key=lambda c: (gemm_select.estimate(c, problem), c.name))
        tiles = {s: v[0] for s, v in sides.items() if s != "cuBLAS" and s in space}
        best = min(tiles, key=tiles.get)
        cublas = sides["cuBLAS"][0]
        t = sides[pick.name][0]
        if m >= args.min_mn:
            ratios.append(cublas / t)
            best_ratios.append(tiles[best] / t)
        short = lambda s: s.removeprefix(f"gemm_sm90_strided_{args.dtype}_{args.dtype}_{layout}_")  # noqa: E731
        lines.append(f"| {op} | {bh} | {m} | {n} | {k} | {short(pick.name)} | {tiles[best] / t:.2f} | {cublas / t:.2f} "
                     f"| {short(best)} | {cublas / tiles[best]:.2f} |")
    if missing:
        lines += ["", "DEFAULT tiles not in the CSV: " + ", ".join(sorted(missing))]
    if ratios:
        lines += ["", f"At M = N >= {args.min_mn} ({len(ratios)} shapes): pick / cuBLAS median "
                  f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}; pick / pool's best median "
                  f"{statistics.median(best_ratios):.3f}, min {min(best_ratios):.3f}"]
    common.publish("\n".join(lines) + "\n", args.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp16", choices=DTYPES)
    ap.add_argument("--op", nargs="+", choices=["qk", "pv"], default=["qk", "pv"])
    ap.add_argument("--bh", nargs="+", type=int, default=[8, 64, 256, 512, 4096])
    ap.add_argument("--mn", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--k", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--max-gb", type=float, default=8.0, help="skip shapes whose operands exceed this")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst-ms", type=float, default=20.0, help="each timed burst lasts at least this")
    ap.add_argument("--csv", default="bench/results/gemm_tiles_h200.csv")
    ap.add_argument("--score", metavar="CSV", help="score the DEFAULT set's picks from a measured CSV (no GPU)")
    ap.add_argument("--fit", metavar="CSV", help="print the default tiles' regime speeds from a measured CSV (no GPU)")
    ap.add_argument("--min-us", type=float, default=25.0, help="--fit: the shortest call whose shape counts")
    ap.add_argument("--min-mn", type=int, default=512, help="--score: the summary's smallest M = N")
    ap.add_argument("--gpu", default="NVIDIA H200", help="--score: the GPU the CSV was measured on")
    ap.add_argument("--sms", type=int, default=132, help="--score: its SM count")
    ap.add_argument("--out", help="--score: also write the table to this markdown file")
    args = ap.parse_args()
    return fit(args) if args.fit else score(args) if args.score else measure(args)


if __name__ == "__main__":
    raise SystemExit(main())
