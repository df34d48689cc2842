"""The project's own attention backward on mma.sync (FlashAttention-2's algorithm, CuTe): dQ, dK and
dV of the fa2_sm80 / fmha_sm90 / mea_sm80 forwards for Ampere-class GPUs, and on Hopper for the head
dims fmha_bwd_sm90 has no tile for (96, 160, 192, 256).

A CTA owns `block_n` keys of one (batch, head), keeps K, V, dK and dV on chip and walks the query
tiles that see them, `block_m` rows at a time with `stages` buffers of Q and dO; dQ is added up in an
fp32 workspace with atomics, or with deterministic=True by the key tiles of each query tile in turn.
Before it a small kernel computes D = rowsum(dO * O) per row, after it another writes dQ in its dtype
and strides (templates/include/gemmgen/fa2_bwd_sm80/). The causal offset is a launch parameter: one
instance serves no mask, causal in both alignments and sliding windows with any Nq, Nk (BothMasks),
on packed sequences too. K and V are read at their own heads (GQA without expanding them); dK and dV
come back per query head. A `softcap` instance runs the backward of a logit softcap (and only calls
with one).
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import (AttentionInstance, BothMasks, CostInputs, DType, Warps, axis_reason,
                                             feature_reason, smem_reason)

FAMILY = "fa2_bwd_sm80"
KIND = "attention_bwd"
BUILT_BY_DEFAULT = True
TEMPLATE = "fa2_bwd_sm80.cu.jinja"
HEADER_DIRS = ("fa2_bwd_sm80", "fa2_sm80")  # fa2_sm80: the MMA atoms, layout helpers and GEMM loops
ARCHS = (Arch.SM80,)
# Every instance runs sliding windows too (the ABI's window fields around the launch's diagonal).
SLIDING_WINDOW = True
# Features its kernels read that a build from before did not: instances say so in their params, and
# the registry keeps the feature from an entry without the mark (registry.MARKS).
MARKED = ("varlen", "window")

# Axes.
DTYPES = (DType.FP16, DType.BF16)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
BLOCK_MS = (64, 128)  # query rows per step of a CTA's loop
BLOCK_NS = (64, 128)  # keys per CTA
WARPS = (4, 8)
STAGES = (1, 2)  # Q/dO buffers: 2 loads the next query tile while this one runs
SOFTCAPS = (False, True)
# Head dims whose default tiles are also built with a softcap, as fa2_sm80's forward.
SOFTCAP_DEFAULT_HEAD_DIMS = (128, 256)

# fp32 accumulator registers per thread (dK and dV, S and dP) above which nvcc spills: the
# 255-register file also holds the operand fragments, addresses and row statistics.
MAX_ACC_REGS = 192


def warp_rows(rows: int, cols: int, warps: int) -> int:
    """traits.h's warp_rows: the warps along the rows of a rows x cols GEMM output (the rest along the
    columns) that read the fewest operand elements from shared memory, each warp whole 16-row slices
    and 16-column steps; 0 where no split fits."""
    best, best_reads = 0, 0
    for r in (1, 2, 4, 8, 16):
        if r > warps or warps % r or rows % (16 * r) or cols % (16 * (warps // r)):
            continue
        reads = (warps // r) * rows + r * cols
        if best == 0 or reads <= best_reads:
            best, best_reads = r, reads
    return best


@dataclasses.dataclass(frozen=True)
class Fa2BwdSm80Instance(BothMasks, Warps, AttentionInstance):
    """One head dim; a CTA of `warps` warps owns `block_n` keys and steps through the queries
    `block_m` at a time with `stages` Q/dO buffers; both masks (the causal offset is a launch
    parameter)."""

    family = FAMILY

    dtype: DType
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    softcap: bool = False

    @property
    def name(self) -> str:
        return (f"{self.name_stem}_m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"
                + ("_sc" if self.softcap else ""))

    @property
    def smem_bytes(self) -> int:
        """traits.h's kSmemSize: Q and dO per stage, K, V, P and dS."""
        e = self.dtype.itemsize
        bm, bn, d = self.block_m, self.block_n, self.head_dim
        return (2 * self.stages * bm * d + 2 * bn * d + 2 * bm * bn) * e

    @property
    def cost_inputs(self) -> CostInputs:
        """The cost model's view of a CTA: rows are keys here (block_n per CTA), columns queries
        (block_m per step of its loop), the transpose of a forward tile."""
        return CostInputs(self.block_n, self.block_m, self.stages, self.threads, self.smem_bytes)

    def params(self) -> dict:
        """The fields, and the marks of what its kernel reads that a build from before did not
        (MARKED): variable lengths and sliding windows."""
        return {**super().params(), **{mark: True for mark in MARKED}}

    def template_values(self) -> dict:
        return {**super().template_values(), "softcap": self.softcap}


