"""CUTLASS's Hopper FMHA forward (example 88 of the CUTLASS source tree) as a gemmgen family.

The kernels are CUTLASS's own (TMA loads, wgmma, warp-specialized schedules), included from the
installed nvidia-cutlass package; templates/include/gemmgen/fmha_sm90/launch.h maps gemmgen's C ABI
onto them. Built for sm_90a only: wgmma and setmaxnreg have no other target.

One instance = one (dtype, head_dim, mask, schedule, tile, K/V stages, softmax: CUTLASS's or ours,
templates/include/gemmgen/fmha_sm90/softmax.h). `problem_reason` states what a built instance cannot
run, so the registry picks another family for those calls.

fp8 instances (`_fp8_`: q, k, v in float8 e4m3, O in bf16) run CUTLASS's mainloop with 8-bit
operands on the persistent schedule (our epilogue stores O in bf16): V is read transposed
([B, Hkv, d, Nk], keys contiguous: wgmma reads 8-bit operands K-major only), a copy the instance
makes in the call's workspace first (templates/include/gemmgen/fmha_sm90/transpose.h), and each
(batch, K/V head) may carry factors for q, k and v (gemmgen.ops.fp8 prepares them).

Additive-mask instances (`_bias`: attn_mask, bool masks as 0 / -inf) add the mask to the scores in
our softmax, each thread loading its scores' mask values one key tile ahead; a mask shared by heads
or batch entries has its tiles sorted and listed first by kernels of the instance's own, so that
hidden key tiles are skipped and only mixed ones read (templates/include/gemmgen/fmha_sm90/bias.h);
fixed lengths, no mask or causal, on the persistent schedule.

Dropout instances (`_dropout`) drop the probabilities in our softmax by gemmgen's Philox mask
(templates/include/gemmgen/philox/philox.h), the mask mea_sm80 and mea_bwd_sm80 draw for the same
(seed, offset): a forward here trains with either family's backward. Fixed lengths, no mask or
causal, head dims 64 and 128, on the persistent schedule.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math

from gemmgen.arch import Arch
from gemmgen.generator.families.base import (ADDED, AttentionInstance, CostInputs, DType, Mask, axis_reason,
                                             dropout_reason, smem_reason)

FAMILY = "fmha_sm90"
KIND = "attention"
BUILT_BY_DEFAULT = True
TEMPLATE = "fmha_sm90.cu.jinja"
HEADER_DIRS = ("fmha_sm90", "philox")
ARCHS = (Arch.SM90,)
# Features its kernel reads that a build from before did not: instances say so in their params, and
# the registry keeps the feature from an entry without the mark (registry.MARKS).
MARKED = ("varlen", "kv_cache")


class Schedule(enum.Enum):
    TMA = "tma"  # one producer/consumer warp group, no warp specialization
    COOPERATIVE = "coop"  # a producer warp group and two consumer warp groups sharing a 128-row tile
    PINGPONG = "pingpong"  # persistent over tiles, Q loaded by its own warp, in our own kernel and
    # epilogue (templates/include/gemmgen/fmha_sm90/persistent.h; causal row tiles in pairs); 64 rows
    # per consumer warp group, so a 192-row tile has three


SCHEDULE_CPP = {Schedule.TMA: "kTma", Schedule.COOPERATIVE: "kCooperative", Schedule.PINGPONG: "kPingpong"}

# Axes.
DTYPES = (DType.FP16, DType.BF16, DType.FP8)
# fp8: the head dims whose 8-bit tiles were built and measured, without a mask or causal.
FP8_HEAD_DIMS = (64, 128, 256)
FP8_MASKS = (Mask.NONE, Mask.CAUSAL)
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
# causal: either alignment with Nq <= Nk (the offset is a launch parameter); local: a sliding window
# (its bounds and offset are launch parameters), on the persistent schedule.
MASKS = tuple(Mask)
SCHEDULES = tuple(Schedule)
# (block_m, block_n); 128x256 for fp8 only. 128x112 ran at half of 128x96's rate on an H100 (bench/NOTES.md,
# experiment 113): not offered.
TILES = ((64, 64), (64, 128), (128, 64), (128, 96), (128, 128), (128, 192), (192, 64), (192, 128), (256, 64),
         (128, 256))
FP8_ONLY_TILES = ((128, 256),)
# K/V pipeline stages (one stage holds a K or a V tile). Two are not offered: every 2-stage tile
# tried hung at its first call on an H100 (ping-pong with one or two Q buffers and cooperative, head
# dims 128-256, with either softmax), where the 3-stage twins ran (bench/NOTES.md, experiment 105).
STAGES = (3, 4, 5)
# The softmax: ours, which rescales O only when a row maximum grows by more than 2^8 (names `_lr`,
# templates/include/gemmgen/fmha_sm90/softmax.h; the default: up to 4% faster, bench/NOTES.md,
# experiment 41), or CUTLASS's, which rescales O after every key tile.
LAZY_RESCALES = (False, True)
# Q buffers per consumer warp group of the persistent schedule: with 2 the next row tile's Q loads
# while the group still works on this one.
Q_BUFFERS = (1, 2)
SOFTCAPS = (False, True)
BIASES = (False, True)
DROPOUTS = (False, True)
# Head dims whose default tiles are also built with an additive mask (`_bias`): the models that pass
# padding masks most (GPT-2-style d64, Llama-style d128, Gemma-style d256).
BIAS_DEFAULT_HEAD_DIMS = (64, 128, 256)
# Head dims whose default tiles are also built with a logit softcap (`_sc`): Gemma 2's (256, and 128
# in its largest model), as fa2_sm80 builds them.
SOFTCAP_DEFAULT_HEAD_DIMS = (128, 256)
# Head dims of the dropout instances (`_dropout`), all built by default on the two-group 128x128
# tile: the models trained with attention dropout most (BERT- and GPT-2-style d64, d128), and the
# head dims whose backward fmha_bwd_sm90 has; the others run dropout on mea_sm80.
DROPOUT_HEAD_DIMS = (64, 128)

# CUTLASS's defaults; an instance with fewer stages exists only when the default does not fit.
DEFAULT_STAGES = {Schedule.TMA: 4, Schedule.COOPERATIVE: 5, Schedule.PINGPONG: 5}
MAX_SMEM = Arch.SM90.max_smem_bytes
# fp32 accumulator registers per consumer thread (S tile + O tile) above which the warp-specialized
# schedules spill: setmaxnreg gives each consumer thread 240 registers with two consumer groups, 160
# with three and 112 with four (CUTLASS's split of the register file; the TMA schedule's one group
# is held to 240 too), and the softmax needs about 48 besides.
CONSUMER_REGS = {1: 240, 2: 240, 3: 160, 4: 112}
SOFTMAX_REGS = 48
INT32_MAX = 2**31 - 1
# What O stored from registers costs a row tile, in key columns of the heuristic's work (its epilogue
# is not overlapped as the TMA store is): 128x64 with the direct stores ran 6-9% behind its buffered
# twin at N = 1024 on an H100 (about 64 of 1050 columns), 1-6% at 4096 (bench/NOTES.md, 113).
DIRECT_STORE_COLS = 64.0


@dataclasses.dataclass(frozen=True)
class FmhaSm90Instance(AttentionInstance):
    """One head dim and mask under one of CUTLASS's schedules (or our persistent one), a tile of
    `block_m` query rows by `block_n` keys, `stages` K/V pipeline stages, the softmax and the Q
    buffers per consumer warp group."""

    family = FAMILY

    dtype: DType
    head_dim: int
    mask: Mask
    schedule: Schedule
    block_m: int
    block_n: int
    stages: int
    lazy_rescale: bool = False  # our softmax (True) or CUTLASS's
    q_buffers: int = 1  # Q buffers per consumer warp group (2: the persistent schedule only)
    # A logit softcap (a launch parameter, > 0; our softmax caps the scores before the mask): such an
    # instance runs softcap calls only, the others none (suffix `_sc`).
    softcap: bool = dataclasses.field(default=False, metadata={ADDED: True})
    # An additive mask (attn_mask; a launch parameter, the bias tensor): such an instance runs calls
    # with one only, the others none (suffix `_bias`).
    bias: bool = dataclasses.field(default=False, metadata={ADDED: True})
    # Dropout (a launch parameter, 0 < p < 1; the softmax draws the mask): such an instance runs
    # dropout calls only, the others none (suffix `_dropout`).
    dropout: bool = dataclasses.field(default=False, metadata={ADDED: True})

    @property
    def name(self) -> str:
        return (f"{self.name_stem}_{self.schedule.value}_m{self.block_m}n{self.block_n}s{self.stages}"
                + ("_lr" if self.lazy_rescale else "") + (f"_q{self.q_buffers}" if self.q_buffers > 1 else "")
                + ("_sc" if self.softcap else "") + ("_bias" if self.bias else "")
                + ("_dropout" if self.dropout else ""))

    @property
    def consumer_groups(self) -> int:
        """Warp groups doing the math: the cooperative schedule splits its 128-row tile in two, the
        persistent one gives each group 64 rows."""
        if self.schedule is Schedule.TMA:
            return 1
        return self.block_m // 64 if self.persistent else 2

    @property
    def speculates(self) -> bool:
        """Whether our softmax speculates (templates/include/gemmgen/fmha_sm90/softmax.h): only the
        warp-specialized mainloops run its speculative step, and it holds a second fp32 score tile
        (block_n / 2 registers per thread) beside the first and the O tile (head_dim / 2), which
        must fit in the registers setmaxnreg gives a consumer thread, with 16 to spare. Measured
        (bench/NOTES.md, experiment 44): d128 128x128 (2 groups) no spill, +2-10%; d64 256x64
        (4 groups) a 40-byte spill, +7-14%; d64 192x128 (3 groups) a 280-byte spill and a loss.
        Head dims above 128 were not measured, so they keep the plain step."""
        if (not self.lazy_rescale or self.schedule is Schedule.TMA or self.head_dim > 128 or self.mask is Mask.LOCAL
                or self.bias or self.dropout):
            # (a window's first key tile or a bias may hide all of a row's keys; a bias instance also
            # holds the next key tile's bias in registers: with speculation the d128 tile spilled and
            # ran 14% slower, bench/NOTES.md, experiment 93; dropout's Philox draws need the
            # registers the second score tile would take)
            return False
        return self.block_n + self.head_dim // 2 + 16 <= CONSUMER_REGS[self.consumer_groups]

    @property
    def cost_inputs(self) -> CostInputs:
        """The base's, and the cost of O stored from registers (direct_store): DIRECT_STORE_COLS."""
        return dataclasses.replace(super().cost_inputs, epilogue_cols=DIRECT_STORE_COLS if self.direct_store else 0.0)

    @property
    def threads(self) -> int:
        # The TMA schedule is one warp group; the others add a producer warp group.
        return 128 * (self.consumer_groups + (0 if self.schedule is Schedule.TMA else 1))

    @property
    def smem_bytes(self) -> int:
        """Shared memory of CUTLASS's SharedStorage (the compiled instances report the same figure;
        a test checks one): the Q stages, the K/V stages (K and V share them), pipeline barriers, and
        for the persistent schedule a whole-tile output buffer per consumer group beside them unless
        it stores O from registers (direct_store; the other schedules reuse the mainloop's space)."""
        return self._smem_bytes(self.stages, self.persistent and not self.direct_store)

    def _smem_bytes(self, stages: int, o_buffers: bool) -> int:
        e = self.dtype.itemsize
        rows_q = self.block_m // self.consumer_groups
        q = self.q_buffers * self.consumer_groups * rows_q * self.head_dim * e
        kv = stages * self.block_n * self.head_dim * e
        if self.persistent:  # O's buffers hold the output type (fp8's is bf16); the factor, bias or dropout slots
            return (q + kv + (self.consumer_groups * rows_q * self.head_dim * max(e, 2) if o_buffers else 0) + 1536
                    + (256 if self.dtype is DType.FP8 else 0) + (1024 if self.bias else 0)
                    + (768 if self.dropout else 0))
        return q + kv + 512

    @property
    def direct_store(self) -> bool:
        """Whether the persistent epilogue stores O from registers (16 bytes per thread and row, after
        a transpose within each quad) instead of through a shared-memory buffer and one TMA store per
        consumer group: where that buffer would cost the K/V pipeline a stage, i.e. fewer than
        CUTLASS's default stages fit beside it and more fit without it (the large head dims' wide
        tiles; K and V stages are what the ping-pong mainloop runs short of, bench/NOTES.md,
        experiments 60 and 113)."""
        if not self.persistent:
            return False
        default = DEFAULT_STAGES[self.schedule]

        def most(o_buffers: bool) -> int:
            return max((s for s in range(1, default + 1) if self._smem_bytes(s, o_buffers) <= MAX_SMEM), default=0)
        return most(False) > most(True)

    @property
    def persistent(self) -> bool:
        return self.schedule is Schedule.PINGPONG

    @property
    def runs_varlen(self) -> bool:
        """Packed sequences (templates/include/gemmgen/fmha_sm90/varlen.h): the persistent schedule,
        16-bit inputs, but windows on four-group (256-row) tiles: the d64 local tile ran a mixed
        packing at 0.66x (256 keys) and 0.90x (1024) fa2_sm80's local instance on an H100, its 256-row
        tiles mostly past the short sequences' rows (bench/NOTES.md, experiment 92)."""
        return (self.persistent and self.dtype is not DType.FP8 and not self.bias and not self.dropout
                and not (self.mask is Mask.LOCAL and self.consumer_groups == 4))

    def params(self) -> dict:
        """The fields, lazy_rescale and q_buffers only where not their defaults, and `speculate`."""
        return {"dtype": self.dtype.value, "head_dim": self.head_dim, "mask": self.mask.value,
                "schedule": self.schedule.value, "block_m": self.block_m, "block_n": self.block_n,
                "stages": self.stages, **({"lazy_rescale": True} if self.lazy_rescale else {}),
                **({"q_buffers": self.q_buffers} if self.q_buffers > 1 else {}),
                **({"softcap": True} if self.softcap else {}),
                **({"bias": True} if self.bias else {}),
                **({"dropout": True} if self.dropout else {}),
                # Derived, and kept here so that the build key changes with the rule that derives it.
                **({"speculate": True} if self.speculates else {}),
                **({"direct_store": True} if self.direct_store else {}),
                **({"varlen": True, "kv_cache": True} if self.runs_varlen else {})}

    def template_values(self) -> dict:
        return {**super().template_values(), "schedule_cpp": SCHEDULE_CPP[self.schedule], "causal": self.causal,
                "local": self.mask is Mask.LOCAL, "lazy_rescale": self.lazy_rescale, "q_buffers": self.q_buffers,
                "speculate": self.speculates, "softcap": self.softcap, "bias": self.bias,
                "direct_store": self.direct_store, "dropout": self.dropout}


