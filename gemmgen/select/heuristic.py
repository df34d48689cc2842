"""The heuristic that picks an instance when the tuning database has nothing for a problem.

A simple cost model, from the instance's cost inputs (`cost_inputs`, gemmgen.generator.families.base.
CostInputs: block_m, block_n, stages, threads and shared memory), rebuilt from the manifest
(Candidate.instance):

- Work of one CTA: its padded query rows (block_m) times the key columns it computes (the keys it
  can see rounded up to block_n; for causal, row tile i sees (i+1)*block_m keys top-left, Nk - Nq
  more bottom-right), so a tall tile on a short sequence pays for the rows it pads.
- Residency: CTAs per SM = the fewest of shared memory per SM / (smem + 1 KB reserved), threads per
  SM / threads, and registers: 64K per SM at the instance's registers per thread (CostInputs;
  ASSUMED_REGS_PER_THREAD, what ptxas gives fa2_sm80's tiles, unless the family measured others)
  allocated per warp in units of 256.
- Pipeline: a CTA's first K/V loads are exposed, as if it computed PROLOGUE_COLS more key columns,
  divided by the instance's `stages`: K/V buffers loading ahead hide them. An epilogue that is not
  overlapped adds the instance's `epilogue_cols` per row tile (fmha_sm90's O stored from registers).
- Time: waves = ceil(CTAs / (SMs * CTAs per SM)), each as long as the mean CTA work divided by
  the CTA's share of the SM (warps / 8, no more than 1: 8 resident warps keep an SM busy), and
  by the family's RELATIVE_SPEED (its measured throughput per unit of this work against fa2_sm80's):
  a wgmma kernel does the same tile work about twice as fast.

A family that packs GQA groups and splits keys (PACKS_GQA, the decode family) is modelled on its
own grid: a row tile holds block_m of the Nq * (H / Hkv) rows of one KV head, and `num_splits` CTAs
share its keys, each computing its share of them at no less than STREAM_ROWS rows per key column
(streaming K and V costs a CTA that much whatever its rows).

The model knows nothing of how efficient each tile's code is, so the family's default tile (the
one measured best at most shapes; PREFERRED_DEFAULT where a family also builds other tiles by
default) keeps the pick unless another candidate's estimate is at least PREFER_MARGIN lower.
Among estimates within TIE of the best, the tile closest to the default wins (fewest doublings
between their integer params), then the earlier build directory, then the name.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from gemmgen.select.problem import Problem
from gemmgen.generator.families.base import AttentionInstance
from gemmgen.generator.space import family_named

ASSUMED_REGS_PER_THREAD = 255
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_RESERVED_PER_CTA = 1024
WARPS_TO_FILL_SM = 8
# Calibrated on every tile of the H200 sweep (bench/results/sm80_fa_sweep_h200_candidates.txt):
# the pick is 0.987 of the best on average (0.946 at worst) against 0.979 (0.874) for the default
# tile alone. Two stages pay at N = 512 (+5-14%, one exposed 128-column load out of 8 key tiles) and
# are noise from N = 2048; a 64-row tile's 10% less causal work at N = 512 pays at d128, while its
# 5.6% at N = 1024 does not (0.95-0.96x), hence the 8% margin.
PREFER_MARGIN = 0.08
PROLOGUE_COLS = 128.0
TIE = 0.02


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The model's view of one candidate on one problem (time in arbitrary units)."""

    ctas: int
    ctas_per_sm: int
    waves: int
    padded_rows: int
    time: float

    def describe(self) -> str:
        """e.g. "2048 CTAs, 2/SM, 8 waves, est 1.05e+08"."""
        return (f"{self.ctas} CTAs, {self.ctas_per_sm}/SM, {self.waves} wave{'s' * (self.waves != 1)}, "
                f"est {self.time:.3g}")


