"""The batched GEMM kind of the selection engine (gemmgen.select.engine): which compiled GEMM
instance runs a problem, and why.

The candidates are the manifest entries of KIND "gemm" families. Each one that cannot run the
problem is rejected with a reason: input or output dtype, layout (b_transposed), strategy,
alignment, build state, GPU arch, shared memory. A tuned bucket is ranked by tuned_costs (a
candidate's time over the fastest's under sustained load or over short runs, whichever is larger);
buckets have no distance, so there is no nearest-tuned step. The heuristic's estimate:
    time ~ waves * blocks_per_sm * tile_m * tile_n * K / (tile efficiency * arch rate * speed)
waves = ceil(tiles / (SMs * blocks_per_sm)), blocks_per_sm from shared memory (at most 2), the
tiles counted in whole CTA clusters (a 1x2 cluster on an output one tile wide leaves half its CTAs
idle); for stream-K instances, which split the K loops over idle SMs, tiles / (SMs * blocks_per_sm)
times STREAM_K_FIXUP; tile efficiency = min(1, tile_m*tile_n / (tile_m+tile_n) / 64) (operand
reuse of a tile against 128x128's), arch rate 2 for sm_90a wgmma kernels, 1 for mma.sync, 0.5 for
the 2-stage alignment-1 kernels; speed: the family's measured throughput of the tile in the
problem's regime on the problem's GPU model (the family's `speed`; gemm_sm90.PROFILES), 1.0 where
it has none (and then the tile efficiency stands in for it). The padding and cluster terms decide
between tiles of different shapes; the measured speeds between tiles of one shape whose epilogue,
schedule and L2 policy the model cannot see.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from gemmgen.kernels import abi
from gemmgen.select import engine, registry, tuning_db
from gemmgen.select.device import DeviceFacts

from gemmgen.select.registry import Candidate
from gemmgen.generator.space import FAMILIES, family_named

FAMILY_KIND = "gemm"  # the KIND of the families this selects among
STRATEGIES = ("strided", "ptr")
MAX_BLOCKS_PER_SM = 2
STREAM_K_FIXUP = 1.1  # stream-K's estimate: perfectly balanced work, plus the partial-sum fixup


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One batched GEMM call as selection sees it: the functional key (dtypes, layout, strategy,
    alignment, GPU) and the sizes (bucketed for the tuning database)."""

    dtype: str  # "fp16" | "bf16"
    out_dtype: str  # dtype or "fp32"
    b_transposed: bool
    strategy: str  # "strided" | "ptr"
    device: DeviceFacts
    m: int = 1
    n: int = 1
    k: int = 1
    batch_count: int = 1  # batch * num_heads
    align: int = 8  # elements A's and B's pointers, strides and contiguous extents are multiples of
    align_c: int = 8  # the same for C, in output elements
    kind: ClassVar[str] = "gemm"  # the selection engine's Kind for it

    @property
    def functional_key(self) -> str:
        layout = "nt" if self.b_transposed else "nn"
        return (f"gemm:{self.strategy}:{self.dtype}:{self.out_dtype}:{layout}:a{self.align}:c{self.align_c}"
                f":sm{self.device.cc[0]}{self.device.cc[1]}")

    @property
    def bucket(self) -> str:
        """Sizes rounded up to powers of two."""
        return f"bh{_pow2(self.batch_count)}_m{_pow2(self.m)}_n{_pow2(self.n)}_k{_pow2(self.k)}"

    @property
    def bucket_key(self) -> str:
        """The bucket's key in the tuning database."""
        return self.bucket

    def describe(self) -> str:
        layout = "A*B^T" if self.b_transposed else "A*B"
        return (f"{self.strategy} batched GEMM {layout}, {self.dtype} -> {self.out_dtype}, "
                f"{self.batch_count} x [{self.m}x{self.k}]*[{self.k}x{self.n}], alignment {self.align}/{self.align_c}")


def is_gemm(cand: Candidate) -> bool:
    """True when the candidate's family is a GEMM family this gemmgen knows."""
    try:
        return family_named(cand.entry.family).KIND == FAMILY_KIND
    except KeyError:
        return False


