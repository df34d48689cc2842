"""Batched GEMM on attention shapes as users get it: gemmgen's strided and pointer-array strategies
against torch.matmul (cuBLAS) on the same batched shapes, the build untuned unless --tune.

Shapes: B*H in {8, 64, 256, 512, 4096}, M = N in {64, 256, 512, 1024, 2048, 4096}, K in {64, 128},
plus the long-K shapes of gemm_tiles.LONG_K, Q x K^T (b_transposed) and P x V, shapes whose
operands exceed --max-gb skipped. The verdict columns time eager calls queued back to back with
one synchronize before and after (the host path included: what a caller that queues work pays
per call), the sides in alternating order (forward, then reversed) over --rounds rounds, each
burst lasting --burst-ms, the median per side (common.queued_rounds_us).
Extra columns:
- launch overhead: the host wall time of one synchronized call on tiny shapes, and per call when
  queued (the host path's cost per launch);
- kernels alone: each call timed with CUDA events behind a spin kernel (timing.rounds_ms with
  hide_host), strided and cuBLAS;
- with --device, the sustained and steady states the tuning times candidates in (timing.sustained_ms
  and timing.steady_ms, bench/NOTES.md, experiments 47 to 49);
- with --tune, every strided candidate is first timed and recorded (as `gemmgen profile-gemm
  --record`), so the strided column is the tuned pick instead of the heuristic's.
The pointer-array strategy is timed with its device arrays built once (gemm.PointerArrays).
Bar (issue: GEMM defaults): strided >= 0.95x cuBLAS median and >= 0.9x at every shape with
M = N >= 512, queued, untuned.

    python bench/batched_gemm.py [--dtype fp16] [--op qk pv] [--tune] [--device] [--kernels]
                                 [--out bench/results/batched_gemm_default_h200.md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from gemm_tiles import LONG_K, operands  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.ops import gemm  # noqa: E402
from gemmgen.select import gemm_select, measure, selection, timing  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Seconds of load before each shape's sustained timings: the shapes run back to back, so the GPU
# arrives warm from the one before; half a second settles the step from a small shape to a large one.
SETTLE_S = 0.5


def wall_us(fn, reps: int = 200) -> float:
    """Median microseconds of fn() followed by a synchronize (host overhead included)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn runs (torch.profiler), in order."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    ap.add_argument("--bh", nargs="+", type=int, default=[8, 64, 256, 512, 4096])
    ap.add_argument("--mn", nargs="+", type=int, default=[64, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--k", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--op", nargs="+", choices=["qk", "pv"], default=["qk", "pv"],
                    help="Q x K^T (b_transposed) and/or P x V")
    ap.add_argument("--max-gb", type=float, default=8.0, help="skip shapes whose operands exceed this")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the queued timings")
    ap.add_argument("--burst-ms", type=float, default=20.0, help="each queued burst lasts at least this")
    ap.add_argument("--reps", type=int, default=20, help="kernels alone: calls per side and round, timed one by one")
    ap.add_argument("--out", default="bench/results/batched_gemm_default_h200.md")
    ap.add_argument("--device", action="store_true",
                    help="also time strided and cuBLAS in the sustained and steady states (host path hidden)")
    ap.add_argument("--kernels", action="store_true",
                    help="list the kernels each side runs on the shapes below 0.9x (torch.profiler), "
                         "in <out>_kernels.txt (the .md dropped)")
    ap.add_argument("--steady-s", type=float, default=1.5,
                    help="seconds of each side's turns alone under load at M, N >= 512 (with --device)")
    ap.add_argument("--tune-reps", type=int, default=30,
                    help="timed calls per candidate when tuning (one alternating round per 10; "
                         "bursts of >= 40 ms where calls are >= 50 us)")
    ap.add_argument("--tune", action="store_true",
                    help="first time every strided candidate on each shape and record it in the tuning "
                         "database (as `gemmgen profile-gemm --record`), so the strided column is the tuned pick")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    header = common.header(
        f"{args.dtype}; queued: per side the median over {args.rounds} rounds in alternating order of the wall time "
        f"per call of eager calls queued back to back (bursts of >= {args.burst_ms:g} ms, host path included); "
        f"kernels alone: the median of {args.rounds} alternating rounds of the median of {args.reps} CUDA-event "
        f"timings behind a spin kernel; TFLOP/s = 2*BH*M*N*K/t; strided: "
        + ("the tuned pick (--tune)" if args.tune else "the registry's pick (the heuristic's where nothing is tuned)"))
    print(header, flush=True)

    # Launch overhead on tiny shapes: synchronized, and queued in alternating rounds.
    lines = [header, "", "Launch overhead, tiny calls (us per call; queued: back to back, host path included):", "",
             "| call | strided, synchronized | cuBLAS, synchronized | strided, queued | cuBLAS, queued | "
             "queued ratio (cuBLAS / strided) | ptr-array prepared, synchronized | ptr-array per call, synchronized |",
             "|---|---|---|---|---|---|---|---|"]
    overhead = []
    for op, bh, mn, k in (("qk", 8, 64, 64), ("qk", 8, 512, 64), ("pv", 8, 512, 64)):
        a, b, c, bmat = operands(op, bh, mn, k, dtype)
        bt = op == "qk"
        ours = lambda a=a, b=b, c=c, bt=bt: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c)  # noqa: E731
        theirs = lambda a=a, bmat=bmat, c=c: torch.matmul(a, bmat, out=c)  # noqa: E731
        al, bl, cl = list(a[:, 0]), list(b[:, 0]), list(c[:, 0])
        arrays = gemm.PointerArrays(al, bl, cl, b_transposed=bt)
        q = common.queued_rounds_us({"strided": ours, "cuBLAS": theirs}, args.rounds, args.burst_ms)
        row = (f"{op} BH={bh} M=N={mn} K={k}", wall_us(ours), wall_us(theirs), q["strided"], q["cuBLAS"],
               q["cuBLAS"] / q["strided"], wall_us(arrays.run),
               wall_us(lambda al=al, bl=bl, cl=cl, bt=bt: gemmgen.batched_gemm_ptrs(al, bl, b_transposed=bt, out_list=cl)))
        overhead.append(row)
        lines.append(f"| {row[0]} | " + " | ".join(f"{x:.1f}" if i != 4 else f"{x:.2f}" for i, x in enumerate(row[1:]))
                     + " |")
        print(lines[-1], flush=True)
    device_cols = (" strided sustained | cuBLAS sustained | sustained ratio | strided steady | cuBLAS steady "
                   "| steady ratio |") if args.device else ""
    lines += ["", "| op | BH | M=N | K | strided | ptr-array | cuBLAS | strided/cuBLAS | ptr/cuBLAS | strided kernel "
              "| cuBLAS kernel | kernel ratio |" + device_cols + " strided instance |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (7 if args.device else 1)]
    short, short_kernel, short_device, short_steady, kernel_lines = [], [], [], [], []
    for op in args.op:
        bt = op == "qk"
        opname = "QK^T" if bt else "PV"
        grid = [(bh, mn, k) for k in args.k for mn in args.mn for bh in args.bh] + list(LONG_K)
        for bh, mn, k in grid:
            if 2 * bh * (2 * mn * k + mn * mn) > args.max_gb * 2**30:
                continue
            a, b, c, bmat = operands(op, bh, mn, k, dtype)
            n = c.shape[3]
            flops = 2.0 * bh * mn * n * a.shape[3]
            if args.tune:
                problem = gemm.strided_problem(a, b, c, b_transposed=bt)
                cands = gemm_select.candidates(problem)[0]
                workload = measure.CallWorkload(
                    f"{bh}x1x{mn}x{n}x{a.shape[3]}", flops,
                    lambda name: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c, instance=name))
                records = measure.measure(cands, workload, measure.sustained_policy(
                    args.tune_reps, settle_s=SETTLE_S)).records
                measure.record(problem, records)
            arrays = gemm.PointerArrays(list(a.flatten(0, 1)), list(b.flatten(0, 1)), list(c.flatten(0, 1)),
                                        b_transposed=bt)
            sides = {"strided": lambda: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c),
                     "ptr": arrays.run, "cuBLAS": lambda: torch.matmul(a, bmat, out=c)}
            t = common.queued_rounds_us(sides, args.rounds, args.burst_ms)
            t_s, t_p, t_c = t["strided"], t["ptr"], t["cuBLAS"]
            pair = {"strided": sides["strided"], "cuBLAS": sides["cuBLAS"]}  # the kernel and load columns
            kt = timing.rounds_ms(pair, rounds=args.rounds, reps=args.reps, hide_host=True)
            kernel_ratio = kt["cuBLAS"] / kt["strided"]
            tf_us = lambda us: flops / us / 1e6  # noqa: E731
            tf_ms = lambda ms: flops / ms / 1e9  # noqa: E731
            row = (f"| {opname} | {bh} | {mn} | {k} | {tf_us(t_s):.1f} | {tf_us(t_p):.1f} | {tf_us(t_c):.1f} | "
                   f"{t_c / t_s:.2f} | {t_c / t_p:.2f} | {tf_ms(kt['strided']):.1f} | {tf_ms(kt['cuBLAS']):.1f} | "
                   f"{kernel_ratio:.2f} |")
            device_ratio = None
            if args.device:
                d = timing.sustained_ms(pair, rounds=5, settle_s=SETTLE_S, min_burst_ms=measure.TUNE_MIN_BURST_MS)
                device_ratio = d["cuBLAS"] / d["strided"]
                row += f" {tf_ms(d['strided']):.1f} | {tf_ms(d['cuBLAS']):.1f} | {device_ratio:.2f} |"
                if mn >= 512:
                    short_device.append(device_ratio)
                    st = timing.steady_ms(pair, seconds=args.steady_s, window_s=args.steady_s / 2,
                                          min_burst_ms=measure.TUNE_MIN_BURST_MS)
                    short_steady.append((opname, bh, mn, k, st["cuBLAS"] / st["strided"]))
                    row += f" {tf_ms(st['strided']):.1f} | {tf_ms(st['cuBLAS']):.1f} | {short_steady[-1][4]:.2f} |"
                else:
                    row += " - | - | - |"
            pick = selection.select(gemm.strided_problem(a, b, c, b_transposed=bt)).name
            row += f" {pick.removeprefix('gemm_')} |"
            lines.append(row)
            print(row, flush=True)
            if mn >= 512:
                short.append((opname, bh, mn, k, t_c / t_s))
                short_kernel.append((opname, bh, mn, k, kernel_ratio))
                if args.kernels and t_c / t_s < 0.9:
                    ours = kernel_names(lambda: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c))
                    kernel_lines += [f"{opname} BH={bh} M=N={mn} K={k}: strided/cuBLAS {t_c / t_s:.2f}, "
                                     f"kernels {kernel_ratio:.2f}", f"  gemmgen: {pick}, {len(ours)} kernel(s)",
                                     "  cuBLAS: " + "; ".join(kernel_names(lambda: torch.matmul(a, bmat, out=c)))]
    summary = []
    for label, rows in (("queued, host path included (the verdict)", short), ("kernels alone", short_kernel),
                        ("each side alone under sustained load", short_steady)):
        if rows:
            ratios = [r[4] for r in rows]
            worst = min(rows, key=lambda r: r[4])
            summary.append(f"strided / cuBLAS at M=N>=512, {label}: median {statistics.median(ratios):.3f}, min "
                           f"{min(ratios):.3f} ({worst[0]} BH={worst[1]} M=N={worst[2]} K={worst[3]}), below 0.9: "
                           f"{sum(r < 0.9 for r in ratios)} of {len(ratios)}")
    if short_device:
        summary.append(f"sustained, in rotation with cuBLAS, at M=N>=512: median {statistics.median(short_device):.2f}, "
                       f"min {min(short_device):.3f}")
    for row in overhead:
        summary.append(f"tiny call {row[0]}: strided {row[3]:.1f} us queued, cuBLAS {row[4]:.1f} "
                       f"(strided / cuBLAS time {row[3] / row[4]:.2f})")
    if short:
        ratios = [r[4] for r in short]
        met = statistics.median(ratios) >= 0.95 and min(ratios) >= 0.9
        summary.append(f"bar (queued, >= 0.95x cuBLAS median and >= 0.9x at every M=N>=512 shape): "
                       f"{'met' if met else 'NOT met'}")
    lines += [""] + summary
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    if kernel_lines:
        with open(args.out.removesuffix(".md") + "_kernels.txt", "w") as f:
            f.write("\n".join(kernel_lines) + "\n")
    print(f"\nwritten to {args.out}\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
