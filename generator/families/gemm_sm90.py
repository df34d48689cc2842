"""Batched GEMM for Hopper (sm_90a): CUTLASS 3.x kernels from the collective builders (TMA loads,
wgmma, warp-specialized persistent schedules), strided (batch mode, L = batch * heads where the
strides nest, else one launch per outer index) or pointer-array (CUTLASS's ptr-array kernels).
TMA needs 16-byte aligned pointers and strides: odd strides and extents fall back to gemm_sm80's
alignment-1 instances, whose sm_90 code runs here too.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools

from gemmgen.arch import Arch
from gemmgen.generator.families.base import GemmInstance, Strategy, axis_reason, smem_reason
from gemmgen.generator.families.gemm_sm80 import B_TRANSPOSED, DTYPES, OUT_FP32, STRATEGIES

FAMILY = "gemm_sm90"
KIND = "gemm"
HEADER_DIRS = ("gemm_sm90", "gemm")  # under templates/include/gemmgen/: its build key covers them
BUILT_BY_DEFAULT = False  # built when named: gemmgen generate --family gemm_sm90
TEMPLATE = "gemm_sm90.cu.jinja"
ARCHS = (Arch.SM90,)


class Schedule(enum.Enum):
    COOPERATIVE = "coop"
    PINGPONG = "pp"


SCHEDULE_CPP = {Schedule.COOPERATIVE: "Cooperative", Schedule.PINGPONG: "Pingpong"}


class TileScheduler(enum.Enum):
    """How output tiles are dealt to the persistent CTAs: whole tiles (one SM per tile) in
    CUTLASS's static order; stream-K, which also splits the K loop of a tile over SMs when there
    are too few tiles to fill the GPU (a few large matrices: B*H = 8, K = N of P x V) and fixes up
    the partial sums; or in order, each cluster taking its next tile from a counter, so that the
    tiles of a batch run together while its A and B are in L2 (gemm_sm90/in_order_scheduler.h)."""
    PERSISTENT = "persistent"
    STREAM_K = "streamk"
    IN_ORDER = "inorder"


TILE_SCHEDULER_CPP = {TileScheduler.PERSISTENT: "cutlass::gemm::PersistentScheduler",
                      TileScheduler.STREAM_K: "cutlass::gemm::StreamKScheduler",
                      TileScheduler.IN_ORDER: "gemmgen::gemm_sm90::InOrderScheduler"}
SCHEDULER_NAME = {TileScheduler.STREAM_K: "stream-K", TileScheduler.IN_ORDER: "the in-order one"}
COOPERATIVE_ONLY = {
    TileScheduler.STREAM_K: "CUTLASS's sm90 stream-K scheduler runs with the cooperative schedule only",
    TileScheduler.IN_ORDER: ("the in-order scheduler runs with the cooperative schedule only: CUTLASS's ping-pong "
                             "kernel ends a dynamic schedule with a slot that only some of its readers release"),
}
TILE_SCHEDULER_SUFFIX = {TileScheduler.PERSISTENT: "", TileScheduler.STREAM_K: "_sk", TileScheduler.IN_ORDER: "_io"}

# Axes.
TILE_MS = (64, 128, 256)
TILE_NS = (64, 128, 256)
TILE_KS = (64,)  # 128 bytes of fp16/bf16: one TMA box row, the 128-byte swizzle
SCHEDULES = tuple(Schedule)
# CTA clusters (M, N): a 2x1 cluster multicasts B's tile to both CTAs, a 1x2 cluster A's.
CLUSTERS = ((1, 1), (2, 1), (1, 2))
TILE_SCHEDULERS = tuple(TileScheduler)
# Columns of the epilogue's sub-tile: 0 is CUTLASS's choice (32); 64 halves the sub-tiles and
# their barriers per tile and doubles the bytes of each TMA store, for GEMMs whose time is the
# store of a large C (Q x K^T with a short K); 128 halves them again.
EPI_TILE_NS = (0, 64, 128)
# The L2 policy of the A and B loads: CUTLASS's (evict-normal), or evict-last, which keeps operand
# lines in L2 while the output streams through it; other tiles of the same batch read them again
# (bench/NOTES.md, experiment 24). Strided kernels only: ours is a variant of CUTLASS's strided
# mainloop (templates/include/gemmgen/gemm_sm90/batched.h, EvictLastMainloop).
EVICT_LASTS = (False, True)
EPI_STAGES = 2  # the sub-tiles staged in shared memory for TMA stores (CUTLASS's count)
MIN_STAGES = 2


@dataclasses.dataclass(frozen=True)
class GemmSm90Instance(GemmInstance):
    """GemmInstance's fields, then the kernel schedule, the CTA cluster, the tile scheduler and the
    epilogue and L2 variants."""

    family = FAMILY
    align = 8  # TMA: 16-byte vectors of fp16/bf16

    schedule: Schedule
    cluster_m: int
    tile_scheduler: TileScheduler = TileScheduler.PERSISTENT
    cluster_n: int = 1
    epi_tile_n: int = 0  # 0: CUTLASS's automatic epilogue tile
    evict_last: bool = False  # A and B loads marked evict-last in L2

    @property
    def name(self) -> str:
        return (f"{self.name_stem}_{self.schedule.value}_c{self.cluster_m}"
                + (f"x{self.cluster_n}" if self.cluster_n > 1 else "")
                + (f"_e{self.epi_tile_n}" if self.epi_tile_n else "")
                + TILE_SCHEDULER_SUFFIX[self.tile_scheduler]
                + ("_el" if self.evict_last else ""))

    @property
    def threads(self) -> int:
        """A producer warpgroup and two consumer warpgroups."""
        return 384

    @property
    def epi_tile(self) -> tuple[int, int]:
        """The epilogue's sub-tile: one consumer warpgroup's rows (both warpgroups' under the
        cooperative schedule) by epi_tile_n columns, or 32 when CUTLASS chooses."""
        rows = min(self.tile_m, 128 if self.schedule is Schedule.COOPERATIVE else 64)
        return rows, self.epi_tile_n or min(32, self.tile_n)

    @property
    def smem_bytes(self) -> int:
        """The smallest footprint the builder accepts: MIN_STAGES stages and the epilogue's
        staged sub-tiles (the builder then fills the rest of shared memory with stages)."""
        rows, cols = self.epi_tile
        epilogue = EPI_STAGES * rows * cols * self.out_dtype.itemsize
        return MIN_STAGES * self.stage_bytes + epilogue

    @property
    def stream_k(self) -> bool:
        return self.tile_scheduler is TileScheduler.STREAM_K

    def params(self) -> dict:
        """GemmInstance's, this family's fields (evict_last only where True), `align` and `align_c`."""
        return {**self.gemm_params(), "schedule": self.schedule.value, "cluster_m": self.cluster_m,
                "cluster_n": self.cluster_n, "epi_tile_n": self.epi_tile_n,
                "tile_scheduler": self.tile_scheduler.value, "align": self.align, "align_c": self.align_c,
                **({"evict_last": True} if self.evict_last else {})}

    def template_values(self) -> dict:
        return {**super().template_values(), "schedule_cpp": SCHEDULE_CPP[self.schedule],
                "tile_scheduler_cpp": TILE_SCHEDULER_CPP[self.tile_scheduler], "evict_last": self.evict_last}


INSTANCE = GemmSm90Instance


def invalid_reason(inst: GemmSm90Instance, arch: Arch = Arch.SM90) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if arch is not Arch.SM90:
        return "wgmma and TMA exist only in sm_90a"
    if reason := axis_reason("input dtype", inst.dtype, DTYPES):
        return reason
    if inst.schedule is Schedule.COOPERATIVE and inst.tile_m < 128:
        return "the cooperative schedule splits tile_m over two 64-row consumer warpgroups: tile_m >= 128"
    if inst.schedule is Schedule.PINGPONG and inst.tile_m > 128:
        return "a ping-pong consumer warpgroup holds the whole tile: tile_m <= 128"
    if inst.tile_m * inst.tile_n > 128 * 256:
        return f"a {inst.tile_m}x{inst.tile_n} fp32 accumulator exceeds two warpgroups' registers"
    if inst.schedule is Schedule.PINGPONG and inst.tile_m * inst.tile_n > 128 * 128:
        # One warpgroup holds it: 256 fp32 per thread against setmaxnreg's 240 (ptxas: 4.7 KB of spill).
        return (f"a ping-pong tile's {inst.tile_m}x{inst.tile_n} fp32 accumulator is one warpgroup's: "
                f"{inst.tile_m * inst.tile_n // 128} registers per thread exceed the 240 it gets")
    if inst.cluster_m * inst.cluster_n > 1 and inst.strategy is Strategy.PTR_ARRAY:
        return "the pointer-array kernels gain no multicast: matrices differ per block"
    if inst.epi_tile_n:
        if inst.strategy is Strategy.PTR_ARRAY:
            return "the epilogue tile is an axis of the strided kernels only"
        if inst.tile_n % inst.epi_tile_n or inst.epi_tile_n <= min(32, inst.tile_n):
            return f"epilogue tile columns {inst.epi_tile_n} must divide tile_n {inst.tile_n} and exceed the automatic 32"
    if inst.evict_last and inst.strategy is Strategy.PTR_ARRAY:
        return "evict-last operand loads are an axis of the strided kernels only"
    if inst.tile_scheduler is not TileScheduler.PERSISTENT:
        # Both other schedulers ride on CUTLASS's cooperative kernel; pointer arrays bring their own.
        if inst.schedule is not Schedule.COOPERATIVE:
            return COOPERATIVE_ONLY[inst.tile_scheduler]
        if inst.strategy is Strategy.PTR_ARRAY:
            return f"the pointer-array kernels take the grouped scheduler, not {SCHEDULER_NAME[inst.tile_scheduler]}"
    return smem_reason(inst, arch)


def problem_reason(inst: GemmSm90Instance, problem) -> str | None:
    """Nothing beyond gemmgen.select.gemm_select's functional checks: any K, any batch count."""
    return None


