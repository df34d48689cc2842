"""Memory-efficient attention backward (CUTLASS example 41's `AttentionBackwardKernel`, xFormers'
kernel) for Ampere-class GPUs: dQ, dK, dV (and dBias) of the mea_sm80 / fa2_sm80 / fmha_sm90
forwards, with dropout (the forward mea_sm80's Philox mask, regenerated), an additive bias, variable
lengths and a deterministic mode.

One instance = one `AttentionBackwardKernel` instantiation (included from the CUTLASS package, never
copied) behind our own block set-up and launch (templates/include/gemmgen/mea_bwd_sm80/). An instance
serves every head dim up to its bound `max_head_dim` (a multiple of 8) and both masks (the causal
offset is a launch parameter), so it fixes neither `head_dim` nor `mask` (both None); `problem_reason`
checks them. The sm80 code is built for sm_90 as well (Arch.SM80's gencode), so Hopper runs it too.

Axes: the block of `block_m` queries (kBlockSizeI) by `block_n` keys (kBlockSizeJ), one 32x32 warp
tile per warp; `preload` (kPreload: the next GEMM's operands load while the current one runs, only
where dK and dV stay in registers, max_head_dim <= block_m); `dropout` (kApplyDropout: a dropout
instance keeps the keep-mask tile in shared memory and draws the mask; the dropout-free one runs
problems without dropout only, and the other way round, so a call never pays for the other's code).
The kernel is built for 16-byte aligned data only (kIsAligned): gemmgen passes nothing else.
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import DROPOUT_MAX_SCORES, AttentionInstance, BoundedHeadDim, DType, Warps

FAMILY = "mea_bwd_sm80"
KIND = "attention_bwd"
BUILT_BY_DEFAULT = True
TEMPLATE = "mea_bwd_sm80.cu.jinja"
# mea_sm80: the Philox generator and its (seed, offset) stand-ins the dropout mask comes from.
HEADER_DIRS = ("mea_bwd_sm80", "mea_sm80", "philox")
ARCHS = (Arch.SM80,)

DTYPES = (DType.FP16, DType.BF16)
MAX_HEAD_DIMS = (64, 128, 256)
BLOCK_MS = (64, 128)  # queries per block (kBlockSizeI)
BLOCK_NS = (64, 128)  # keys per block (kBlockSizeJ)
PRELOADS = (True, False)
DROPOUTS = (False, True)

HEAD_DIM_MULTIPLE = 8  # 16-byte vectors of 2-byte elements along the head dim
# What the family serves: every multiple of HEAD_DIM_MULTIPLE up to the largest bound.
HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, max(MAX_HEAD_DIMS) + 1, HEAD_DIM_MULTIPLE))
# The dropout mask's generator position of weight (i, j) is computed in 32-bit arithmetic by the
# kernel (row * seqlen_k + key): seqlen_q * seqlen_k stays below 2^31 (base.DROPOUT_MAX_SCORES).


@dataclasses.dataclass(frozen=True)
class MeaBwdSm80Instance(BoundedHeadDim, Warps, AttentionInstance):
    """One AttentionBackwardKernel: every head dim up to `max_head_dim` and both masks (it fixes
    neither), `block_m` queries by `block_n` keys per step, one 32x32 warp tile per warp."""

    family = FAMILY

    dtype: DType
    max_head_dim: int  # kMaxK
    block_m: int  # kBlockSizeI: queries per step
    block_n: int  # kBlockSizeJ: keys per block (the key blocks are spread over the CTAs)
    preload: bool  # kPreload
    dropout: bool  # kApplyDropout

    @property
    def name(self) -> str:
        return f"{self.tile_stem}{'_preload' if self.preload else ''}{'_dropout' if self.dropout else ''}"

    @property
    def keeps_grads_in_registers(self) -> bool:
        """kOutputInRF: dK and dV of a key block stay in registers (else in a float32 workspace)."""
        return self.max_head_dim <= self.block_m

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch: the kernel's storage, and the dropout stream after it."""
        storage = SMEM_BYTES.get((self.block_m, self.block_n, self.max_head_dim, self.preload, self.dropout), 0)
        return storage + DROPOUT_STREAM_BYTES if storage and self.dropout else storage

    def template_values(self) -> dict:
        return {**super().template_values(), "preload_cpp": "true" if self.preload else "false",
                "dropout_cpp": "true" if self.dropout else "false"}


INSTANCE = MeaBwdSm80Instance


# A dropout instance's seed and first Philox position, after the kernel's storage (kernel.h).
DROPOUT_STREAM_BYTES = 16

