"""Batched GEMM for Ampere-class GPUs (and Hopper, through the sm_90 code the sm80 arch also
builds): CUTLASS 2.x GemmUniversal in batched mode (strided strategy) or array mode (pointer-array
strategy), C = alpha * A * op(B), fp16/bf16 in, fp32 accumulation.

One instance = one .cu = one library. `SPACE` is the axis lists crossed, filtered by
`invalid_reason`; `DEFAULT` is what `gemmgen generate --family gemm_sm80` builds without --all.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import DType, GemmInstance

FAMILY = "gemm_sm80"
KIND = "gemm"
HEADER_DIRS = ("gemm_sm80", "gemm")  # under templates/include/gemmgen/: its build key covers them
BUILT_BY_DEFAULT = False  # built when named: gemmgen generate --family gemm_sm80
TEMPLATE = "gemm_sm80.cu.jinja"
ARCHS = (Arch.SM80,)


class Strategy(enum.Enum):
    STRIDED = "strided"
    PTR_ARRAY = "ptr"


# The one table from Strategy to its C++ spellings: the run function, the ABI's args struct, its tag.
STRATEGY_CPP = {Strategy.STRIDED: ("strided", "GemmgenBatchedGemmStridedArgs", "GEMMGEN_GEMM_STRIDED"),
                Strategy.PTR_ARRAY: ("ptrs", "GemmgenBatchedGemmPtrArgs", "GEMMGEN_GEMM_PTR_ARRAY")}

# Axes.
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
class GemmSm80Instance(GemmInstance):
    dtype: DType
    out_fp32: bool
    b_transposed: bool
    strategy: Strategy
    tile_m: int
    tile_n: int
    tile_k: int
    warps: int
    stages: int
    align: int

    family = FAMILY

    @property
    def name(self) -> str:
        out = "f32" if self.out_fp32 else self.dtype.value
        layout = "nt" if self.b_transposed else "nn"
        return (f"{FAMILY}_{self.strategy.value}_{self.dtype.value}_{out}_{layout}"
                f"_m{self.tile_m}n{self.tile_n}k{self.tile_k}w{self.warps}s{self.stages}a{self.align}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def warps_mn(self) -> tuple[int, int]:
        """Warp grid (M, N): 4 warps as 2x2; 8 warps split the longer tile side four ways."""
        if self.warps == 4:
            return 2, 2
        return (4, 2) if self.tile_m > self.tile_n else (2, 4)

    @property
    def smem_bytes(self) -> int:
        """The mainloop's A and B tiles per stage (the epilogue reuses that space)."""
        return self.stages * (self.tile_m + self.tile_n) * self.tile_k * self.dtype.itemsize

    @property
    def align_c(self) -> int:
        """C's alignment in output elements: 16-byte vectors where the inputs have them."""
        return 1 if self.align == 1 else 16 // self.out_dtype.itemsize

    def params(self) -> dict:
        """The fields, out_fp32 as `out_dtype`, and the derived `align_c`."""
        return {"dtype": self.dtype.value, "out_dtype": self.out_dtype.value, "b_transposed": self.b_transposed,
                "strategy": self.strategy.value, "tile_m": self.tile_m, "tile_n": self.tile_n,
                "tile_k": self.tile_k, "warps": self.warps, "stages": self.stages, "align": self.align,
                "align_c": self.align_c}

    def template_values(self) -> dict:
        run, args, strategy = STRATEGY_CPP[self.strategy]
        wm, wn = self.warps_mn
        return {**super().template_values(), "element_out": self.out_dtype.cpp, "warps_m": wm, "warps_n": wn,
                "run": run, "args_type": args, "strategy_cpp": strategy}


INSTANCE = GemmSm80Instance


def invalid_reason(inst: GemmSm80Instance, arch: Arch = Arch.SM80) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if inst.dtype not in DTYPES:
        return f"input dtype {inst.dtype.value} not in {[d.value for d in DTYPES]}"
    if inst.align not in ALIGNS:
        return f"alignment {inst.align} not in {ALIGNS}"
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
    if inst.smem_bytes > arch.max_smem_bytes:
        return f"shared memory {inst.smem_bytes} B exceeds {arch.value}'s {arch.max_smem_bytes} B"
    return None


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