SPACE: tuple[GemmSm90Instance, ...] = tuple(
    inst
    for dtype, out_fp32, bt, strategy, tm, tn, tk, schedule, (cm, cn), scheduler, epi_n, el in itertools.product(
        DTYPES, OUT_FP32, B_TRANSPOSED, STRATEGIES, TILE_MS, TILE_NS, TILE_KS, SCHEDULES, CLUSTERS,
        TILE_SCHEDULERS, EPI_TILE_NS, EVICT_LASTS)
    for inst in [GemmSm90Instance(dtype, out_fp32, bt, strategy, tm, tn, tk, schedule, cm, scheduler, cn, epi_n, el)]
    if invalid_reason(inst) is None
)

# The tile axes a default names: (tile_m, tile_n, schedule, cluster (M, N), epilogue columns,
# tile scheduler, evict-last).
TileKey = tuple


def tile_key(inst: GemmSm90Instance) -> TileKey:
    return (inst.tile_m, inst.tile_n, inst.schedule, (inst.cluster_m, inst.cluster_n), inst.epi_tile_n,
            inst.tile_scheduler, inst.evict_last)


REFERENCE_TILE: TileKey = (128, 128, Schedule.COOPERATIVE, (1, 1), 0, TileScheduler.PERSISTENT, False)
_SHORT_E64 = (128, 128, Schedule.PINGPONG, (1, 1), 64, TileScheduler.PERSISTENT, False)
_CLUSTER_EL = (128, 128, Schedule.PINGPONG, (1, 2), 128, TileScheduler.PERSISTENT, True)
_LARGE_IO = (256, 128, Schedule.COOPERATIVE, (1, 2), 128, TileScheduler.IN_ORDER, True)
_NARROW = (128, 64, Schedule.COOPERATIVE, (1, 1), 0, TileScheduler.PERSISTENT, False)
# The strided default set: in each regime (`regime` below) one of these wins or is within a few
# percent of the best of a 20-tile pool timed as users call it (eager calls queued) on the H200 and
# the H100 (bench/results/gemm_tiles_h200.csv, gemm_tiles_h100.csv; bench/NOTES.md experiments 63, 104).
STRIDED_DEFAULT_TILES: dict[TileKey, str] = {
    REFERENCE_TILE: "128x128 cooperative: small problems (C x K up to 2^32) over more than 8 matrices on the H100",
    _SHORT_E64: "128x128 ping-pong, 64-column epilogue sub-tiles: short K (Q x K^T at head dim 64)",
    _CLUSTER_EL: ("128x128 ping-pong, 1x2 cluster, 128-column epilogue, evict-last operands: K of 128-256 "
                  "with N >= 256 (Q x K^T at head dim 128) on the H200, long K"),
    _LARGE_IO: ("256x128 cooperative, 1x2 cluster, 128-column epilogue, in-order scheduler, evict-last: "
                "many small outputs, and on the H100 most large ones, where the store of C bounds the time"),
    _NARROW: "128x64 cooperative: outputs 64 columns wide (P x V at head dim 64), which 128-column tiles pad",
}
# Regimes of the measured speeds: K longer than MID_K; many small outputs: M, N <= SMALL_MN with at
# least MANY_OUTPUTS elements of C in all (B*H in the thousands at M = N = 512), where the largest
# tiles store C fastest; on GPUs whose profile says so, few matrices (at most its few_batches) or a
# small problem (C's elements times K at most its small_work), too little work for the largest
# tiles to pay; else K up to SHORT_K (the store of C bounds Q x K^T) or up to MID_K.
SHORT_K, MID_K, SMALL_MN, MANY_OUTPUTS = 64, 256, 512, 2**27
REGIMES = ("short", "mid", "long", "many", "few", "small")


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    """What was measured on one GPU model: each default tile's throughput per unit of padded work
    (waves x tile_m x tile_n x K) relative to REFERENCE_TILE's, per regime (the median over the
    regime's shapes of the pool run there with N >= 256; narrower outputs are the padding term's;
    `python bench/gemm_tiles.py --fit bench/results/gemm_tiles_<gpu>.csv`), the work (C's elements
    times K) at or below which the "small" regime holds, and the count of matrices at or below which
    the "few" regime holds (0: no such regime)."""

    speeds: dict[TileKey, dict[str, float]]
    small_work: int = 0
    few_batches: int = 0


