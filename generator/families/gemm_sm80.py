"""Batched GEMM for Ampere-class GPUs (and Hopper, through the sm_90 code the sm80 arch also
builds): CUTLASS 2.x GemmUniversal in batched mode (strided strategy) or array mode (pointer-array
strategy), C = alpha * A * op(B), fp16/bf16 in, fp32 accumulation.

One instance = one .cu = one library. `SPACE` is the axis lists crossed, filtered by
`invalid_reason`; `DEFAULT` is what `gemmgen generate --family gemm_sm80` builds without --all.
"""
from __future__ import annotations

import dataclasses
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import DType, GemmInstance, Strategy, Warps, axis_reason, smem_reason

FAMILY = "gemm_sm80"
KIND = "gemm"
HEADER_DIRS = ("gemm_sm80", "gemm")  # under templates/include/gemmgen/: its build key covers them
BUILT_BY_DEFAULT = False  # built when named: gemmgen generate --family gemm_sm80
TEMPLATE = "gemm_sm80.cu.jinja"
ARCHS = (Arch.SM80,)

# Axes (gemm_sm90 shares the first four).
DTYPES = (DType.FP16, DType.BF16)  # inputs; FP32 is an output dtype only
OUT_FP32 = (False, True)  # C in the input dtype, or fp32 (the unfused path's scores)
B_TRANSPOSED = (False, True)  # B stored [K, N] (scores x V) or [N, K] (Q x K^T): a layout axis
STRATEGIES = tuple(Strategy)
TILE_MS = (64, 128, 256)
TILE_NS = (64, 128, 256)
TILE_KS = (32, 64)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5)
ALIGNS = (8, 1)  # elements; 8 = 16-byte vectors (cp.async), 1 = any stride (2-stage, plain loads)

WARP_TILES = (32, 64)  # per-warp M and N extents CUTLASS's sm80 warp-level MMA tiles well


@dataclasses.dataclass(frozen=True)
class GemmSm80Instance(Warps, GemmInstance):
    """GemmInstance's fields, then the CTA's warps, the mainloop's stages and the alignment."""

    family = FAMILY

    warps: int
    stages: int
    align: int

    @property
    def name(self) -> str:
        return f"{self.name_stem}w{self.warps}s{self.stages}a{self.align}"

    @property
    def warps_mn(self) -> tuple[int, int]:
        """Warp grid (M, N): 4 warps as 2x2; 8 warps split the longer tile side four ways."""
        if self.warps == 4:
            return 2, 2
        return (4, 2) if self.tile_m > self.tile_n else (2, 4)

    @property
    def smem_bytes(self) -> int:
        """The mainloop's A and B tiles per stage (the epilogue reuses that space)."""
        return self.stages * self.stage_bytes

    def params(self) -> dict:
        """GemmInstance's, this family's fields, and the derived `align_c`."""
        return {**self.gemm_params(), "warps": self.warps, "stages": self.stages, "align": self.align,
                "align_c": self.align_c}

    def template_values(self) -> dict:
        wm, wn = self.warps_mn
        return {**super().template_values(), "warps_m": wm, "warps_n": wn}


INSTANCE = GemmSm80Instance


def invalid_reason(inst: GemmSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := axis_reason("input dtype", inst.dtype, DTYPES) or axis_reason("alignment", inst.align, ALIGNS):
        return reason
    if (inst.align == 1) != (inst.stages == 2):
        return "alignment 1 runs the 2-stage mainloop only, alignment 8 the cp.async one (3+ stages)"
    wm, wn = inst.warps_mn
    if inst.tile_m % wm or inst.tile_n % wn or inst.tile_m // wm not in WARP_TILES \
            or inst.tile_n // wn not in WARP_TILES:
        return f"warp tile {inst.tile_m // wm}x{inst.tile_n // wn} not in {WARP_TILES}^2"
    # Each thread of the global->shared copy moves one vector per pass over a (tile, tile_k) slab.
    vectors = min(inst.tile_m, inst.tile_n) * inst.tile_k // max(inst.align, 8)
    if vectors % inst.threads:
        return f"{inst.threads} threads do not divide the {vectors} vectors of a {inst.tile_k}-deep slab"
    return smem_reason(inst, arch)


def problem_reason(inst: GemmSm80Instance, problem) -> str | None:
    """What a built instance cannot run beyond the functional key (gemmgen.select.gemm_select checks
    dtype, layout, strategy and alignment): nothing, CUTLASS's batched GEMM loops over any K."""
    return None


SPACE: tuple[GemmSm80Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(GemmSm80Instance, itertools.product(
        DTYPES, OUT_FP32, B_TRANSPOSED, STRATEGIES, TILE_MS, TILE_NS, TILE_KS, WARPS, STAGES, ALIGNS))
    if invalid_reason(inst) is None
)

# Per (dtype, output, layout, strategy): CUTLASS's usual sm80 fp16 tile, 128x128x32 with 4
# stages (64 KB of shared memory, two blocks per SM), and 64x64x32 at alignment 1 for odd
# strides and extents.
DEFAULT_TILES = {(128, 128, 32, 4, 4, 8), (64, 64, 32, 4, 2, 1)}

DEFAULT: tuple[GemmSm80Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.tile_m, inst.tile_n, inst.tile_k, inst.warps, inst.stages, inst.align) in DEFAULT_TILES
)
