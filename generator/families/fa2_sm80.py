"""The project's own Ampere-class fused attention forward (FlashAttention-2 style, CuTe).

One instance = one template instantiation = one .cu file = one library. The whole space
is `SPACE` below: the axis lists crossed, filtered by `invalid_reason`. `DEFAULT` is the
subset `gemmgen generate` builds without `--all`: one tile per (dtype, head_dim, mask).
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import (ADDED, AttentionInstance, DType, Mask, QKVStages, Warps, axis_reason,
                                             feature_reason, smem_reason)

FAMILY = "fa2_sm80"
KIND = "attention"
BUILT_BY_DEFAULT = True
TEMPLATE = "fa2_sm80.cu.jinja"
HEADER_DIRS = ("fa2_sm80",)
ARCHS = (Arch.SM80,)
RELATIVE_SPEED = 1.0  # the unit of the heuristic's weights between families
# Features its kernel reads that a build from before did not: instances say so in their params, and
# the registry keeps the feature from an entry without the mark (registry.MARKS).
MARKED = ("varlen",)

# Axes.
DTYPES = (DType.FP16, DType.BF16)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
MASKS = tuple(Mask)
BLOCK_MS = (64, 128)
BLOCK_NS = (32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2)  # K/V pipeline: 1 = one K and one V buffer alternating, 2 = both double-buffered
SOFTCAPS = (False, True)
# Head dims whose default tiles are also built with a softcap: Gemma 2's (256, and 128 in its
# largest model) and Grok-1's (128).
SOFTCAP_DEFAULT_HEAD_DIMS = (128, 256)

# fp32 accumulator registers per thread (O tile + score tile) above which nvcc spills:
# the 255-register file also holds the Q/K fragments, addresses and softmax state.
MAX_ACC_REGS = 192


@dataclasses.dataclass(frozen=True)
class Fa2Sm80Instance(QKVStages, Warps, AttentionInstance):
    """One CTA of `warps` warps computes `block_m` query rows of one (batch, head) for one head dim
    and mask, over key tiles of `block_n` keys with `stages` K/V buffers (STAGES); O is staged
    through the Q tile's shared memory."""

    family = FAMILY

    dtype: DType
    head_dim: int
    mask: Mask
    block_m: int
    block_n: int
    warps: int
    stages: int = 1
    # A logit softcap (a launch parameter, > 0): the scaled scores s become c * tanh(s / c) before the
    # mask. Such an instance runs softcap calls only, the others none (suffix `_sc`).
    softcap: bool = dataclasses.field(default=False, metadata={ADDED: True})

    @property
    def name(self) -> str:
        return (f"{self.name_stem}_m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"
                + ("_sc" if self.softcap else ""))

    def params(self) -> dict:
        """The fields, and the mark of what its kernel reads that a build from before did not
        (MARKED): variable lengths."""
        return {**super().params(), **{mark: True for mark in MARKED}}

    def template_values(self) -> dict:
        return {**super().template_values(), "causal": self.causal, "local": self.mask is Mask.LOCAL,
                "softcap": self.softcap}


INSTANCE = Fa2Sm80Instance


def smem_k_block(head_dim: int) -> int:
    """Width of one swizzled shared-memory row chunk (kBlockKSmem in the C++ traits)."""
    return 64 if head_dim % 64 == 0 else 32


def invalid_reason(inst: Fa2Sm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := axis_reason("head_dim", inst.head_dim, HEAD_DIMS) or axis_reason("stages", inst.stages, STAGES):
        return reason
    if inst.block_m % (16 * inst.warps):
        return f"block_m {inst.block_m} is not a multiple of 16 rows x {inst.warps} warps"
    # The global->shared copy moves 16 bytes per thread; a pass covers `rows_per_pass` rows.
    threads_per_row = smem_k_block(inst.head_dim) // 8
    rows_per_pass = inst.threads // threads_per_row
    if inst.block_n % rows_per_pass or inst.block_m % rows_per_pass:
        return (f"tiles {inst.block_m}x{inst.block_n} not a multiple of the {rows_per_pass} rows "
                f"{inst.threads} threads copy per pass")
    acc = (inst.block_m * inst.head_dim + inst.block_m * inst.block_n) // inst.threads
    if acc > MAX_ACC_REGS:
        return f"{acc} fp32 accumulators per thread exceed {MAX_ACC_REGS} (register spills)"
    return smem_reason(inst, arch)


def problem_reason(inst: Fa2Sm80Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can: this family runs
    any strides, GQA ratio, scale, causal alignment and length, variable lengths (gemmgen/sequence.h)
    in either alignment, but no dropout, bias or key-value cache."""
    return feature_reason(FAMILY, problem, ("dropout", "bias", "kv_cache"))


SPACE: tuple[Fa2Sm80Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(Fa2Sm80Instance, itertools.product(DTYPES, HEAD_DIMS, MASKS, BLOCK_MS, BLOCK_NS,
                                                                     WARPS, STAGES, SOFTCAPS))
    if invalid_reason(inst) is None
)

# Default tile per head dim (block_m, block_n, warps, stages): FlashAttention-2's choices for
# Ampere-class parts, except d64 where 128x64 beat 128x128 at every N of the H200 sweep
# (bench/NOTES.md, experiment 3).
DEFAULT_TILE = {32: (128, 128, 4, 1), 64: (128, 64, 4, 1), 96: (128, 64, 4, 1), 128: (128, 64, 4, 1),
                160: (128, 32, 4, 1), 192: (128, 64, 8, 1), 256: (128, 64, 8, 1)}

DEFAULT: tuple[Fa2Sm80Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.block_m, inst.block_n, inst.warps, inst.stages) == DEFAULT_TILE[inst.head_dim]
    and (not inst.softcap or inst.head_dim in SOFTCAP_DEFAULT_HEAD_DIMS)
)