# The two GPUs rank the tiles differently where the store of C bounds the time: the H100's memory is
# slower, and the 256x128 in-order tile wins more of those shapes there, but not those of 8 matrices
# or fewer, nor small problems, where the 128x128 cooperative tile wins (bench/NOTES.md, experiments
# 63 and 104). A GPU model not listed takes the H100's.
PROFILES: dict[str, GpuProfile] = {
    "NVIDIA H200": GpuProfile({
        REFERENCE_TILE: {"short": 1.0, "mid": 1.0, "long": 1.0, "many": 1.0},
        _SHORT_E64: {"short": 1.16, "mid": 1.51, "long": 1.22, "many": 0.98},
        _CLUSTER_EL: {"short": 1.17, "mid": 1.61, "long": 1.20, "many": 1.04},
        _LARGE_IO: {"short": 1.14, "mid": 1.33, "long": 1.00, "many": 1.16},
        _NARROW: {"short": 0.78, "mid": 0.80, "long": 0.79, "many": 0.81},
    }),
    "NVIDIA H100": GpuProfile({
        REFERENCE_TILE: {"short": 1.0, "mid": 1.0, "long": 1.0, "many": 1.0, "small": 1.0, "few": 1.0},
        _SHORT_E64: {"short": 0.97, "mid": 0.93, "long": 1.07, "many": 0.97, "small": 0.91, "few": 1.08},
        _CLUSTER_EL: {"short": 0.99, "mid": 0.90, "long": 1.09, "many": 0.99, "small": 0.85, "few": 1.05},
        _LARGE_IO: {"short": 1.11, "mid": 1.05, "long": 1.03, "many": 1.14, "small": 0.86, "few": 1.00},
        _NARROW: {"short": 1.04, "mid": 0.83, "long": 0.71, "many": 0.92, "small": 0.91, "few": 0.79},
    }, small_work=2**32, few_batches=8),
}
FALLBACK_GPU = "NVIDIA H100"