def _sum_ceil(count: int, step: int, unit: int) -> int:
    """sum over j = 1..count of ceil(j * step / unit) * unit, in closed form per period."""
    if count <= 0:
        return 0
    g = math.gcd(step, unit)
    period = unit // g  # after `period` terms the value grows by step * period exactly
    first = [-(-j * step // unit) * unit for j in range(1, min(count, period) + 1)]
    if count <= period:
        return sum(first)
    full, rest = divmod(count, period)
    grow = step * period  # added to each term of a later period
    total = full * sum(first) + grow * period * full * (full - 1) // 2
    total += sum(first[:rest]) + rest * grow * full
    return total


def ctas_per_sm(smem_bytes: int, threads: int, problem: Problem, regs_per_thread: int = ASSUMED_REGS_PER_THREAD) -> int:
    """Resident CTAs per SM, limited by shared memory, threads and registers (at least 1)."""
    dev = problem.device
    smem_per_sm = dev.smem_per_sm or dev.smem_per_block
    by_smem = smem_per_sm // (smem_bytes + SMEM_RESERVED_PER_CTA) if smem_bytes else 32
    warps = max(1, -(-threads // 32))
    regs_per_warp = -(-regs_per_thread * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (regs_per_warp * warps)
    by_threads = dev.max_threads_per_sm // max(threads, 1)
    return max(1, min(by_smem, by_regs, by_threads))


# Split-KV: at most this many splits (the kernel's limit is 256; the combine reads every split's fp32
# rows, 3 us at 16 splits and 9 at 128 on an H100).
MAX_SPLITS = 128
# Contiguous caches: the split CTAs of a call fill at most this many per SM, in one wave: on an
# H100, over nine decode shapes (B 1-32, Hkv 8-32, Nk 1k-128k, d 64 and 128), the fastest split
# count was every time the one that made about 256 CTAs (2 per SM), though 3 fit: fewer, longer
# CTAs spend less on each one's Q load, pipeline fill and merge, and a second wave's tail costs more
# than it fills (bench/NOTES.md, experiment 94).
SPLIT_CTAS_PER_SM = 2
# Paged caches: a CTA's rows come from pages in the block table's order, and two CTAs per SM left
# 15-20% of the bandwidth unused where a contiguous cache lost nothing (experiment 96). Where each
# split keeps at least PAGED_MIN_TILES key tiles, a paged call takes more splits when they fill the
# waves at the full residency better: the fewest within PAGED_WAVE_FILL of the fullest (at 3-5 key
# tiles a split, the extra splits cost more than they gave).
PAGED_WAVE_FILL = 0.95
PAGED_MIN_TILES = 6
# Split-KV tiles: the row count below which a tile's MMAs stop being what its key columns cost (the
# K and V bytes are), so a 16-row tile wins one KV group of up to 16 rows, and two such tiles, which
# read K and V twice, no longer beat one 64-row tile for 32 rows.
STREAM_ROWS = 32


def num_splits(row_ctas: int, key_tiles: int, ctas_per_sm_: int, sm_count: int, *, paged: bool = False) -> int:
    """How many CTAs share one row tile's keys (`row_ctas` row tiles: B * Hkv * row tiles per KV
    head; `key_tiles` key tiles each): as many as keep every split CTA in one wave of
    min(ctas_per_sm_, SPLIT_CTAS_PER_SM) CTAs per SM (`sm_count` SMs), at most MAX_SPLITS and one
    key tile each (1 when the row tiles alone fill more than half of those slots); `paged`: or, if
    more, the fewest of at most key_tiles / PAGED_MIN_TILES whose waves at ctas_per_sm_ per SM are
    within PAGED_WAVE_FILL of the fullest (busy slots over all waves' slots). Then the fewest that
    split the key tiles as evenly (no split left without a tile)."""
    if row_ctas <= 0 or key_tiles <= 1:
        return 1
    slots = sm_count * max(1, min(ctas_per_sm_, SPLIT_CTAS_PER_SM))
    splits = max(1, min(MAX_SPLITS, key_tiles, slots // row_ctas))
    limit = min(MAX_SPLITS, key_tiles // PAGED_MIN_TILES)
    full = sm_count * max(1, ctas_per_sm_)
    if paged and limit > splits and row_ctas < full:

        def fill(count: int) -> float:
            ctas = row_ctas * count
            return ctas / (-(-ctas // full) * full)

        best = max(fill(s) for s in range(1, limit + 1))
        splits = max(splits, next(s for s in range(1, limit + 1) if fill(s) >= PAGED_WAVE_FILL * best))
    per_split = -(-key_tiles // splits)
    return -(-key_tiles // per_split)


def _keys_read(problem: Problem) -> int:
    """The keys a PACKS_GQA instance's row tile reads: every key, or under a sliding window bounded on
    the left about its width plus the query rows."""
    if problem.window is None or problem.window[0] < 0:
        return problem.seqlen_k
    left, right = problem.window
    return min(problem.seqlen_k, left + problem.seqlen_q + 1 + max(0, right))


def split_plan(inst: AttentionInstance, problem: Problem) -> tuple[int, int]:
    """(row tiles per KV head, splits) of a PACKS_GQA instance on `problem`."""
    cost = inst.cost_inputs
    rows = problem.seqlen_q * problem.gqa
    row_tiles = -(-rows // cost.block_m)
    groups = problem.batch_heads // max(problem.gqa, 1)
    key_tiles = -(-_keys_read(problem) // cost.block_n)
    splits = num_splits(row_tiles * groups, key_tiles, ctas_per_sm(cost.smem_bytes, cost.threads, problem, cost.regs_per_thread),
                        problem.device.sm_count, paged=problem.paged)
    return row_tiles, splits


def _estimate_split(inst: AttentionInstance, problem: Problem) -> Estimate:
    cost = inst.cost_inputs
    row_tiles, splits = split_plan(inst, problem)
    groups = problem.batch_heads // max(problem.gqa, 1)
    key_tiles = -(-_keys_read(problem) // cost.block_n)
    cols = -(-key_tiles // splits) * cost.block_n  # the longest split's keys
    ctas = row_tiles * groups * splits
    per_sm = ctas_per_sm(cost.smem_bytes, cost.threads, problem, cost.regs_per_thread)
    waves = -(-ctas // (problem.device.sm_count * per_sm)) if ctas else 0
    share = min(1.0, (cost.threads / 32) / WARPS_TO_FILL_SM)
    # A key column costs a CTA at least STREAM_ROWS rows of MMA work: its K and V bytes stream in.
    mean_work = max(cost.block_m, STREAM_ROWS) * (cols + PROLOGUE_COLS / cost.stages) if ctas else 0.0
    return Estimate(ctas=ctas, ctas_per_sm=per_sm, waves=waves, padded_rows=row_tiles * cost.block_m,
                    time=waves * mean_work / share / family_named(inst.family).RELATIVE_SPEED)


def estimate(inst: AttentionInstance, problem: Problem) -> Estimate:
    """The model's estimate for an attention instance (a candidate's `instance`)."""
    if getattr(family_named(inst.family), "PACKS_GQA", False):
        return _estimate_split(inst, problem)
    cost = inst.cost_inputs
    block_m, block_n = cost.block_m, cost.block_n
    row_tiles = -(-problem.seqlen_q // block_m)
    keys_full = -(-problem.seqlen_k // block_n) * block_n
    if problem.causal and problem.causal_alignment == "bottom_right" and problem.seqlen_q != problem.seqlen_k:
        # Row tile i sees min(Nk, (i+1)*block_m + Nk - Nq) keys (none below 0), in whole key tiles.
        offset = problem.seqlen_k - problem.seqlen_q
        cols = sum(-(-min(problem.seqlen_k, max(0, (i + 1) * block_m + offset)) // block_n) * block_n
                   for i in range(row_tiles))
    elif problem.window is not None:
        # Row tile i reads the key tiles from its first row's left window edge to its last row's right one.
        left, right = problem.window
        offset = 0 if problem.causal_alignment == "top_left" else problem.seqlen_k - problem.seqlen_q
        cols = 0
        for i in range(row_tiles):
            first, last = i * block_m, min(problem.seqlen_q, (i + 1) * block_m) - 1
            lo = 0 if left < 0 else max(0, first + offset - left)
            hi = problem.seqlen_k if right < 0 else min(problem.seqlen_k, last + offset + right + 1)
            cols += max(0, -(-hi // block_n) - lo // block_n) * block_n
    elif problem.causal:
        # Row tile i sees min(Nk, (i+1)*block_m) keys: the tiles before the key end is reached
        # grow by block_m each, the rest compute every key tile.
        growing = min(row_tiles, problem.seqlen_k // block_m)
        cols = _sum_ceil(growing, block_m, block_n) + (row_tiles - growing) * keys_full
    else:
        cols = row_tiles * keys_full
    ctas = row_tiles * problem.batch_heads
    per_sm = ctas_per_sm(cost.smem_bytes, cost.threads, problem, cost.regs_per_thread)
    waves = -(-ctas // (problem.device.sm_count * per_sm)) if ctas else 0
    share = min(1.0, (cost.threads / 32) / WARPS_TO_FILL_SM)
    mean_work = block_m * (cols / row_tiles + PROLOGUE_COLS / cost.stages + cost.epilogue_cols) if row_tiles else 0.0
    return Estimate(ctas=ctas, ctas_per_sm=per_sm, waves=waves, padded_rows=row_tiles * block_m,
                    time=waves * mean_work / share / family_named(inst.family).RELATIVE_SPEED)


def _default_params(params: dict[str, Any], family: Any) -> dict[str, Any] | None:
    """The params of the first of `family`'s preferred default instances (PREFERRED_DEFAULT where the
    family names some, else DEFAULT) that `params` match outside the tile sizes."""
    for inst in getattr(family, "PREFERRED_DEFAULT", family.DEFAULT):
        default = inst.params()
        if all(params.get(k) == v for k, v in default.items() if not _is_size(k, v)):
            return default
    return None


def _is_size(key: str, value: Any) -> bool:
    """A tile-size param (an int other than head_dim): what the tile distance counts."""
    return isinstance(value, int) and not isinstance(value, bool) and key != "head_dim"


_tile_distances: dict[tuple[str, str], float] = {}


def tile_distance(cand: Any) -> float:
    """Doublings between the candidate's integer params and its family's DEFAULT instance for the
    same dtype, head_dim and mask (0 for the default itself; large when there is no default).
    Cached per instance (family and name fix the params)."""
    key = (cand.instance.family, cand.name)
    hit = _tile_distances.get(key)
    if hit is None:
        hit = _tile_distances[key] = _tile_distance(cand)
    return hit


def _tile_distance(cand: Any) -> float:
    params = cand.instance.params()
    default = _default_params(params, family_named(cand.instance.family))
    if default is None:
        return 1e9
    gap = 0.0
    for key, value in default.items():
        if _is_size(key, value):
            mine = params.get(key)
            gap += abs(math.log2(mine / value)) if isinstance(mine, int) and mine > 0 and value > 0 else 1.0
    return gap


def choose(cands: list[Any], problem: Problem) -> tuple[Any, dict[str, Estimate]]:
    """The heuristic's pick among `cands` (not empty) and each candidate's estimate, by name."""
    estimates = {c.name: estimate(c.instance, problem) for c in cands}
    best_time = min(e.time for e in estimates.values())
    defaults = [c for c in cands if tile_distance(c) == 0]
    if defaults:
        default = min(defaults, key=lambda c: (estimates[c.name].time, c.order, c.name))
        if estimates[default.name].time <= best_time / (1 - PREFER_MARGIN):
            return default, estimates
    near = [c for c in cands if estimates[c.name].time <= best_time * (1 + TIE)]
    pick = min(near, key=lambda c: (tile_distance(c), estimates[c.name].time, c.order, c.name))
    return pick, estimates