def reject_reason(cand: Candidate, problem: GemmProblem) -> str | None:
    """Why `cand` (a GEMM-family entry) cannot run `problem`, or None if it can. Reads the typed
    instance rebuilt from the manifest (Candidate.instance)."""
    try:
        inst = cand.instance
    except (KeyError, ValueError) as exc:
        return f"its manifest params describe no instance of {cand.entry.family} ({exc})"
    checks = (("dtype", inst.dtype.value, problem.dtype), ("out_dtype", inst.out_dtype.value, problem.out_dtype),
              ("b_transposed", inst.b_transposed, problem.b_transposed),
              ("strategy", inst.strategy.value, problem.strategy))
    for key, have, want in checks:
        if have != want:
            return f"{key} {have}, the problem's is {want}"
    if inst.align > problem.align or inst.align_c > problem.align_c:
        return (f"needs alignment {inst.align}/{inst.align_c} elements (A, B / C), "
                f"the problem's is {problem.align}/{problem.align_c}")
    reason = family_named(cand.entry.family).problem_reason(inst, problem)
    if reason is not None:
        return reason
    reason = registry.build_reason(cand, problem.device.cc)
    if reason is not None:
        return reason
    if cand.entry.smem_bytes > problem.device.smem_per_block:
        return f"needs {cand.entry.smem_bytes} B of shared memory, this GPU allows {problem.device.smem_per_block} B"
    return None


