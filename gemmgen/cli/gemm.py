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

from gemmgen.select import device, gemm_select, registry, selection
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
    from gemmgen.select import measure, timing

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
    rows, records, peer_ms = measure.measure_states(decision.candidates, call, reps=args.reps, shape=f"{b}x{h}x{m}x{n}x{k}",
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
        db = measure.record(problem, records)
        print(f"recorded {len(records)} times in {db.path}")
    return 0
