"""Split-KV decode attention for Ampere-class GPUs and later (runs on sm_90 too): few query rows
against many keys, at the memory-bandwidth limit.

One CTA computes a row tile of `block_m` packed rows, the query heads of one KV group times their
query rows (GQA packing), against one split of the sequence's keys; `num_splits` CTAs share a row
tile's keys and a combine kernel merges their fp32 partial outputs by their LSEs. K and V are read
through per-row addresses, so one instance serves contiguous caches, paged caches (a block table)
and per-sequence key counts (`seqlens_k`), and both masks (the causal offset is a launch parameter,
bottom-right against each sequence's own length with `seqlens_k`). The registry picks the number of
splits per shape (gemmgen.select.heuristic.num_splits). The MMA tiles and the online softmax are
fa2_sm80's (templates/include/gemmgen/fa2_sm80/).
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import (AttentionInstance, BothMasks, CostInputs, DType, QKVStages, Warps,
                                             axis_reason, feature_reason, smem_reason)

FAMILY = "decode_sm80"
KIND = "attention"
BUILT_BY_DEFAULT = True
TEMPLATE = "decode_sm80.cu.jinja"
HEADER_DIRS = ("decode_sm80", "fa2_sm80")
ARCHS = (Arch.SM80,)
# fa2_sm80's MMA tiles and softmax, at half the weight: the cost model counts tile work, not the K/V
# bytes this family saves, so near a tie a prefill shape stays with the prefill families, while
# decode shapes (few rows per KV head) still estimate several times faster here.
RELATIVE_SPEED = 0.5
PACKS_GQA = True  # a row tile packs a KV group's query heads; keys split over CTAs (heuristic.estimate)
# Every instance runs a sliding window too (the ABI's window fields; its key splits start at the
# first row's first visible key). Its params say so ("window"), as a build from before did not.
SLIDING_WINDOW = True
MARKED = ("window",)  # the mark its params carry (registry.MARKS)

# Axes.
DTYPES = (DType.FP16, DType.BF16)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
BLOCK_NS = (32, 64, 128)
WARPS_M = (1, 2, 4)  # warps over the row tile's 16-row slices: block_m = 16 * warps_m packed rows
WARPS_N = (1, 2, 4)  # warps over each key tile's keys, merged after the key loop
MAX_WARPS = 8
STAGES = (2, 3, 4)  # K/V tile pairs in shared memory: stages - 1 load while one computes

MAX_ACC_REGS = 192  # as fa2_sm80: fp32 accumulators per thread above which nvcc spills


@dataclasses.dataclass(frozen=True)
class DecodeSm80Instance(BothMasks, QKVStages, Warps, AttentionInstance):
    """A CTA of warps_m x warps_n warps computes `block_m` = 16 * warps_m packed (query head, query
    row) rows of one KV head against one split of its keys, `block_n` keys per step shared out over
    warps_n warps, `stages` K/V tile pairs in flight (the merge's scratch reuses their shared
    memory)."""

    family = FAMILY

    dtype: DType
    head_dim: int
    block_n: int
    warps_m: int
    warps_n: int
    stages: int

    @property
    def block_m(self) -> int:
        """Packed rows per CTA: one 16-row MMA slice per row of warps."""
        return 16 * self.warps_m

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def name(self) -> str:
        return f"{self.name_stem}_m{self.block_m}n{self.block_n}w{self.warps_m}x{self.warps_n}s{self.stages}"

    def params(self) -> dict:
        """The fields, and `window`: the instance reads the ABI's window fields (SLIDING_WINDOW), which
        an instance built before them did not; the registry keeps windows from an entry without it."""
        return {**super().params(), **{mark: True for mark in MARKED}}

    @property
    def cost_inputs(self) -> CostInputs:
        # Registers per thread as ptxas gave the bf16 d128 tiles for sm_90 (cuobjdump -res-usage on
        # an H100 build): 168 with 16 or 32 rows, 201 with 64 (allocated in steps of 8).
        regs = 208 if self.warps_m == 4 else 168
        return CostInputs(self.block_m, self.block_n, self.stages, self.threads, self.smem_bytes, regs)


INSTANCE = DecodeSm80Instance


def invalid_reason(inst: DecodeSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := (axis_reason("head_dim", inst.head_dim, HEAD_DIMS) or axis_reason("stages", inst.stages, STAGES)
                  or axis_reason("block_n", inst.block_n, BLOCK_NS) or axis_reason("warps_m", inst.warps_m, WARPS_M)
                  or axis_reason("warps_n", inst.warps_n, WARPS_N)):
        return reason
    if inst.warps > MAX_WARPS:
        return f"{inst.warps} warps exceed {MAX_WARPS}"
    if inst.block_n % (16 * inst.warps_n):
        return f"block_n {inst.block_n} does not give each of {inst.warps_n} warps a multiple of 16 keys"
    scratch = inst.warps * 16 * (inst.head_dim + 2) * 4
    if scratch > 2 * inst.stages * inst.block_n * inst.head_dim * inst.dtype.itemsize:
        return f"the merge's {scratch} B of fp32 rows exceed the K/V stages' shared memory"
    acc = 16 * inst.head_dim // 32 + 16 * (inst.block_n // inst.warps_n) // 32
    if acc > MAX_ACC_REGS:
        return f"{acc} fp32 accumulators per thread exceed {MAX_ACC_REGS} (register spills)"
    return smem_reason(inst, arch)


def problem_reason(inst: DecodeSm80Instance, problem) -> str | None:
    """What a built instance cannot run, None when it can: any strides, GQA ratio, scale, causal
    alignment, sliding window and length, key-value caches (paged or not, per-sequence lengths); no
    dropout, bias or packed variable lengths."""
    return feature_reason(FAMILY, problem, ("dropout", "bias", "varlen"))


SPACE: tuple[DecodeSm80Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(DecodeSm80Instance,
                                  itertools.product(DTYPES, HEAD_DIMS, BLOCK_NS, WARPS_M, WARPS_N, STAGES))
    if invalid_reason(inst) is None
)

# Default tiles (block_n, warps_m, warps_n, stages) per head dim LLM serving runs: 16 rows with four
# warps splitting the keys (a KV group of up to 16 query heads, one query row) and 64 rows with four
# warps splitting the rows (speculative decoding, large groups); bench/NOTES.md, 50. At d64 the
# 16-row tile takes 128-key tiles: a 64-key tile moves only 16 KB of K and V per step, and the
# 128-key one was 2-25% faster at every shape timed (experiment 61); at d128 it was slower.
DEFAULT_TILES = {64: ((128, 1, 4, 2), (64, 4, 1, 2)), 128: ((64, 1, 4, 2), (64, 4, 1, 2))}
DEFAULT_HEAD_DIMS = tuple(DEFAULT_TILES)

DEFAULT: tuple[DecodeSm80Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.block_n, inst.warps_m, inst.warps_n, inst.stages) in DEFAULT_TILES.get(inst.head_dim, ())
)
