"""`gemmgen profile`: every candidate of each shape checked and timed (gemmgen.select.measure.measure)
next to the libraries it competes with, measured in the same run on the same inputs; a table per
shape with the winner marked, the times stored in the tuning database, optionally a CSV and a plot.

One loop (`run`) serves every kind of operation; `--op` picks the kind's Kind, which supplies what
differs: the shapes its arguments name, each shape's problem, candidates and Workload (its peers
included), the Policy it is timed under, and its table's title and CSV columns.

    gemmgen profile --arch sm80 --shapes 2,16,1024,128 [--csv F] [--plot F.png]   (torch SDPA as peers)
    gemmgen profile --arch sm80 --shapes 2,16,1024,128 --backward                  (SDPA's backward as peers)
    gemmgen profile --op gemm --batch 8 --m 1024 --n 1024 --k 64 [--record]        (torch.matmul as peer)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import math
import sys
from typing import Any, Protocol

from gemmgen import cache
from gemmgen.select import measure, registry, shapes
from gemmgen.arch import parse_arch
from gemmgen.errors import DeviceError, InputError

SDPA_BACKENDS = ("flash", "efficient", "cudnn")
RESULT_FIELDS = ("kind", "name", "ms", "tflops", "winner", "reason")  # the CSV columns of every kind


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


@dataclasses.dataclass
class Plan:
    """One shape as the profile measures it."""

    shape: Any  # the kind's shape: describe() and flops
    problem: Any  # its selection problem (the records' bucket)
    candidates: list
    title: str  # the table's first line
    missing: str = ""  # the message when there is no candidate
    pick: str | None = None  # the instance starred; None: the fastest measured, printed as the winner
    note: str = ""  # the table's last line, in place of the winner's


class Kind(Protocol):
    """What `gemmgen profile` needs of one kind of operation."""

    peer_kind: str  # the CSV "kind" of the peers' rows
    peer_titles: dict[str, str]  # peer name -> the name of its row in the table
    csv_fields: tuple[str, ...]  # the CSV columns: the shape's, RESULT_FIELDS, the policy's other states

    def shapes(self, args: argparse.Namespace) -> list:
        """The shapes the arguments name; InputError for bad arguments, before any GPU is looked for."""

    def plan(self, args: argparse.Namespace, shape: Any, index: int) -> Plan:
        """The shape's problem and candidates on device `index`."""

    def workload(self, args: argparse.Namespace, plan: Plan, index: int) -> measure.Workload:
        """The shape's inputs and peers on device `index` (the current device)."""

    def policy(self, args: argparse.Namespace) -> measure.Policy:
        """How the candidates are timed."""

    def csv_base(self, shape: Any) -> dict:
        """The shape's CSV columns."""


