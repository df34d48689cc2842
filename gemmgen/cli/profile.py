"""`gemmgen profile`: every candidate of each shape timed and checked (gemmgen.select.tuner.measure), next
to torch SDPA's flash, efficient and cuDNN backends measured in the same run on the same inputs.
Prints a table per shape with the winner marked, stores every time in the tuning database, and
optionally writes a CSV and a plot."""
from __future__ import annotations

import argparse
import csv
import math
import sys
from typing import Any

from gemmgen import cache
from gemmgen.select import registry, shapes
from gemmgen.select.shapes import tflops
from gemmgen.arch import parse_arch
from gemmgen.errors import DeviceError, InputError

SDPA_BACKENDS = ("flash", "efficient", "cudnn")
CSV_FIELDS = ("shape", "dtype", "causal", "layout", "batch", "heads", "heads_kv", "seqlen_q", "seqlen_k",
              "head_dim", "kind", "name", "ms", "tflops", "winner", "reason")


class ProgressLine:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    def done(self, text: str) -> None:
        """Finish the line with `text`."""
        sys.stderr.write(f"\r\033[K{text}\n" if self.tty else f"{text}\n")
        sys.stderr.flush()


def measure_sdpa(shape: shapes.Shape, index: int, *, warmup: int, reps: int,
                 graph: bool) -> dict[str, tuple[float, str | None]]:
    """Median ms of torch SDPA's backends on the shape (inf and the reason where one cannot run)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gemmgen.select import tuner, device, timing

    l2 = device.facts(index).l2_bytes
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    q, k, v = tuner.make_qkv(shape, index, seed=1)
    gqa = shape.kv_heads != shape.heads
    result = {}
    with torch.cuda.device(index):
        for label, backend in backends.items():
            try:
                with sdpa_kernel([backend]):
                    def run(_: int) -> None:
                        F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

                    ms = timing.median_ms(run, 1, warmup=warmup, reps=reps, graph=graph,
                                          flush=timing.flush_buffer(index, l2) if not graph else None)
                result[label] = (ms, None)
            except RuntimeError as exc:
                result[label] = (math.inf, str(exc).splitlines()[0] if str(exc) else "not supported")
    return result


def table(shape: shapes.Shape, result: Any, sdpa: dict[str, tuple[float, str | None]]) -> str:
    """The per-shape table: instance, ms, TFLOP/s, ratio to each SDPA backend; winner marked."""
    winner = result.winner
    width = max([len(m.name) for m in result.measurements] + [20])
    head = f"  {'instance':<{width}}  {'ms':>9}  {'TFLOP/s':>7}" + "".join(f"  {'vs ' + b:>12}" for b in SDPA_BACKENDS)
    lines = [f"{shape.describe()}  (bucket {result.problem.bucket.key})", head]
    for m in sorted(result.measurements, key=lambda m: m.ms):
        mark = "*" if winner is not None and m is winner else " "
        if not m.ok:
            lines.append(f"{mark} {m.name:<{width}}  {'-':>9}  {'-':>7}  failed: {m.reason}")
            continue
        ratios = "".join(f"  {sdpa[b][0] / m.ms:>12.2f}" if math.isfinite(sdpa[b][0]) else f"  {'-':>12}"
                         for b in SDPA_BACKENDS)
        lines.append(f"{mark} {m.name:<{width}}  {m.ms:>9.4f}  {tflops(shape, m.ms):>7.1f}{ratios}")
    for b in SDPA_BACKENDS:
        ms, reason = sdpa[b]
        name = f"torch sdpa {b}"
        lines.append(f"  {name:<{width}}  {ms:>9.4f}  {tflops(shape, ms):>7.1f}" if math.isfinite(ms)
                     else f"  {name:<{width}}  {'-':>9}  {'-':>7}  not run: {reason}")
    lines.append(f"winner: {winner.name if winner else 'none (every candidate failed)'}")
    return "\n".join(lines)


def csv_rows(shape: shapes.Shape, result: Any, sdpa: dict[str, tuple[float, str | None]]) -> list[dict]:
    """The CSV rows of one shape."""
    base = {"shape": shape.describe(), "dtype": shape.dtype, "causal": int(shape.causal), "layout": shape.layout,
            "batch": shape.batch, "heads": shape.heads, "heads_kv": shape.kv_heads, "seqlen_q": shape.seqlen_q,
            "seqlen_k": shape.seqlen_k, "head_dim": shape.head_dim}
    rows = [{**base, "kind": "gemmgen", "name": m.name, "ms": m.ms if m.ok else "", "winner": int(m is result.winner),
             "tflops": round(tflops(shape, m.ms), 2), "reason": m.reason or ""} for m in result.measurements]
    rows += [{**base, "kind": "sdpa", "name": b, "ms": ms if math.isfinite(ms) else "", "winner": 0,
              "tflops": round(tflops(shape, ms), 2), "reason": reason or ""} for b, (ms, reason) in sdpa.items()]
    return rows


def shapes_of(args: argparse.Namespace) -> list[shapes.Shape]:
    """The shapes --shapes or --sweep name, for each --dtype."""
    if bool(args.shapes) == bool(args.sweep):
        raise InputError("give either --shapes B,H,N,d[,causal] ... or --sweep fa")
    if args.sweep:
        return shapes.sweep(args.sweep, dtypes=tuple(args.dtype or ()))
    from gemmgen.cli.explain import shape_sizes

    for text in args.shapes:
        parsed = shape_sizes(text)
        if parsed is not None and 0 in parsed[0]:
            raise InputError(f"sizes must be positive in shape {text!r}: an empty problem has nothing to time")
    return [shapes.parse_shape(text, dtype=dt, heads_kv=args.heads_kv, layout=args.layout)
            for dt in (args.dtype or ["bf16"]) for text in args.shapes]


def run(args: argparse.Namespace) -> int:
    """Profile as the arguments say; returns the exit status."""
    try:
        arch = parse_arch(args.arch)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    todo = shapes_of(args)
    if args.plot:
        from gemmgen.cli import plot

        plot.require_matplotlib()
    if not args.no_store:
        cache.writable_dir("tuning")  # fail before measuring, not after
    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    known = {c.name for c in registry.load()[0]}
    unknown = [n for n in args.instance or [] if n not in known]
    if unknown:
        raise InputError(f"unknown instance name(s): {', '.join(unknown)}; known: {', '.join(sorted(known)) or 'none'}")
    import torch

    from gemmgen.select import tuner

    if not torch.cuda.is_available():
        raise DeviceError(f"`gemmgen profile` needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    index = args.device
    if not 0 <= index < torch.cuda.device_count():
        raise InputError(f"--device {index}: this machine has {torch.cuda.device_count()} GPU(s)")
    progress, rows, plotted, status = ProgressLine(), [], [], 0
    for n, shape in enumerate(todo, 1):
        def say(what: str, n: int = n, shape: shapes.Shape = shape) -> None:
            progress(f"[{n}/{len(todo)}] {shape.describe()}: {what}")

        problem = tuner.problem_of(shape, index)
        cands = [c for c in registry.candidates(problem)[0] if c.entry.arch == arch.value
                 and (not args.instance or c.name in args.instance)]
        result = tuner.TuneResult(shape, problem, tuner.measure(
            cands, shape, index=index, warmup=args.warmup, reps=args.reps, graph=args.graph, progress=say))
        say("torch SDPA backends")
        sdpa = measure_sdpa(shape, index, warmup=args.warmup, reps=args.reps, graph=args.graph)
        if result.measurements and not args.no_store:
            result.database = tuner.store(result)
        progress.done(f"[{n}/{len(todo)}] {shape.describe()}: {len(cands)} candidates")
        print(table(shape, result, sdpa) + "\n", flush=True)
        if not cands:
            print(f"no {arch.value} candidate for {shape.describe()}: see `gemmgen explain`", file=sys.stderr)
            status = 1
        rows += csv_rows(shape, result, sdpa)
        plotted.append((shape, result, sdpa))
    if not args.no_store and any(r.database for _, r, _ in plotted):
        print(f"stored in {next(r.database for _, r, _ in plotted if r.database)}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    if args.plot:
        from gemmgen.cli import plot

        plot.draw(plotted, args.plot)
        print(f"wrote {args.plot}")
    return status


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `gemmgen profile`."""
    p.add_argument("--arch", required=True, help="instances built for this arch, e.g. sm80")
    p.add_argument("--shapes", nargs="+", metavar="B,H,N,d[,causal]",
                   help="shapes to profile (B,H,Nq,Nk,d also accepted)")
    p.add_argument("--sweep", choices=shapes.SWEEPS, help="a named sweep: fa (FlashAttention's)")
    p.add_argument("--dtype", nargs="+", choices=shapes.DTYPES,
                   help="element types to profile (default: bf16; --sweep: both)")
    p.add_argument("--heads-kv", type=int, help="key/value heads for --shapes (GQA/MQA)")
    p.add_argument("--layout", choices=("bhnd", "bnhd", "mixed"), default="bhnd",
                   help="storage order of q and k/v (default: bhnd)")
    p.add_argument("--instance", action="append", help="only this instance (repeatable)")
    p.add_argument("--build-dir", action="append",
                   help="where to find manifests (repeatable; default: $GEMMGEN_BUILD_DIR, else ./build "
                        "and the builds `gemmgen generate` recorded)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default: 0)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per candidate first (default: 5)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per candidate, median taken (default: 30)")
    p.add_argument("--graph", action="store_true", help="time replays of a CUDA graph")
    p.add_argument("--no-store", action="store_true", help="do not write the tuning database")
    p.add_argument("--csv", metavar="FILE", help="write every measurement as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="draw TFLOP/s per shape (needs matplotlib)")