INSTANCE = Fa2BwdSm80Instance


def invalid_reason(inst: Fa2BwdSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not (traits.h's static
    asserts, the register budget and shared memory)."""
    for label, value, axis in (("head_dim", inst.head_dim, HEAD_DIMS), ("block_m", inst.block_m, BLOCK_MS),
                               ("block_n", inst.block_n, BLOCK_NS), ("warps", inst.warps, WARPS),
                               ("stages", inst.stages, STAGES)):
        if reason := axis_reason(label, value, axis):
            return reason
    d = inst.head_dim
    for rows, cols in ((inst.block_m, inst.block_n), (inst.block_n, d), (inst.block_m, d)):
        if not warp_rows(rows, cols, inst.warps):
            return f"no split of {inst.warps} warps gives each whole 16x16 steps of a {rows}x{cols} GEMM"
    rows_per_pass = inst.threads // ((64 if d % 64 == 0 else 32) // 8)
    if inst.block_m % rows_per_pass or inst.block_n % rows_per_pass:
        return f"tiles {inst.block_m}x{inst.block_n} not a multiple of the {rows_per_pass} rows a copy pass covers"
    acc = (2 * inst.block_n * d + 2 * inst.block_m * inst.block_n) // inst.threads
    if acc > MAX_ACC_REGS:
        return f"{acc} fp32 accumulators per thread exceed {MAX_ACC_REGS} (register spills)"
    return smem_reason(inst, arch)


def problem_reason(inst: Fa2BwdSm80Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can: any strides, scale,
    causal alignment, lengths (variable ones too, either alignment), GQA ratio and deterministic calls
    (dQ added in key-tile order); no dropout or bias."""
    if reason := feature_reason(FAMILY, problem, ("dropout", "bias", "kv_cache")):
        return reason
    if getattr(problem, "bias_grad", False):
        return f"{FAMILY} has no dbias"
    if problem.align < 16:
        return f"{FAMILY} needs 16-byte aligned data and strides, the problem's are {problem.align}-byte aligned"
    return None


SPACE: tuple[Fa2BwdSm80Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(Fa2BwdSm80Instance, itertools.product(DTYPES, HEAD_DIMS, BLOCK_MS, BLOCK_NS, WARPS,
                                                                        STAGES, SOFTCAPS))
    if invalid_reason(inst) is None
)

# Default tile per head dim (block_m, block_n, warps, stages), from `gemmgen profile --backward` over
# the space on an H100 (bf16, FlashAttention's sweep shapes at N 1024 and 4096, bench/NOTES.md 81):
# one Q/dO buffer ran 0-4% faster than two everywhere (the next tile loads under dQ's GEMM either
# way); 128 queries by 128 keys won at d64 (2-3% over 64 x 128), 64 x 128 at d128 (9-16% over the
# next), 64 x 64 above, where dK and dV take more registers.
DEFAULT_TILE = {32: (128, 128, 8, 1), 64: (128, 128, 8, 1), 96: (64, 128, 8, 1), 128: (64, 128, 8, 1),
                160: (64, 64, 8, 1), 192: (64, 64, 8, 1), 256: (64, 64, 8, 1)}

DEFAULT: tuple[Fa2BwdSm80Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.block_m, inst.block_n, inst.warps, inst.stages) == DEFAULT_TILE[inst.head_dim]
    and (not inst.softcap or inst.head_dim in SOFTCAP_DEFAULT_HEAD_DIMS)
)

# Throughput per unit of the cost model's tile work against fa2_sm80's forward. Measured on an H100
# (NOTES 81): 0.5-0.55x fmha_bwd_sm90's rate at d128 (whose figure is 1.8) and 1.9-5.9x
# mea_bwd_sm80's (0.2) kind of kernel, so Hopper keeps fmha_bwd_sm90 where it has a tile and pads d96
# to its 128 (1.8 x 96 / 128 > 0.9).
RELATIVE_SPEED = 0.9
