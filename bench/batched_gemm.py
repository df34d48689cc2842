"""Batched GEMM on attention shapes: gemmgen's strided and pointer-array strategies against
torch.matmul (cuBLAS) on the same batched shapes.

Shapes: B*H in {8, 64, 512, 4096} (B = 1 .. 32 batches of up to 128 heads), M = N in {64, 256,
512, 1024, 2048, 4096}, K in {64, 128}, Q x K^T (b_transposed) and P x V, shapes whose operands
exceed --max-gb skipped. Two numbers per strategy:
- launch overhead: the median wall time of one call on the smallest shape, host side included
  (CUDA events around a call, synchronized: what a Python caller pays per call), and the host
  time per call when calls are queued without synchronizing;
- throughput: TFLOP/s = 2*BH*M*N*K / t, each call timed on its own with CUDA events, the sides in
  alternating rounds (timing.rounds_ms: per round the median of --reps calls, then the median of
  the rounds). Twice: with the host path (events around each eager call, so a kernel shorter than
  the host path is timed with it: what a caller waits for) and of the kernels alone (each call
  queued behind a spin kernel), strided and cuBLAS; with --device also under sustained load, as
  the tuning times candidates (timing.sustained_ms: half a second of load, then five rounds in
  alternating order, each a burst of at least 10 calls and, for calls of 50 us or more, 40 ms,
  queued behind a spin kernel so that the events see the kernels alone), and at M, N >= 512 each
  side alone in its steady state under load (timing.steady_ms: turns of --steady-s seconds of
  such bursts in the order strided, cuBLAS, cuBLAS, strided; per turn the median over its last
  half). In the rotation each burst starts at the clock the other side left, so a side's figure
  there moves with what it is timed beside (bench/NOTES.md, experiments 47 and 48); alone, it
  does not. Calls under 50 us keep bursts of 10, which do not bring the GPU to its power cap:
  for them both columns time the kernels back to back.
The pointer-array strategy is timed with its device arrays built once (gemm.PointerArrays) and,
for the overhead row, also with the arrays built per call (batched_gemm_ptrs). Bar: strided
>= 0.9x cuBLAS's throughput at M, N >= 512, the kernels timed per call and, with --device, each
side alone under sustained load (the host path's share is the launch overhead above, measured on
its own).

    python bench/batched_gemm.py [--dtype fp16] [--op qk pv] [--tune] [--device] [--kernels]
                                 [--out bench/results/batched_gemm_h200.md]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

import gemmgen
from gemmgen.ops import gemm
from gemmgen.select import gemm_select, measure, selection, timing

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


def queued_us(fn, calls: int = 2000) -> float:
    """Host microseconds per call when calls are queued back to back without a synchronize: on a
    tiny shape the GPU keeps up, so this is the host path's cost per launch."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


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
    ap.add_argument("--bh", nargs="+", type=int, default=[8, 64, 512, 4096])
    ap.add_argument("--mn", nargs="+", type=int, default=[64, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--k", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--op", nargs="+", choices=["qk", "pv"], default=["qk", "pv"],
                    help="Q x K^T (b_transposed) and/or P x V")
    ap.add_argument("--max-gb", type=float, default=8.0, help="skip shapes whose operands exceed this")
    ap.add_argument("--reps", type=int, default=20, help="calls per side and round, timed one by one")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the per-call timings")
    ap.add_argument("--out", default="bench/results/batched_gemm_h200.md")
    ap.add_argument("--device", action="store_true",
                    help="also time strided and cuBLAS on the device alone (host path hidden)")
    ap.add_argument("--kernels", action="store_true",
                    help="list the kernels each side runs on the shapes below the bar (torch.profiler), "
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
    dev = torch.cuda.get_device_properties(0)
    header = (f"{dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, gemmgen "
              f"{gemmgen.__version__}, {datetime.date.today()}, {args.dtype}; per call: the median of {args.rounds} "
              f"alternating rounds of the median of {args.reps} CUDA-event timings; TFLOP/s = 2*BH*M*N*K/t"
              + ("; strided: the tuned pick (--tune)" if args.tune else ""))
    print(header, flush=True)

    # Launch overhead on the smallest shape.
    a = torch.randn(1, 8, 64, 64, dtype=dtype, device="cuda")
    b = torch.randn(1, 8, 64, 64, dtype=dtype, device="cuda")
    c = torch.empty(1, 8, 64, 64, dtype=dtype, device="cuda")
    al, bl, cl = list(a[0]), list(b[0]), list(c[0])
    arrays = gemm.PointerArrays(al, bl, cl, b_transposed=True)
    overhead = {
        "strided (batched_gemm)": wall_us(lambda: gemmgen.batched_gemm(a, b, b_transposed=True, out=c)),
        "pointer-array, arrays prepared (PointerArrays.run)": wall_us(arrays.run),
        "pointer-array, arrays per call (batched_gemm_ptrs)":
            wall_us(lambda: gemmgen.batched_gemm_ptrs(al, bl, b_transposed=True, out_list=cl)),
        "torch.matmul": wall_us(lambda: torch.matmul(a, b.transpose(-2, -1), out=c)),
        "strided, queued (host time per call, no synchronize)":
            queued_us(lambda: gemmgen.batched_gemm(a, b, b_transposed=True, out=c)),
        "torch.matmul, queued (host time per call, no synchronize)":
            queued_us(lambda: torch.matmul(a, b.transpose(-2, -1), out=c)),
    }
    lines = [header, "", "Launch overhead, BH = 8, M = N = K = 64 (host wall time per call, synchronized):", "",
             "| path | us |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in overhead.items()]
    device_cols = (" strided sustained | cuBLAS sustained | sustained ratio | strided steady | cuBLAS steady "
                   "| steady ratio |") if args.device else ""
    device_cols += " strided instance |"
    lines += ["", "| op | BH | M=N | K | strided | ptr-array | cuBLAS | strided/cuBLAS | ptr/cuBLAS | strided kernel "
              "| cuBLAS kernel | kernel ratio |" + device_cols,
              "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (7 if args.device else 1)]
    short, short_kernel, short_device, short_steady, kernel_lines = [], [], [], [], []
    for bt in (True, False):
        if ("qk" if bt else "pv") not in args.op:
            continue
        op = "QK^T" if bt else "PV"
        for k in args.k:
            for mn in args.mn:
                for bh in args.bh:
                    if 2 * bh * (2 * mn * k + mn * mn) > args.max_gb * 2**30:
                        continue
                    a = torch.randn(bh, 1, mn, k, dtype=dtype, device="cuda")
                    b = torch.randn(bh, 1, mn, k, dtype=dtype, device="cuda") if bt else \
                        torch.randn(bh, 1, k, mn, dtype=dtype, device="cuda")
                    if not bt:  # P x V: A is [M, N=mn] probabilities, B is [mn, K]: C [M, K]
                        a = torch.randn(bh, 1, mn, mn, dtype=dtype, device="cuda")
                        b = torch.randn(bh, 1, mn, k, dtype=dtype, device="cuda")
                    n = b.shape[2] if bt else b.shape[3]
                    c = torch.empty(bh, 1, mn, n, dtype=dtype, device="cuda")
                    flops = 2.0 * bh * mn * n * a.shape[3]
                    bmat = b.transpose(-2, -1) if bt else b
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
                    t = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps)
                    t_s, t_p, t_c = t["strided"], t["ptr"], t["cuBLAS"]
                    pair = {"strided": sides["strided"], "cuBLAS": sides["cuBLAS"]}  # the kernel and load columns
                    kt = timing.rounds_ms(pair, rounds=args.rounds, reps=args.reps, hide_host=True)
                    kernel_ratio = kt["cuBLAS"] / kt["strided"]
                    tf = lambda ms: flops / ms / 1e9  # noqa: E731
                    row = (f"| {op} | {bh} | {mn} | {k} | {tf(t_s):.1f} | {tf(t_p):.1f} | {tf(t_c):.1f} | "
                           f"{t_c / t_s:.2f} | {t_c / t_p:.2f} | {tf(kt['strided']):.1f} | {tf(kt['cuBLAS']):.1f} | "
                           f"{kernel_ratio:.2f} |")
                    device_ratio = None
                    if args.device:
                        d = timing.sustained_ms(pair, rounds=5, settle_s=SETTLE_S,
                                                min_burst_ms=measure.TUNE_MIN_BURST_MS)
                        d_s, d_c = d["strided"], d["cuBLAS"]
                        device_ratio = d_c / d_s
                        row += f" {tf(d_s):.1f} | {tf(d_c):.1f} | {device_ratio:.2f} |"
                        if mn >= 512:
                            short_device.append(device_ratio)
                            st = timing.steady_ms(pair, seconds=args.steady_s, window_s=args.steady_s / 2,
                                                  min_burst_ms=measure.TUNE_MIN_BURST_MS)
                            steady_ratio = st["cuBLAS"] / st["strided"]
                            short_steady.append((op, bh, mn, k, steady_ratio))
                            row += f" {tf(st['strided']):.1f} | {tf(st['cuBLAS']):.1f} | {steady_ratio:.2f} |"
                        else:
                            row += " - | - | - |"
                    pick = selection.select(gemm.strided_problem(a, b, c, b_transposed=bt)).name
                    row += f" {pick.removeprefix('gemm_')} |"
                    lines.append(row)
                    print(row, flush=True)
                    if mn >= 512:
                        short.append((op, bh, mn, k, t_c / t_s))
                        short_kernel.append((op, bh, mn, k, kernel_ratio))
                        if args.kernels and min(kernel_ratio, device_ratio or 1.0,
                                                short_steady[-1][4] if args.device else 1.0) < 0.9:
                            ours = kernel_names(lambda: gemmgen.batched_gemm(a, b, b_transposed=bt, out=c))
                            kernel_lines += [f"{op} BH={bh} M=N={mn} K={k}: strided/cuBLAS {t_c / t_s:.2f}, "
                                             f"kernels {kernel_ratio:.2f}"
                                             + (f", sustained {device_ratio:.2f}, alone under load "
                                                f"{short_steady[-1][4]:.2f}" if device_ratio else ""),
                                             f"  gemmgen: {pick}, {len(ours)} kernel(s)",
                                             "  cuBLAS: " + "; ".join(kernel_names(
                                                 lambda: torch.matmul(a, bmat, out=c)))]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    if kernel_lines:
        with open(args.out.removesuffix(".md") + "_kernels.txt", "w") as f:
            f.write("\n".join(kernel_lines) + "\n")
    print(f"\nwritten to {args.out}\n")
    print("launch overhead (us): " + ", ".join(f"{k}: {v:.1f}" for k, v in overhead.items()))
    for label, rows in (("per call with the host path", short), ("per call, kernels alone", short_kernel),
                        ("each side alone under sustained load", short_steady)):
        if rows:
            ratios = [r[4] for r in rows]
            worst = min(rows, key=lambda r: r[4])
            print(f"strided / cuBLAS at M=N>=512, {label}: min {min(ratios):.3f} ({worst[0]} BH={worst[1]} "
                  f"M=N={worst[2]} K={worst[3]}), median {statistics.median(ratios):.2f}, below 0.9: "
                  f"{sum(r < 0.9 for r in ratios)} of {len(ratios)}")
    if short_device:
        print(f"sustained device time strided / cuBLAS at M=N>=512, in rotation with cuBLAS: min {min(short_device):.3f}, "
              f"median {statistics.median(short_device):.2f}, below 0.9: {sum(r < 0.9 for r in short_device)} of "
              f"{len(short_device)}")
    if short_kernel:
        kernels = [r[4] for r in short_kernel + short_steady]
        print(f"bar (strided >= 0.9x cuBLAS at M=N>=512, kernels per call"
              f"{' and each side alone under sustained load' if short_steady else ''}): "
              f"{'met' if min(kernels) >= 0.9 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