def profile_for(gpu: str) -> GpuProfile:
    """The profile of the GPU model `gpu` names ("NVIDIA H100 80GB HBM3": the H100's)."""
    return next((prof for model, prof in PROFILES.items() if gpu.startswith(model)), PROFILES[FALLBACK_GPU])


def regime(problem) -> str:
    """The regime (REGIMES) of a GEMM problem (m, n, k, batch_count, device) on its GPU."""
    if problem.k > MID_K:
        return "long"
    outputs = problem.batch_count * problem.m * problem.n
    if problem.m <= SMALL_MN and problem.n <= SMALL_MN and outputs >= MANY_OUTPUTS:
        return "many"
    profile = profile_for(problem.device.name)
    if profile.few_batches and problem.batch_count <= profile.few_batches:
        return "few"
    if profile.small_work and outputs * problem.k <= profile.small_work:
        return "small"
    return "short" if problem.k <= SHORT_K else "mid"


def speed(inst: GemmSm90Instance, problem) -> float | None:
    """The measured relative throughput of `inst`'s tile in the problem's regime on its GPU. A tile
    not measured takes the lowest speed measured for its tile_m x tile_n (a variant is not assumed
    faster than the slowest of its shape); None when none of its shape was measured."""
    speeds, key, reg = profile_for(problem.device.name).speeds, tile_key(inst), regime(problem)
    if key in speeds:
        return speeds[key][reg]
    return min((v[reg] for k, v in speeds.items() if k[:2] == key[:2]), default=None)


# The strided kernels: the tiles above. The pointer-array kernels (no cluster, epilogue or L2 axes):
# the reference 128x128 cooperative tile. Each per (dtype, output, layout).
DEFAULT: tuple[GemmSm90Instance, ...] = tuple(
    inst for inst in SPACE
    if (tile_key(inst) in STRIDED_DEFAULT_TILES if inst.strategy is Strategy.STRIDED
        else tile_key(inst) == REFERENCE_TILE)
)
