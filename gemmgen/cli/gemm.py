"""`gemmgen explain-gemm` and `gemmgen profile-gemm`: which batched-GEMM instance runs a shape and
why, and the time of every candidate against torch.matmul (cuBLAS) on the same batched shape.

    gemmgen explain-gemm --batch 8 --heads 16 --m 1024 --n 1024 --k 64 --b-transposed [--cc 9.0 --sms 132]
    gemmgen profile-gemm --batch 8 --heads 16 --m 1024 --n 1024 --k 64 --b-transposed [--record]

A shape's alignment is that of contiguous tensors ([B, H, M, K] etc.); --record stores the times
in this GPU's tuning database, which gemmgen.select.gemm_select then prefers over its heuristic.
"""
from __future__ import annotations

import argparse
import math
import time

from gemmgen.select import device, gemm_select, registry, selection, tuning_db
from gemmgen.errors import InputError

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def add_arguments(p: argparse.ArgumentParser, *, profile: bool) -> None:
    """The shape arguments shared by both commands, and each one's own."""
    p.add_argument("--batch", type=int, default=8, help="batch size B (default: 8)")
    p.add_argument("--heads", type=int, default=16, help="heads H: B * H matrices (default: 16)")
    p.add_argument("--m", type=int, default=1024, help="rows of A and C (default: 1024)")
    p.add_argument("--n", type=int, default=1024, help="columns of B and C (default: 1024)")
    p.add_argument("--k", type=int, default=64, help="the reduced dimension (default: 64)")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="input element type (default: fp16)")
    p.add_argument("--out-fp32", action="store_true", help="fp32 output (default: the input dtype)")
    p.add_argument("--b-transposed", action="store_true", help="A * B^T with B stored [N, K] (Q x K^T)")
    p.add_argument("--strategy", choices=gemm_select.STRATEGIES, default="strided",
                   help="strided: one descriptor with batch and head strides; ptr: arrays of pointers "
                        "(default: strided)")
    p.add_argument("--build-dir", action="append",
                   help="where to find manifests (repeatable; default: $GEMMGEN_BUILD_DIR, else ./build "
                        "and the builds `gemmgen generate` recorded)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    if profile:
        p.add_argument("--reps", type=int, default=30,
                       help="timed calls per candidate: one alternating round per 10 (median of the rounds; "
                            "each round a burst of >= 10 calls lasting >= 40 ms where calls are >= 50 us)")
        p.add_argument("--record", action="store_true", help="store the times in the tuning database")
    else:
        p.add_argument("--instance", help="force an instance by name")
        p.add_argument("--cc", help="describe a GPU that is not here: compute capability, e.g. 9.0")
        p.add_argument("--sms", type=int, help="with --cc: its SM count")
        p.add_argument("--gpu", help="with --cc: its name (selects its tuning database)")


def _alignment(values: list[int], elem_bytes: int) -> int:
    align = 16 // elem_bytes
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def problem_of(args: argparse.Namespace, facts: device.DeviceFacts) -> gemm_select.GemmProblem:
    """The GemmProblem of contiguous operands of the requested shape."""
    if min(args.batch, args.heads, args.m, args.n, args.k) < 1:
        raise InputError("--batch, --heads, --m, --n, --k must be at least 1")
    out = "fp32" if args.out_fp32 else args.dtype
    elem = DTYPE_BYTES[args.dtype]
    return gemm_select.GemmProblem(
        dtype=args.dtype, out_dtype=out, b_transposed=args.b_transposed, strategy=args.strategy, device=facts,
        m=args.m, n=args.n, k=args.k, batch_count=args.batch * args.heads,
        align=_alignment([args.k, args.k if args.b_transposed else args.n], elem),
        align_c=_alignment([args.n], DTYPE_BYTES[out]))


def run_explain(args: argparse.Namespace) -> int:
    """Print the decision for the shape."""
    from gemmgen.cli import explain as cli_explain

    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    facts, db = cli_explain.device_facts(args)
    decision = selection.decide(problem_of(args, facts), args.instance, db=db)
    print(decision.report())
    return 0


def run_profile(args: argparse.Namespace) -> int:
    """Time every candidate and torch.matmul on the shape; print a table; optionally record."""
    import torch

    from gemmgen.ops import gemm
    from gemmgen.select import timing

    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    if not torch.cuda.is_available():
        from gemmgen.errors import DeviceError

        raise DeviceError("profile-gemm needs a CUDA GPU")
    torch.cuda.set_device(args.device)
    facts = device.facts(args.device)
    problem = problem_of(args, facts)
    decision = selection.decide(problem)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    out_dtype = torch.float32 if args.out_fp32 else dtype
    b, h, m, n, k = args.batch, args.heads, args.m, args.n, args.k
    a = torch.randn(b, h, m, k, dtype=dtype, device="cuda")
    bm = torch.randn(b, h, n, k, dtype=dtype, device="cuda") if args.b_transposed else \
        torch.randn(b, h, k, n, dtype=dtype, device="cuda")
    c = torch.empty(b, h, m, n, dtype=out_dtype, device="cuda")
    arrays = None
    if args.strategy == "ptr":
        arrays = gemm.PointerArrays(list(a.flatten(0, 1)), list(bm.flatten(0, 1)), list(c.flatten(0, 1)),
                                    b_transposed=args.b_transposed)
    flops = 2.0 * b * h * m * n * k

    def call(name: str) -> None:
        if arrays is not None:
            arrays.run(instance=name)
        else:
            gemm.batched_gemm(a, bm, b_transposed=args.b_transposed, out=c, instance=name)

    bt = bm.transpose(-2, -1) if args.b_transposed else bm
    torch_call = (lambda: torch.matmul(a, bt, out=c)) if out_dtype == dtype else (lambda: torch.matmul(a, bt).float())
    rows, records, peer_ms = measure(decision.candidates, call, reps=args.reps, shape=f"{b}x{h}x{m}x{n}x{k}",
                                     peers={"torch": torch_call})
    ms_torch = peer_ms.get("torch", math.nan)
    print(f"{problem.describe()} on {facts.describe()}; device time per call (host path hidden) under "
          f"sustained load (alternating rounds), over short runs (calls timed one by one) and, for the "
          f"finalists of calls of {timing.HOST_BOUND_MS * 1e3:.0f} us or more, alone under load")
    print(f"{'instance':60} {'ms':>9} {'TFLOP/s':>8} {'short ms':>9} {'TFLOP/s':>8} {'alone ms':>9} {'TFLOP/s':>8}")
    for name, ms, ms_short, ms_alone, reason in sorted(rows, key=lambda r: r[1]):
        mark = "*" if name == decision.winner.name else " "
        shown = f"{ms:9.4f} {flops / ms / 1e9:8.1f}" if math.isfinite(ms) else f"failed: {reason}"
        for t in (ms_short, ms_alone):
            shown += f" {t:9.4f} {flops / t / 1e9:8.1f}" if t is not None else f" {'-':>9} {'-':>8}"
        print(f"{mark}{name:59} {shown}")
    print(f" {'torch.matmul (cuBLAS)':59} {ms_torch:9.4f} {flops / ms_torch / 1e9:8.1f}")
    print(f"(* = the pick before profiling: {decision.source})")
    if args.record:
        db = record(problem, records)
        print(f"recorded {len(records)} times in {db.path}")
    return 0


TUNE_BURST = 10  # back-to-back calls per timed burst when tuning, at least
TUNE_MIN_BURST_MS = 40.0  # and bursts of calls >= 50 us last this long (timing.burst_calls)
TUNE_PRUNE = 1.3  # candidates this much slower than the fastest after settling skip the rounds
TUNE_SHORT_REPS = 10  # calls per pass when timing calls one by one (two passes, alternating order)
TUNE_FINALISTS = 3  # the candidates of lowest cost in both states, each then timed alone under load
TUNE_ALONE_S = 1.0  # seconds of each finalist's turns alone (timing.steady_ms: two turns each)


def measure(cands: list, call, *, reps: int, shape: str, peers: dict | None = None,
            settle_s: float = 1.0) -> tuple[list[tuple[str, float, float | None, float | None, str | None]], dict, dict]:
    """Time `call(name)` for every candidate in the two states a GEMM runs in.

    Sustained load (the record's ms; timing.sustained_ms): `settle_s` seconds of load, then rounds
    of back-to-back bursts in alternating order, each queued behind a spin kernel so that the events
    time the kernels alone and lasting TUNE_MIN_BURST_MS where the calls are long enough; one round
    per TUNE_BURST of `reps`, at least two; candidates more than TUNE_PRUNE times slower than the
    fastest after settling keep their settling time. Short runs (ms_short): the candidates within
    TUNE_PRUNE of the fastest sustained time, each call timed on its own (timing.median_ms, host
    path hidden), TUNE_SHORT_REPS calls per candidate and pass, two passes in alternating order,
    the mean of the two passes' medians (timing.rounds_ms): the clock a cooler GPU gives a few
    calls. Alone under load (ms_alone): where calls are long enough for bursts of them to hold the
    GPU at its power cap (timing.HOST_BOUND_MS and longer), the TUNE_FINALISTS candidates of lowest
    cost in both states, each with the GPU to itself for turns of TUNE_ALONE_S seconds
    (timing.steady_ms), since in the rotation a burst starts at the clock the candidate before it
    left (bench/NOTES.md, experiment 48). gemm_select picks the candidate closest to the best in
    both states (tuned_costs), its load ratio taken alone where the finalists were.

    Returns (name, ms, ms_short, ms_alone, reason) rows, tuning-database records by build hash, and
    the sustained ms of each of `peers` (name -> callable, e.g. torch.matmul), timed in the same rounds.

    A kernel of a few microseconds timed with its host path would measure that path, the same for
    every candidate; a ranking taken in one state can invert in the other on output-bound shapes
    (bench/NOTES.md, experiments 17, 19, 21 and 22). A failing candidate is infinitely slow."""
    from gemmgen.select import timing

    rows, records, runs = [], {}, {}
    for cand in cands:  # one call each first: a candidate that fails is not timed
        try:
            call(cand.name)
            runs[cand.name] = lambda name=cand.name: call(name)
        except Exception as exc:  # a failing candidate is infinitely slow, not a crash
            rows.append((cand.name, math.inf, None, None, str(exc).splitlines()[0]))
    peer_ms = {}
    if runs:
        rounds = max(2, -(-reps // TUNE_BURST))
        peer_runs = {f"peer:{k}": v for k, v in (peers or {}).items()}
        timed = timing.sustained_ms({**runs, **peer_runs}, rounds=rounds, burst=TUNE_BURST, settle_s=settle_s,
                                    min_burst_ms=TUNE_MIN_BURST_MS, prune=TUNE_PRUNE, fixed=tuple(peer_runs))
        peer_ms = {name.removeprefix("peer:"): ms for name, ms in timed.items() if name.startswith("peer:")}
        fastest = min(timed[name] for name in runs)
        contenders = [name for name in runs if timed[name] <= TUNE_PRUNE * fastest]
        short = timing.rounds_ms({name: runs[name] for name in contenders}, rounds=2, reps=TUNE_SHORT_REPS,
                                 warmup=2, hide_host=True)
        alone = {}
        if fastest >= timing.HOST_BOUND_MS and len(contenders) > 1:
            costs = gemm_select.tuned_costs({name: tuning_db.Record(name=name, ms=timed[name], ms_short=short.get(name))
                                             for name in contenders})
            finalists = sorted(contenders, key=lambda name: costs[name])[:TUNE_FINALISTS]
            alone = timing.steady_ms({name: runs[name] for name in finalists}, seconds=TUNE_ALONE_S,
                                     window_s=TUNE_ALONE_S / 2, burst=TUNE_BURST, min_burst_ms=TUNE_MIN_BURST_MS)
        rows += [(name, timed[name], short.get(name), alone.get(name), None) for name in runs]
    by_name = {cand.name: cand for cand in cands}
    for name, ms, ms_short, ms_alone, reason in rows:
        records[by_name[name].content_hash] = tuning_db.Record(name=name, ms=ms, reason=reason, shape=shape,
                                                               at=time.time(), ms_short=ms_short, ms_alone=ms_alone)
    return rows, records, peer_ms


def record(problem: gemm_select.GemmProblem, records: dict) -> tuning_db.TuningDB:
    """Store `records` under the problem's functional key and bucket in its GPU's tuning database,
    and forget cached selections so the next call reads them."""
    entries = {problem.functional_key: {problem.bucket: {h_: r.to_json() for h_, r in records.items()}}}
    db = tuning_db.update(problem.device.fingerprint(), entries)
    registry.refresh()
    return db