INSTANCE = FmhaSm90Instance


def causal_tiles_masked(block_m: int, block_n: int) -> bool:
    """The causal tiles of the space: those where masking the last ceil(block_m / block_n) key tiles
    of each row tile covers its diagonal at offset 0, i.e. the tiles before those end at or before
    the row tile's first row (the pattern repeats every block_n / gcd row tiles; 128x192 is not such
    a tile: a fixed count of masked tiles gave 4e-2 errors there on the H200). The family's mask
    (templates/include/gemmgen/fmha_sm90/causal.h) counts the masked tiles per row tile and offset;
    the space keeps the tiles the family was measured on."""
    masked = -(-block_m // block_n)
    return all((-(-(m + 1) * block_m // block_n) - masked) * block_n <= m * block_m
               for m in range(block_n // math.gcd(block_m, block_n)))


def invalid_reason(inst: FmhaSm90Instance, arch: Arch = Arch.SM90) -> str | None:
    """The one validity rule of this family: None when valid, else why not."""
    if reason := axis_reason("head_dim", inst.head_dim, HEAD_DIMS):
        return reason
    if inst.softcap and not (inst.lazy_rescale and inst.mask is not Mask.LOCAL and inst.dtype is not DType.FP8):
        return "a logit softcap runs in our softmax (lazy_rescale), 16-bit, without a window"
    if inst.bias and not (inst.lazy_rescale and inst.persistent and inst.mask is not Mask.LOCAL
                          and inst.dtype is not DType.FP8):
        return ("an additive mask runs in our softmax (lazy_rescale) on the persistent schedule, 16-bit, "
                "without a window")
    if inst.dropout and not (inst.lazy_rescale and inst.persistent and inst.mask is not Mask.LOCAL
                             and inst.dtype is not DType.FP8 and not inst.bias and not inst.softcap
                             and inst.block_n % 16 == 0 and inst.head_dim in DROPOUT_HEAD_DIMS):
        return ("dropout runs in our softmax (lazy_rescale) on the persistent schedule, 16-bit, without a "
                f"window, bias or softcap, on tiles of whole 16-key groups, at head dims {DROPOUT_HEAD_DIMS}")
    if (inst.block_m, inst.block_n) in FP8_ONLY_TILES and inst.dtype is not DType.FP8:
        return f"tile {inst.block_m}x{inst.block_n}: an fp8 tile (its 8-bit K/V stages of 256 keys fit five deep)"
    if inst.dtype is DType.FP8:
        if not (inst.persistent and inst.lazy_rescale):
            return ("fp8 runs on the persistent schedule (its epilogue stores O in bf16) with our softmax "
                    "(lazy_rescale: it takes each row tile's factors)")
        if inst.head_dim not in FP8_HEAD_DIMS or inst.mask not in FP8_MASKS:
            return (f"fp8 runs head dims {', '.join(map(str, FP8_HEAD_DIMS))} with masks "
                    f"{', '.join(m.value for m in FP8_MASKS)}")
    if (inst.block_m, inst.block_n) not in TILES:
        return f"tile {inst.block_m}x{inst.block_n} not in {TILES}"
    rows = inst.block_m // inst.consumer_groups
    if rows != 64:
        return f"{inst.schedule.value} gives each consumer warp group {rows} rows; wgmma tiles here are 64"
    if inst.causal and not causal_tiles_masked(inst.block_m, inst.block_n):
        return (f"causal masking: with block_m {inst.block_m}, block_n {inst.block_n} an unmasked key tile "
                f"crosses the diagonal")
    if inst.mask is Mask.LOCAL and not (inst.persistent and inst.lazy_rescale):
        return "a sliding window (local) runs on the persistent schedule with our softmax (lazy_rescale)"
    if inst.q_buffers > 1 and not inst.persistent:
        return "a second Q buffer is an axis of the persistent schedule"
    if inst.persistent and not 2 <= inst.consumer_groups <= 4:
        return f"{inst.schedule.value} runs 2 to 4 consumer warp groups of 64 rows; block_m {inst.block_m}"
    acc = (rows * inst.block_n + rows * inst.head_dim) // 128
    most = CONSUMER_REGS[inst.consumer_groups] - SOFTMAX_REGS
    if acc > most:
        return f"{acc} fp32 accumulators per consumer thread exceed {most} ({inst.consumer_groups} consumer groups)"
    if reason := smem_reason(inst, arch):
        return reason
    # CUTLASS's TMA mainloop (no producer warp) issues its loads itself: the prologue fills every
    # stage alternating K and V, and each key tile then loads one K and one V, so the stage count
    # must be even and hold the next K and V: 2 stages deadlock, 3 put a K where a V is read
    # (the H200 hung on them).
    if inst.schedule is Schedule.TMA and inst.stages != DEFAULT_STAGES[Schedule.TMA]:
        return f"stages {inst.stages}: the TMA schedule needs {DEFAULT_STAGES[Schedule.TMA]}"
    if inst.stages < STAGES[0]:
        return f"stages {inst.stages}: fewer than {STAGES[0]} K/V stages hang (the tile is not offered)"
    # The stage count is CUTLASS's default, or the most that fit when the default does not.
    most = max((s for s in STAGES if s <= DEFAULT_STAGES[inst.schedule]
                and dataclasses.replace(inst, stages=s).smem_bytes <= arch.max_smem_bytes), default=None)
    if inst.stages != most:
        return f"stages {inst.stages}: this tile uses {most}"
    return None


def problem_reason(inst: FmhaSm90Instance, problem) -> str | None:
    """What a built instance cannot run (the registry's reason), None when it can: no key-value
    cache; an additive mask (bias) on `_bias` instances only, which run nothing else, with fixed
    lengths; dropout likewise on `_dropout` instances only, with fixed lengths and Nq * Nk below
    2^31; packed sequences on the persistent 16-bit schedule, when every sequence with queries has
    keys, and with a causal mask or a window at least as many as queries; a contiguous key-value
    cache as packed sequences whose key counts stay on the GPU (no mask, or causal bottom-right; the
    rows that see no key are found by the kernel, templates/include/gemmgen/fmha_sm90/varlen.h)."""
    if problem.kv_cache and not (problem.varlen and not problem.paged and problem.window is None
                                 and (not problem.causal or problem.causal_alignment == "bottom_right")):
        return (f"{FAMILY} runs key-value caches as packed sequences only: contiguous caches, no window, "
                f"causal bottom-right")
    if reason := dropout_reason(inst, problem):
        return reason
    if bool(problem.bias) != inst.bias:
        return ("built for an additive mask; the problem has none" if inst.bias else
                f"{inst.name} has no additive mask (only instances built for one, `_bias`, run it)")
    if inst.bias and problem.varlen:
        return f"{FAMILY} runs additive masks with fixed lengths"
    if problem.varlen:
        if not inst.runs_varlen:
            return f"{FAMILY} runs variable lengths on its persistent schedule, 16-bit inputs"
        if problem.short_keys:
            return (f"{FAMILY} runs variable lengths where every sequence with queries has keys, and with a "
                    f"causal mask or a window at least as many keys as queries (or where the offsets could not "
                    f"be read: CUDA graph capture)")
    if problem.negative_scale:
        return f"{FAMILY} runs scales >= 0 (its softmax takes the row maximum of the raw scores)"
    if (problem.causal or problem.window is not None) and problem.seqlen_q > problem.seqlen_k and not problem.varlen:
        # The causal and local masks (templates/include/gemmgen/fmha_sm90/causal.h) run offsets in
        # [0, Nk - Nq]: both alignments when Nq <= Nk. With Nq > Nk, bottom-right leaves rows without
        # a key and top-left gives rows past Nk every key (causal) or none (a window).
        return f"{FAMILY} {problem.mask} needs seqlen_q <= seqlen_k (either alignment)"
    if problem.max_offset > INT32_MAX:
        return f"{FAMILY} indexes with int32; this call reaches element {problem.max_offset}"
    return None


SPACE: tuple[FmhaSm90Instance, ...] = tuple(
    inst
    for inst in itertools.starmap(
        FmhaSm90Instance,
        ((dt, d, mask, sched, bm, bn, st, e, qb, sc, bias, drop)
         for dt, d, mask, sched, (bm, bn), st, e, qb, sc, bias, drop in itertools.product(
             DTYPES, HEAD_DIMS, MASKS, SCHEDULES, TILES, STAGES, LAZY_RESCALES, Q_BUFFERS, SOFTCAPS, BIASES,
             DROPOUTS)))
    if invalid_reason(inst) is None
)

# Default (schedule, block_m, block_n, Q buffers) per (head dim, causal): the best tiles of the H200
# sweep (bench/NOTES.md, experiment 6; d128 causal from experiment 23, ping-pong with its paired tile
# order; d64 from experiments 42, 44 and 45: the four-group ping-pong 256x64 tile with two Q buffers,
# whose softmax speculates, is the fastest or within 1% at 10 of the 12 sweep shapes of each mask,
# the causal TMA 64x64 tile 10% ahead of it at N = 512); d32 keeps the TMA tile (within 1-5% of the
# 192- and 256-row tiles, experiment 32); d256 CUTLASS's cooperative 128x64 without a mask, and
# causal ping-pong 128x64 with O stored from registers (5 stages): +1 / -5 / +3 / +18% over the
# cooperative tile at N = 1k / 2k / 4k / 16k causal on an H100, -8 / -10 / +4 / +3% without a mask
# (experiment 114); d96 the fastest of the tiles timed at N = 1024 and 4096 (bf16, experiment 60:
# ping-pong 128x128); d160 and d192 ping-pong 128x96 with O stored from registers (direct_store: 5
# and 4 K/V stages, 3 beside O's buffers), 4-31% ahead of 128x64 from N = 4096 on H100s, 3% ahead
# to 12% behind it at N = 1024 (experiment 113; hence the short-sequence tiles below).
DEFAULT_TILE = {
    (32, False): (Schedule.TMA, 64, 128, 1), (32, True): (Schedule.TMA, 64, 128, 1),
    (64, False): (Schedule.PINGPONG, 256, 64, 2), (64, True): (Schedule.PINGPONG, 256, 64, 2),
    (96, False): (Schedule.PINGPONG, 128, 128, 1), (96, True): (Schedule.PINGPONG, 128, 128, 1),
    (128, False): (Schedule.PINGPONG, 128, 128, 1), (128, True): (Schedule.PINGPONG, 128, 128, 1),
    (160, False): (Schedule.PINGPONG, 128, 96, 1), (160, True): (Schedule.PINGPONG, 128, 96, 1),
    (192, False): (Schedule.PINGPONG, 128, 96, 1), (192, True): (Schedule.PINGPONG, 128, 96, 1),
    (256, False): (Schedule.COOPERATIVE, 128, 64, 1), (256, True): (Schedule.PINGPONG, 128, 64, 1),
}

# Local (sliding window) instances: the persistent schedule only, so the no-mask tile where it is
# persistent, else the ping-pong tile of the nearest head dims (128x128 at d32, 128x64 at d256). Of
# the other d64 and d128 tiles timed on the H100 none was ahead at every window and length
# (bench/NOTES.md, experiment 74: d64 192x128 +3-8% from N = 8192, -4% to -32% at N = 4096).
# At d160 and d192 the window keeps 128x64 with its output buffer: 128x96 (O from registers) ran
# even at N = 1024 and 3-4% behind at 4096 and 16384 with a 1024-key window (experiment 113).
LOCAL_TILE = {**{d: tile if tile[0] is Schedule.PINGPONG else (Schedule.PINGPONG, 128, 128 if d <= 128 else 64, 1)
                 for (d, causal), tile in DEFAULT_TILE.items() if not causal},
              160: (Schedule.PINGPONG, 128, 64, 1), 192: (Schedule.PINGPONG, 128, 64, 1)}

# Built by default beside the default tile, weighed on the heuristic's estimate alone (no
# preference): the causal d64 TMA 64x64 tile, 12% ahead of the 256x64 tile at N = 512 and even at
# N = 1024, 15% behind from N = 2048 on (bench/NOTES.md, experiment 64); the estimate takes it at
# N <= 1024 only (its padded causal work is 8% lower or more there). At d160 causal and d192 the
# 128x64 tile with its output buffer, 6-12% ahead of 128x96 at N = 1024 and 4-10% behind from 4096
# (experiment 113); the estimate takes it up to about N = 1500, 2048 causal (128x96's direct stores
# and rounding to 96 keys cost it 8% more there).
SHORT_SEQUENCE_TILES = {(64, True): (Schedule.TMA, 64, 64, 1), (160, True): (Schedule.PINGPONG, 128, 64, 1),
                        (192, False): (Schedule.PINGPONG, 128, 64, 1), (192, True): (Schedule.PINGPONG, 128, 64, 1)}

# fp8 (the persistent schedule only) per (head dim, causal): of the tiles timed on the H100
# (bench/NOTES.md, experiment 90), the fastest at N = 4096 and 16384: d64 the 16-bit tile; d128
# 128x192 without a mask, 128x128 causal (128x256 behind both); d256 128x128 (the 16-bit default is
# CUTLASS's cooperative kernel; 128x64 behind it from N = 4096), 5 stages with O stored from registers
# since experiment 113 (4 beside its buffer: +12-20% from N = 4096, causal 9% behind at 1024).
FP8_TILE = {
    (64, False): (Schedule.PINGPONG, 256, 64, 2), (64, True): (Schedule.PINGPONG, 256, 64, 2),
    (128, False): (Schedule.PINGPONG, 128, 192, 1), (128, True): (Schedule.PINGPONG, 128, 128, 1),
    (256, False): (Schedule.PINGPONG, 128, 128, 1), (256, True): (Schedule.PINGPONG, 128, 128, 1),
}


# Additive masks (the persistent schedule only): the local tiles, but at d64 the two-group 128x128
# tile (the bias loads held a key tile ahead spilled 402 bytes in the four-group 256x64 tile's 112
# registers per consumer thread, none here).
BIAS_TILE = {**LOCAL_TILE, 64: (Schedule.PINGPONG, 128, 128, 1)}

# Dropout (the persistent schedule only): the two-group 128x128 tile at d64 and d128 (the Philox
# draws' registers beside the four-group 256x64 tile's 112 per consumer thread would spill).
DROPOUT_TILE = {64: (Schedule.PINGPONG, 128, 128, 1), 128: (Schedule.PINGPONG, 128, 128, 1)}


# The tiles the heuristic prefers within its margin, one per (dtype, head dim, mask).
def _default_tile(inst: FmhaSm90Instance) -> tuple | None:
    if inst.dtype is DType.FP8:
        return FP8_TILE.get((inst.head_dim, inst.causal))
    if inst.dropout:
        return DROPOUT_TILE.get(inst.head_dim)
    if inst.bias:
        return BIAS_TILE[inst.head_dim]
    if inst.mask is Mask.LOCAL:
        return LOCAL_TILE[inst.head_dim]
    return DEFAULT_TILE[inst.head_dim, inst.causal]


PREFERRED_DEFAULT: tuple[FmhaSm90Instance, ...] = tuple(
    inst for inst in SPACE
    if (inst.schedule, inst.block_m, inst.block_n, inst.q_buffers) == _default_tile(inst) and inst.lazy_rescale
    and (not inst.softcap or inst.head_dim in SOFTCAP_DEFAULT_HEAD_DIMS)
    and (not inst.bias or (inst.head_dim in BIAS_DEFAULT_HEAD_DIMS and not inst.softcap))
    and (not inst.dropout or inst.head_dim in DROPOUT_HEAD_DIMS)
)
DEFAULT: tuple[FmhaSm90Instance, ...] = PREFERRED_DEFAULT + tuple(
    inst for inst in SPACE
    if (inst.schedule, inst.block_m, inst.block_n, inst.q_buffers) == SHORT_SEQUENCE_TILES.get((inst.head_dim, inst.causal))
    and inst.lazy_rescale and inst.stages == DEFAULT_STAGES[inst.schedule] and inst.dtype is not DType.FP8
    and not inst.softcap and not inst.bias and not inst.dropout and inst.mask is not Mask.LOCAL
)

# Throughput per unit of tile work against fa2_sm80's on the H200 sweep (the heuristic's weight
# between families): 1.6-2.1x at d64-d128, N >= 1024, for the default tiles.
RELATIVE_SPEED = 1.8