def sdpa_peers(shape: shapes.Shape, inputs: list) -> dict[str, measure.Peer]:
    """torch SDPA's flash, efficient and cuDNN backends on the workload's input copies, each timed
    inside a scope that allows only that backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    gqa = shape.kv_heads != shape.heads

    def run(i: int) -> None:
        q, k, v = inputs[i]
        F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)
    return {label: measure.Peer(run, functools.partial(sdpa_kernel, [backends[label]])) for label in SDPA_BACKENDS}


class Attention:
    """The forward attention: shapes from --shapes or --sweep for each --dtype, the built candidates
    of --arch (or --instance's), timed per call (gemmgen.select.tuner.policy) against torch SDPA."""

    peer_kind = "sdpa"
    peer_titles = {b: f"torch sdpa {b}" for b in SDPA_BACKENDS}
    csv_fields = ("shape", "dtype", "causal", "layout", "batch", "heads", "heads_kv", "seqlen_q", "seqlen_k",
                  "head_dim", *RESULT_FIELDS)

    def shapes(self, args: argparse.Namespace) -> list[shapes.Shape]:
        """The shapes --shapes or --sweep name, for each --dtype; the --arch and --instance names checked."""
        try:
            parse_arch(args.arch)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if bool(args.shapes) == bool(args.sweep):
            raise InputError("give either --shapes B,H,N,d[,causal] ... or --sweep fa")
        if args.sweep:
            todo = shapes.sweep(args.sweep, dtypes=tuple(args.dtype or ()))
        else:
            from gemmgen.cli.explain import shape_sizes

            for text in args.shapes:
                parsed = shape_sizes(text)
                if parsed is not None and 0 in parsed[0]:
                    raise InputError(f"sizes must be positive in shape {text!r}: an empty problem has nothing to time")
            todo = [shapes.parse_shape(text, dtype=dt, heads_kv=args.heads_kv, layout=args.layout)
                    for dt in (args.dtype or ["bf16"]) for text in args.shapes]
        known = {c.name for c in registry.load()[0]}
        unknown = [n for n in args.instance or [] if n not in known]
        if unknown:
            raise InputError(f"unknown instance name(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known)) or 'none'}")
        return todo

    what = ""  # the table title's first words ("backward of " for the backward)
    noun = "candidate"
    explain = "gemmgen explain"

    def problem_of(self, shape: shapes.Shape, index: int) -> Any:
        """The shape's selection problem."""
        from gemmgen.select import tuner

        return tuner.problem_of(shape, index)

    def plan(self, args: argparse.Namespace, shape: shapes.Shape, index: int) -> Plan:
        """Every built candidate of --arch for the shape (only --instance's where given)."""
        arch = parse_arch(args.arch).value
        problem = self.problem_of(shape, index)
        cands = [c for c in registry.candidates(problem)[0] if c.entry.arch == arch
                 and (not args.instance or c.name in args.instance)]
        return Plan(shape, problem, cands, f"{self.what}{shape.describe()}  (bucket {problem.bucket.key})",
                    missing=f"no {arch} {self.noun} for {shape.describe()}: see `{self.explain}`")

    def workload(self, args: argparse.Namespace, plan: Plan, index: int) -> measure.Workload:
        """The tuner's workload of the shape, SDPA's backends on its inputs as peers."""
        from gemmgen.select import tuner

        work = tuner.AttentionWorkload(plan.shape, index, graph=args.graph)
        work.peers = sdpa_peers(plan.shape, work.inputs)
        return work

    def policy(self, args: argparse.Namespace) -> measure.Policy:
        """The tuner's: per call, --warmup, --reps, --graph."""
        from gemmgen.select import tuner

        return tuner.policy(args.warmup, args.reps, args.graph)

    def csv_base(self, shape: shapes.Shape) -> dict:
        """The shape's columns."""
        return {"shape": shape.describe(), "dtype": shape.dtype, "causal": int(shape.causal), "layout": shape.layout,
                "batch": shape.batch, "heads": shape.heads, "heads_kv": shape.kv_heads, "seqlen_q": shape.seqlen_q,
                "seqlen_k": shape.seqlen_k, "head_dim": shape.head_dim}


class Gemm:
    """The batched GEMM: one shape from --batch, --heads, --m, --n, --k (gemmgen.cli.gemm), the
    selection's candidates, timed in the states a batched GEMM runs in (measure.sustained_policy)
    against torch.matmul; the pick before profiling is starred."""

    peer_kind = "torch"
    peer_titles = {"torch": "torch.matmul (cuBLAS)"}
    csv_fields = ("shape", "dtype", "out_dtype", "b_transposed", "strategy", "batch", "heads", "m", "n", "k",
                  *RESULT_FIELDS, "ms_short", "ms_alone")

    def shapes(self, args: argparse.Namespace) -> list:
        """The one shape of the arguments."""
        from gemmgen.cli import gemm as cli_gemm

        return [cli_gemm.shape_of(args)]

    def plan(self, args: argparse.Namespace, shape: Any, index: int) -> Plan:
        """The selection's candidates and pick (NoInstanceError, with the build command, when none)."""
        from gemmgen.cli import gemm as cli_gemm
        from gemmgen.select import device, selection, timing

        facts = device.facts(index)
        problem = cli_gemm.problem_of(shape, facts)
        decision = selection.decide(problem)
        title = (f"{problem.describe()} on {facts.describe()}; device time per call (host path hidden) under "
                 f"sustained load (alternating rounds), over short runs (calls timed one by one) and, for the "
                 f"finalists of calls of {timing.HOST_BOUND_MS * 1e3:.0f} us or more, alone under load")
        return Plan(shape, problem, decision.candidates, title, missing=f"no candidate for {problem.describe()}",
                    pick=decision.winner.name, note=f"(* = the pick before profiling: {decision.source})")

    def workload(self, args: argparse.Namespace, plan: Plan, index: int) -> measure.Workload:
        """Random operands, torch.matmul as the peer."""
        from gemmgen.cli import gemm as cli_gemm

        return cli_gemm.workload(plan.shape, plan.problem)

    def policy(self, args: argparse.Namespace) -> measure.Policy:
        """Sustained load, short runs, finalists alone; --reps / 10 rounds."""
        return measure.sustained_policy(args.reps)

    def csv_base(self, shape: Any) -> dict:
        """The shape's columns."""
        return {"shape": shape.spec(), "dtype": shape.dtype, "out_dtype": "fp32" if shape.out_fp32 else shape.dtype,
                "b_transposed": int(shape.b_transposed), "strategy": shape.strategy, "batch": shape.batch,
                "heads": shape.heads, "m": shape.m, "n": shape.n, "k": shape.k}


def sdpa_backward_peers(shape: shapes.Shape, qkv: tuple, do) -> dict[str, measure.Peer]:
    """The backward passes of torch SDPA's flash, efficient and cuDNN backends on the workload's
    inputs: each backend's forward made once (under its scope, which fixes the backward kernel),
    then torch.autograd.grad of its output timed; a backend that cannot run the shape is left out."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    leaves = [t.detach().requires_grad_() for t in qkv]
    peers = {}
    for label in SDPA_BACKENDS:
        try:
            with sdpa_kernel([backends[label]]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=shape.causal,
                                                     enable_gqa=shape.kv_heads != shape.heads)
        except RuntimeError:
            continue

        def run(_i: int, out=out) -> None:
            torch.autograd.grad(out, leaves, do, retain_graph=True)
        peers[label] = measure.Peer(run)
    return peers


class Backward(Attention):
    """The attention backward (--backward): the same shapes, the built backward candidates of --arch,
    timed per call (gemmgen.select.tuner.BackwardWorkload) against torch SDPA's backward passes."""

    peer_titles = {b: f"torch sdpa {b} backward" for b in SDPA_BACKENDS}

    what = "backward of "
    noun = "backward candidate"
    explain = "gemmgen explain --backward"

    def problem_of(self, shape: shapes.Shape, index: int) -> Any:
        """The shape's backward problem (K and V expanded to Q's heads)."""
        from gemmgen.select import tuner

        return tuner.bwd_problem_of(shape, index)

    def workload(self, args: argparse.Namespace, plan: Plan, index: int) -> measure.Workload:
        """The tuner's backward workload of the shape, SDPA's backward passes as peers."""
        from gemmgen.select import tuner

        work = tuner.BackwardWorkload(plan.shape, index)
        work.peers = sdpa_backward_peers(plan.shape, work.qkv, work.do)
        return work


KINDS: dict[str, Kind] = {"attention": Attention(), "attention_bwd": Backward(), "gemm": Gemm()}


def _times(measured: measure.Measured, ms: float | None) -> str:
    if ms is None or not math.isfinite(ms):
        return f"{'-':>9}  {'-':>7}"
    return f"{ms:>9.4f}  {measured.tflops(ms):>7.1f}"


def marked(plan: Plan, measured: measure.Measured) -> str | None:
    """The instance the table stars: the plan's pick, else the fastest measured."""
    if plan.pick is not None:
        return plan.pick
    return measured.winner.name if measured.winner else None


def table(kind: Kind, plan: Plan, measured: measure.Measured, policy: measure.Policy) -> str:
    """The per-shape table: instance, ms and TFLOP/s in each state the policy takes, ratio of each
    peer's time to the instance's; the peers' own rows; the winner (or the plan's note)."""
    states = [s for s, on in (("short", policy.short), ("alone", policy.alone)) if on]
    star = marked(plan, measured)
    titles = {name: kind.peer_titles.get(name, name) for name in measured.peers}
    width = max([len(m.name) for m in measured.measurements] + [len(t) for t in titles.values()] + [20])
    head = (f"  {'instance':<{width}}  {'ms':>9}  {'TFLOP/s':>7}"
            + "".join(f"  {s + ' ms':>9}  {'TFLOP/s':>7}" for s in states)
            + "".join(f"  {'vs ' + name:>12}" for name in measured.peers))
    lines = [plan.title, head]
    for m in sorted(measured.measurements, key=lambda m: m.ms):
        mark = "*" if m.name == star else " "
        if not m.ok:
            lines.append(f"{mark} {m.name:<{width}}  {'-':>9}  {'-':>7}  failed: {m.reason}")
            continue
        cells = "  ".join(_times(measured, t) for t in [m.ms, *(getattr(m, f"ms_{s}") for s in states)])
        ratios = "".join(f"  {p.ms / m.ms:>12.2f}" if p.ok else f"  {'-':>12}" for p in measured.peers.values())
        lines.append(f"{mark} {m.name:<{width}}  {cells}{ratios}")
    for name, p in measured.peers.items():
        lines.append(f"  {titles[name]:<{width}}  {_times(measured, p.ms)}" if p.ok
                     else f"  {titles[name]:<{width}}  {'-':>9}  {'-':>7}  not run: {p.reason}")
    lines.append(plan.note or f"winner: {star or 'none (every candidate failed)'}")
    return "\n".join(lines)


def csv_rows(kind: Kind, plan: Plan, measured: measure.Measured) -> list[dict]:
    """The CSV rows of one shape: its candidates, then its peers."""
    base, star = kind.csv_base(plan.shape), marked(plan, measured)

    def row(m: measure.Measurement, what: str) -> dict:
        return {**base, "kind": what, "name": m.name, "ms": m.ms if m.ok else "", "tflops": round(measured.tflops(m.ms), 2),
                "winner": int(what == "gemmgen" and m.name == star), "reason": m.reason or "",
                "ms_short": "" if m.ms_short is None else m.ms_short, "ms_alone": "" if m.ms_alone is None else m.ms_alone}
    return [row(m, "gemmgen") for m in measured.measurements] + [row(p, kind.peer_kind) for p in measured.peers.values()]


def run(args: argparse.Namespace) -> int:
    """Profile as the arguments say (the kind --op names); returns the exit status."""
    kind = KINDS["attention_bwd" if args.op == "attention" and getattr(args, "backward", False) else args.op]
    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    todo = kind.shapes(args)
    plot_to = getattr(args, "plot", None)
    if plot_to:
        from gemmgen.cli import plot

        plot.require_matplotlib()
    if args.store:
        cache.writable_dir("tuning")  # fail before measuring, not after
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(f"`gemmgen profile` needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    index = args.device
    if not 0 <= index < torch.cuda.device_count():
        raise InputError(f"--device {index}: this machine has {torch.cuda.device_count()} GPU(s)")
    progress, rows, plotted, stored, status = ProgressLine(), [], [], None, 0
    policy = kind.policy(args)
    with torch.cuda.device(index):
        for n, shape in enumerate(todo, 1):
            def say(what: str, n: int = n, shape: Any = shape) -> None:
                progress(f"[{n}/{len(todo)}] {shape.describe()}: {what}")

            plan = kind.plan(args, shape, index)
            measured = measure.measure(plan.candidates, kind.workload(args, plan, index), policy, say)
            if args.store and measured.measurements:
                stored = measure.record(plan.problem, measured.records).path
            progress.done(f"[{n}/{len(todo)}] {shape.describe()}: {len(plan.candidates)} candidates")
            print(table(kind, plan, measured, policy) + "\n", flush=True)
            if not plan.candidates:
                print(plan.missing, file=sys.stderr)
                status = 1
            rows += csv_rows(kind, plan, measured)
            plotted.append((shape, measured, {name: (p.ms, p.reason) for name, p in measured.peers.items()}))
    if stored is not None:
        print(f"stored in {stored}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=kind.csv_fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    if plot_to:
        from gemmgen.cli import plot

        plot.draw(plotted, plot_to)
        print(f"wrote {plot_to}")
    return status


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `gemmgen profile` (the attention's; `--op gemm` takes gemmgen.cli.gemm's)."""
    p.add_argument("--arch", required=True, help="instances built for this arch, e.g. sm80")
    p.add_argument("--shapes", nargs="+", metavar="B,H,N,d[,causal]",
                   help="shapes to profile (B,H,Nq,Nk,d also accepted)")
    p.add_argument("--sweep", choices=shapes.SWEEPS, help="a named sweep: fa (FlashAttention's)")
    p.add_argument("--dtype", nargs="+", choices=shapes.DTYPES,
                   help="element types to profile (default: bf16; --sweep: both)")
    p.add_argument("--heads-kv", type=int, help="key/value heads for --shapes (GQA/MQA)")
    p.add_argument("--backward", action="store_true",
                   help="profile the backward pass (dQ, dK, dV) against torch SDPA's backward passes")
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
    p.add_argument("--no-store", dest="store", action="store_false", help="do not write the tuning database")
    p.add_argument("--csv", metavar="FILE", help="write every measurement as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="draw TFLOP/s per shape (needs matplotlib)")
