"""The batched-GEMM kind on the command line: its shape arguments, its problem, `explain --op gemm`
(also `explain-gemm`), and what `gemmgen profile --op gemm` (also `profile-gemm`) needs of the kind:
the workload of a shape, with torch.matmul (cuBLAS) on the same operands as its peer.

    gemmgen explain --op gemm --batch 8 --heads 16 --m 1024 --n 1024 --k 64 --b-transposed [--cc 9.0 --sms 132]
    gemmgen profile --op gemm --batch 8 --heads 16 --m 1024 --n 1024 --k 64 --b-transposed [--record]

A shape's alignment is that of contiguous tensors ([B, H, M, K] etc.); --record stores the times
in this GPU's tuning database, which gemmgen.select.gemm_select then prefers over its heuristic.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gemmgen.select import device, gemm_select, measure, registry, selection
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
        p.add_argument("--record", dest="store", action="store_true", help="store the times in the tuning database")
        p.add_argument("--csv", metavar="FILE", help="write every measurement as CSV")
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


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """A batched GEMM of contiguous operands: batch x heads matrices C[M, N] = A[M, K] B[K, N]
    (B stored [N, K] when b_transposed)."""

    batch: int
    heads: int
    m: int
    n: int
    k: int
    dtype: str = "fp16"
    out_fp32: bool = False
    b_transposed: bool = False
    strategy: str = "strided"

    @property
    def flops(self) -> float:
        """Multiply-adds of one call, twice."""
        return 2.0 * self.batch * self.heads * self.m * self.n * self.k

    def spec(self) -> str:
        """The shape as its tuning records store it: BxHxMxNxK."""
        return f"{self.batch}x{self.heads}x{self.m}x{self.n}x{self.k}"

    def describe(self) -> str:
        """One line: sizes, types, layout and strategy."""
        out = "fp32" if self.out_fp32 else self.dtype
        return (f"{self.batch}x{self.heads} x (M={self.m} N={self.n} K={self.k}) {self.dtype}->{out} "
                f"{'A*B^T' if self.b_transposed else 'A*B'} {self.strategy}")


def shape_of(args: Any) -> GemmShape:
    """The shape the arguments (or a GemmShape) name; InputError for a size below 1."""
    if min(args.batch, args.heads, args.m, args.n, args.k) < 1:
        raise InputError("--batch, --heads, --m, --n, --k must be at least 1")
    return GemmShape(args.batch, args.heads, args.m, args.n, args.k, args.dtype, args.out_fp32, args.b_transposed,
                     args.strategy)


def problem_of(args: Any, facts: device.DeviceFacts) -> gemm_select.GemmProblem:
    """The GemmProblem of contiguous operands of the shape the arguments (or a GemmShape) name."""
    shape = shape_of(args)
    out = "fp32" if shape.out_fp32 else shape.dtype
    elem = DTYPE_BYTES[shape.dtype]
    return gemm_select.GemmProblem(
        dtype=shape.dtype, out_dtype=out, b_transposed=shape.b_transposed, strategy=shape.strategy, device=facts,
        m=shape.m, n=shape.n, k=shape.k, batch_count=shape.batch * shape.heads,
        align=_alignment([shape.k, shape.k if shape.b_transposed else shape.n], elem),
        align_c=_alignment([shape.n], DTYPE_BYTES[out]))


def run_explain(args: argparse.Namespace) -> int:
    """Print the decision for the shape."""
    from gemmgen.cli import explain as cli_explain

    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    facts, db = cli_explain.device_facts(args)
    decision = selection.decide(problem_of(args, facts), args.instance, db=db)
    print(decision.report())
    return 0


def workload(shape: GemmShape, problem: gemm_select.GemmProblem) -> measure.CallWorkload:
    """Random operands of `shape` on the current CUDA device, each candidate called by name on them
    (through pointer arrays for the ptr strategy), torch.matmul into the same output as its peer."""
    import torch

    from gemmgen.ops import gemm

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    out_dtype = torch.float32 if shape.out_fp32 else dtype
    b, h, m, n, k = shape.batch, shape.heads, shape.m, shape.n, shape.k
    a = torch.randn(b, h, m, k, dtype=dtype, device="cuda")
    bm = torch.randn(b, h, n, k, dtype=dtype, device="cuda") if shape.b_transposed else \
        torch.randn(b, h, k, n, dtype=dtype, device="cuda")
    c = torch.empty(b, h, m, n, dtype=out_dtype, device="cuda")
    arrays = None
    if shape.strategy == "ptr":
        arrays = gemm.PointerArrays(list(a.flatten(0, 1)), list(bm.flatten(0, 1)), list(c.flatten(0, 1)),
                                    b_transposed=shape.b_transposed)

    def call(name: str) -> None:
        if arrays is not None:
            arrays.run(instance=name)
        else:
            gemm.batched_gemm(a, bm, b_transposed=shape.b_transposed, out=c, instance=name)

    bt = bm.transpose(-2, -1) if shape.b_transposed else bm
    if out_dtype == dtype:
        def cublas(_i: int) -> None:
            torch.matmul(a, bt, out=c)
    else:
        def cublas(_i: int) -> None:
            torch.matmul(a, bt).float()
    return measure.CallWorkload(shape.spec(), shape.flops, call, problem, peers={"torch": measure.Peer(cublas)},
                                sync=torch.cuda.synchronize)