# sizeof(AttentionBackwardKernel<Sm80, half, aligned, dropout, preload, block_m, block_n,
# max_head_dim>::SharedStorage), keyed (block_m, block_n, max_head_dim, preload, dropout), the same
# for fp16 and bf16, as nvcc 13 / CUTLASS 4.2 lay it out; the compile test checks the built
# instance's _info against it. Preload exists only where max_head_dim <= block_m.
SMEM_BYTES: dict[tuple[int, int, int, bool, bool], int] = {
    (64, 64, 64, False, False): 27904, (64, 64, 64, False, True): 27904,
    (64, 64, 64, True, False): 44288, (64, 64, 64, True, True): 52480,
    (64, 64, 128, False, False): 34048, (64, 64, 128, False, True): 34048,
    (64, 64, 256, False, False): 34048, (64, 64, 256, False, True): 34048,
    (64, 128, 64, False, False): 60672, (64, 128, 64, False, True): 60672,
    (64, 128, 64, True, False): 85248, (64, 128, 64, True, True): 96512,
    (64, 128, 128, False, False): 60672, (64, 128, 128, False, True): 60672,
    (64, 128, 256, False, False): 60672, (64, 128, 256, False, True): 60672,
    (128, 64, 64, False, False): 60928, (128, 64, 64, False, True): 60928,
    (128, 64, 64, True, False): 87552, (128, 64, 64, True, True): 92672,
    (128, 64, 128, False, False): 60928, (128, 64, 128, False, True): 60928,
    (128, 64, 128, True, False): 91648, (128, 64, 128, True, True): 96768,
    (128, 64, 256, False, False): 60928, (128, 64, 256, False, True): 60928,
    (128, 128, 64, False, False): 104960, (128, 128, 64, False, True): 104960,
    (128, 128, 64, True, False): 145920, (128, 128, 64, True, True): 154112,
    (128, 128, 128, False, False): 104960, (128, 128, 128, False, True): 104960,
    (128, 128, 128, True, False): 154112, (128, 128, 128, True, True): 162304,
    (128, 128, 256, False, False): 104960, (128, 128, 256, False, True): 104960,
}


def invalid_reason(inst: MeaBwdSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := inst.tile_reason(MAX_HEAD_DIMS, BLOCK_MS, BLOCK_NS):
        return reason
    if inst.preload and not inst.keeps_grads_in_registers:
        return (f"preload needs dK and dV in registers: max_head_dim {inst.max_head_dim} is above "
                f"block_m {inst.block_m}")
    return inst.measured_smem_reason(arch, inst.name)


def problem_reason(inst: MeaBwdSm80Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can."""
    if reason := inst.bound_reason(problem, HEAD_DIM_MULTIPLE):
        return reason
    if problem.align < 16:
        return f"needs 16-byte aligned data, the problem's is {problem.align}-byte aligned"
    if problem.gqa != 1:
        return f"K and V need Q's heads (GQA ratio {problem.gqa}: the caller expands them)"
    if problem.dropout and not inst.dropout:
        return "built without dropout (a dropout instance runs it)"
    if inst.dropout and not problem.dropout:
        return "built for dropout (the dropout-free instance runs a problem without it faster)"
    if problem.dropout and problem.seqlen_q * problem.seqlen_k > DROPOUT_MAX_SCORES:
        return (f"dropout over {problem.seqlen_q} x {problem.seqlen_k} scores: the kernel's mask positions "
                f"are 32-bit (at most {DROPOUT_MAX_SCORES})")
    if problem.varlen and problem.causal and problem.causal_alignment != "top_left":
        return ("variable lengths run causal top-left only (the C ABI has one causal offset, "
                "not one per sequence)")
    if getattr(problem, "bias_grad", False) and problem.seqlen_k % HEAD_DIM_MULTIPLE:
        return (f"dBias rows of {problem.seqlen_k} keys: the kernel stores 8-key vectors, so dBias needs "
                f"seqlen_k a multiple of {HEAD_DIM_MULTIPLE}")
    # Row offsets inside one (batch, head) are 32-bit products in the kernel (row x stride); the
    # whole-tensor extent bounds them.
    if problem.max_offset >= 2**31:
        return f"element offsets up to {problem.max_offset} exceed int32 (the kernel's row indexing)"
    return None


# Per bound, the tiles in preference order: xFormers' sm80 choices first (64x64 with preload up to
# head dim 64, 128x128 with preload up to 128, 128x64 above, where dK and dV live in a workspace).
# On-demand compilation builds the first instance of SPACE that runs a problem, so SPACE follows
# this order within each dtype, bound and dropout.
PREFERRED: dict[int, tuple[tuple[int, int, bool], ...]] = {
    64: ((64, 64, True), (64, 64, False), (128, 64, True), (64, 128, True), (128, 128, True),
         (128, 64, False), (64, 128, False), (128, 128, False)),
    128: ((128, 128, True), (128, 64, True), (128, 128, False), (128, 64, False), (64, 64, False),
          (64, 128, False)),
    256: ((128, 64, False), (64, 64, False), (128, 128, False), (64, 128, False)),
}

SPACE: tuple[MeaBwdSm80Instance, ...] = tuple(
    inst
    for dtype, bound, dropout in itertools.product(DTYPES, MAX_HEAD_DIMS, DROPOUTS)
    for inst in (MeaBwdSm80Instance(dtype, bound, bm, bn, pre, dropout) for bm, bn, pre in PREFERRED[bound])
    if invalid_reason(inst) is None
)

# `gemmgen generate` builds these: the first (preferred) tile of each bound, without dropout (a
# dropout problem compiles its instance on demand, or `--family mea_bwd_sm80 --all` builds them).
DEFAULT: tuple[MeaBwdSm80Instance, ...] = tuple(
    MeaBwdSm80Instance(dtype, bound, *PREFERRED[bound][0], dropout=False)
    for dtype, bound in itertools.product(DTYPES, MAX_HEAD_DIMS)
)

# Throughput per unit of the cost model's tile work against fa2_sm80's forward: an estimate, not a
# measurement (the forward mea_sm80's 0.5 over the backward's 2.5 times the GEMM work per tile).
RELATIVE_SPEED = 0.2
