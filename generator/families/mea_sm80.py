"""Memory-efficient attention forward (CUTLASS example 41's `AttentionKernel`, xFormers' kernel) for
Ampere-class GPUs: the family that runs dropout, an additive bias and variable lengths.

One instance = one `AttentionKernel` instantiation (included from the CUTLASS package, never
copied) behind our own block set-up and launch (templates/include/gemmgen/mea_sm80/). An instance
serves every head dim up to its bound `max_head_dim` (a multiple of 8) and both masks (causal is a
launch parameter), so it fixes neither `head_dim` nor `mask` (both None) and its params carry neither:
`problem_reason` checks them. The family serves every multiple of 8 up to the largest bound (HEAD_DIMS).

`gemmgen generate` builds this family only when named (`--family mea_sm80`, BUILT_BY_DEFAULT is
False): the default sm80 set (the fa2_sm80 family) already takes most of the 15 minutes a 2-core
machine may spend. The registry compiles a missing instance on demand, the first of `SPACE` that fits.
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import AttentionInstance, BoundedHeadDim, DType, Warps

FAMILY = "mea_sm80"
KIND = "attention"
BUILT_BY_DEFAULT = False  # see the module doc
TEMPLATE = "mea_sm80.cu.jinja"
HEADER_DIRS = ("mea_sm80", "philox")
ARCHS = (Arch.SM80,)

# Axes. Tiles: kQueriesPerBlock x kKeysPerBlock, one 32x32 warp tile per warp. kKeysPerBlock 256
# does not instantiate (a CUTLASS thread map gets zero iterations). A bound above block_n keeps the
# output in a float32 workspace between key blocks instead of in registers.
DTYPES = (DType.FP16, DType.BF16)
# Ascending bounds and the 32x128 tile first: on-demand compilation builds the first instance of
# SPACE that runs a problem, so it gets the smallest bound and xFormers' sm80 tile.
MAX_HEAD_DIMS = (64, 128, 256)
BLOCK_MS = (32, 64, 128)
BLOCK_NS = (128, 64)
# 16-byte aligned data only: gemmgen.fused_attention requires 16-byte aligned pointers and strides
# (gemmgen.ops.attention), so an unaligned variant (4-element loads) would never be selected.
ALIGNED = (True,)

HEAD_DIM_MULTIPLE = 8  # 16-byte vector loads of 2-byte elements along the head dim
MAX_WARPS = 16  # the kernel's launch bounds ask for 16 warps per SM on sm80
GRID_YZ_MAX = 65535  # heads run on grid.y (batches are chunked over grid.z by the launcher)
# What the family serves: every multiple of HEAD_DIM_MULTIPLE up to the largest bound.
HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, max(MAX_HEAD_DIMS) + 1, HEAD_DIM_MULTIPLE))


@dataclasses.dataclass(frozen=True)
class MeaSm80Instance(BoundedHeadDim, Warps, AttentionInstance):
    """One AttentionKernel: every head dim up to `max_head_dim` and both masks (it fixes neither),
    `block_m` queries by `block_n` keys per block, one 32x32 warp tile per warp."""

    family = FAMILY

    dtype: DType
    max_head_dim: int  # kMaxK
    block_m: int  # queries per block
    block_n: int  # keys per block
    aligned: bool = True

    @property
    def name(self) -> str:
        return f"{self.tile_stem}_{'aligned' if self.aligned else 'unaligned'}"

    @property
    def smem_bytes(self) -> int:
        return SMEM_BYTES.get((self.block_m, self.block_n, self.max_head_dim), 0)

    def template_values(self) -> dict:
        return {**super().template_values(), "aligned_cpp": "true" if self.aligned else "false"}


INSTANCE = MeaSm80Instance


# sizeof(AttentionKernel<..., block_m, block_n, max_head_dim, dropout, bias>::SharedStorage) for
# every tile of the space (the same for fp16 and bf16), as nvcc 13 / CUTLASS 4.2 lay it out;
# the compile test checks the built instance's _info against it.
SMEM_BYTES: dict[tuple[int, int, int], int] = {
    (32, 64, 64): 13568,
    (32, 64, 128): 25344,
    (32, 64, 256): 25344,
    (32, 128, 64): 42496,
    (32, 128, 128): 42496,
    (32, 128, 256): 51200,
    (64, 64, 64): 18944,
    (64, 64, 128): 34304,
    (64, 64, 256): 34304,
    (64, 128, 64): 52224,
    (64, 128, 128): 52224,
    (64, 128, 256): 69632,
    (128, 64, 64): 29696,
    (128, 64, 128): 52224,
    (128, 64, 256): 52224,
    (128, 128, 64): 71680,
    (128, 128, 128): 71680,
    (128, 128, 256): 106496,
}


def invalid_reason(inst: MeaSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := inst.tile_reason(MAX_HEAD_DIMS, BLOCK_MS, BLOCK_NS):
        return reason
    if inst.aligned not in ALIGNED:
        return "unaligned variant not built (gemmgen passes 16-byte aligned data only)"
    if inst.warps > MAX_WARPS:
        return f"{inst.warps} warps exceed {MAX_WARPS}"
    if inst.block_m % inst.warps:
        return f"block_m {inst.block_m} is not a multiple of its {inst.warps} warps (softmax rows per warp)"
    return inst.measured_smem_reason(arch, f"tile {inst.block_m}x{inst.block_n}, bound {inst.max_head_dim}")


def problem_reason(inst: MeaSm80Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can."""
    if reason := inst.bound_reason(problem, HEAD_DIM_MULTIPLE):
        return reason
    if inst.aligned and problem.align < 16:
        return f"aligned variant needs 16-byte aligned data, the problem's is {problem.align}-byte aligned"
    if problem.zero_scale:
        return "scale 0 gave a wrong LSE on the H200 (rows reported as seeing no key)"
    if problem.varlen and problem.causal and problem.causal_alignment != "top_left":
        return ("variable lengths run causal top-left only (the C ABI has one causal offset, "
                "not one per sequence)")
    # Row offsets inside one (batch, head) are 32-bit products in the kernel (key row x stride);
    # the whole-tensor extent bounds them.
    if problem.max_offset >= 2**31:
        return f"element offsets up to {problem.max_offset} exceed int32 (the kernel's row indexing)"
    return None


SPACE: tuple[MeaSm80Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(MeaSm80Instance,
                                  itertools.product(DTYPES, MAX_HEAD_DIMS, BLOCK_MS, BLOCK_NS, ALIGNED))
    if invalid_reason(inst) is None
)

# `gemmgen generate --family mea_sm80` builds these: xFormers' choices for sm80 (64x64 up to head
# dim 64, 32x128 above), the bound 256 keeping its output in a workspace.
DEFAULT_TILE = {64: (64, 64), 128: (32, 128), 256: (32, 128)}
DEFAULT: tuple[MeaSm80Instance, ...] = tuple(
    inst for inst in SPACE if (inst.block_m, inst.block_n) == DEFAULT_TILE[inst.max_head_dim]
)

# Throughput per unit of tile work against fa2_sm80's on the H200 sweep (the heuristic's weight
# between families): 140-190 against 260-350 TFLOP/s.
RELATIVE_SPEED = 0.5