def candidates(problem: GemmProblem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The GEMM instances that can run `problem`, and (label, reason) for every GEMM one rejected."""
    return registry.partition(filter(is_gemm, registry.load()[0]), lambda cand: reject_reason(cand, problem))


def padded_work(cand: Candidate, problem: GemmProblem) -> float:
    """waves * blocks_per_sm * tile_m * tile_n * K rounded up to tile_k: the work the candidate's
    grid does on `problem`, padding, idle cluster CTAs and the last wave's idle slots included."""
    inst = cand.instance
    tm, tn, tk = inst.tile_m, inst.tile_n, inst.tile_k
    cm, cn = getattr(inst, "cluster_m", 1), getattr(inst, "cluster_n", 1)
    smem_per_sm = problem.device.smem_per_sm or problem.device.smem_per_block
    per_sm = max(1, min(MAX_BLOCKS_PER_SM, smem_per_sm // max(cand.entry.smem_bytes, 1)))
    tiles = math.ceil(problem.m / (tm * cm)) * cm * math.ceil(problem.n / (tn * cn)) * cn * problem.batch_count
    slots = problem.device.sm_count * per_sm
    # Stream-K splits the K loops of the last wave over the idle SMs (less a fixup's cost).
    waves = tiles / slots * STREAM_K_FIXUP if inst.stream_k else math.ceil(tiles / slots)
    return waves * per_sm * tm * tn * math.ceil(problem.k / tk) * tk


def estimate(cand: Candidate, problem: GemmProblem) -> float:
    """The heuristic's relative time of `cand` on `problem` (see the module docstring)."""
    inst = cand.instance
    speed = measured_speed(cand, problem)
    # A measured speed holds the tile's operand reuse; the shape's efficiency stands in elsewhere.
    efficiency = 1.0 if speed is not None else min(1.0, inst.tile_m * inst.tile_n / (inst.tile_m + inst.tile_n) / 64)
    rate = 0.5 if inst.align == 1 else 2.0 if any("90a" in g for g in cand.entry.gencode) else 1.0
    return padded_work(cand, problem) / (efficiency * rate * (speed or 1.0))


def measured_speed(cand: Candidate, problem: GemmProblem) -> float | None:
    """The family's measured speed of the candidate's tile on the problem (its `speed`), or None."""
    speed = getattr(family_named(cand.entry.family), "speed", None)
    return speed(cand.instance, problem) if speed is not None else None


def regime(cand: Candidate, problem: GemmProblem) -> str:
    """The family's regime of the problem (its `regime`), "" for a family that measured none."""
    regime_of = getattr(family_named(cand.entry.family), "regime", None)
    return regime_of(problem) if regime_of is not None else ""


def build_command(problem: GemmProblem) -> str | None:
    """The `gemmgen generate` command that builds a default instance able to run `problem`, or None."""
    for family in FAMILIES:
        if family.KIND != FAMILY_KIND:
            continue
        for arch in family.ARCHS:
            if not registry.runs_on(arch.gencode, problem.device.cc):
                continue
            for inst in family.DEFAULT:
                if (inst.dtype.value, inst.out_dtype.value, inst.b_transposed, inst.strategy.value) == (
                        problem.dtype, problem.out_dtype, problem.b_transposed, problem.strategy) \
                        and inst.align <= problem.align and inst.align_c <= problem.align_c:
                    explicit = registry.explicit_build_dirs()
                    return registry.generate_command(arch, family.FAMILY, inst.name, True,
                                                     out=explicit[0] if explicit else None)
    return None


def tuned_costs(records: dict[str, tuning_db.Record]) -> dict[str, float]:
    """Each successful record's cost: its time over the fastest record's, under sustained load
    (ms) and over short runs (ms_short), whichever ratio is larger; the sustained ratio alone where
    no short time was taken (the tuning skips candidates that cannot win). Where the finalists were
    also timed alone under load (ms_alone), their load ratio is to the best of those times instead
    of the rotation's: the finalists' ranking is the one taken with the GPU to each of them. The
    best of them alone costs no more than before, and before no other candidate cost less than
    any finalist, so no other candidate costs less than the pick among them.

    Which state a call runs in depends on the work around it, and on output-bound shapes the
    ranking of one state can invert in the other (bench/NOTES.md, experiments 21 and 22): the pick is the
    candidate closest to the best in both, not the best in one. In rotation, a burst starts at
    the clock the candidate before it left (experiments 47 and 48)."""
    ok = {name: r for name, r in records.items() if r.ok}
    if not ok:
        return {}
    best = min(r.ms for r in ok.values())
    shorts = [r.ms_short for r in ok.values() if r.ms_short is not None]
    best_short = min(shorts, default=None)
    alone = [r.ms_alone for r in ok.values() if r.ms_alone is not None]
    best_alone = min(alone, default=None)

    def cost(r: tuning_db.Record) -> float:
        load = r.ms_alone / best_alone if r.ms_alone is not None else r.ms / best
        return max(load, r.ms_short / best_short if r.ms_short is not None else 0.0)

    return {name: cost(r) for name, r in ok.items()}


def kernel(cand: Candidate) -> abi.Kernel:
    """The bound entry points of a GEMM candidate (ABI version checked)."""
    strategy = abi.GEMM_PTR_ARRAY if cand.entry.params["strategy"] == "ptr" else abi.GEMM_STRIDED
    bound = abi.bind_gemm(cand.library, cand.entry.symbol, strategy)
    version = bound.info().abi_version
    if version != abi.ABI_VERSION:
        from gemmgen.errors import GemmgenLaunchError

        raise GemmgenLaunchError(f"{cand.library} implements ABI {version}, this gemmgen calls "
                                 f"{abi.ABI_VERSION}: rebuild it with `gemmgen generate`")
    return bound


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The heuristic's relative time of one candidate (see the module docstring)."""

    cost: float
    speed: float | None = None  # the measured speed the cost divides by (None: the shape's efficiency)
    regime: str = ""

    def describe(self) -> str:
        """e.g. "cost 2.1e+06 (regime short, measured speed 1.16)"."""
        if self.speed is None:
            return f"cost {self.cost:.3g} (speed not measured)"
        return f"cost {self.cost:.3g} (regime {self.regime}, measured speed {self.speed:.2f})"


def heuristic(usable: list[Candidate], problem: GemmProblem) -> tuple[Candidate, dict[str, Estimate]]:
    """The candidate of lowest estimated time (ties: earlier build directory, then name)."""
    estimates = {c.name: Estimate(estimate(c, problem), measured_speed(c, problem), regime(c, problem)) for c in usable}
    pick = min(usable, key=lambda c: (estimates[c.name].cost, c.order, c.name))
    return pick, estimates


KIND = engine.Kind(name="gemm", candidates=candidates, heuristic=heuristic, costs=tuned_costs,
                   build_command=build_command, distance=lambda problem, key: None, noun="GEMM instance")
