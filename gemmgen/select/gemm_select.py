"""Selection for the batched GEMMs: which compiled GEMM instance runs a problem, and why.

The candidates are the manifest entries (gemmgen.select.registry.load) of KIND "gemm" families. Each
one that cannot run the problem is rejected with a reason: input or output dtype, layout
(b_transposed), strategy, alignment, build state, GPU arch, shared memory. Among the rest:

1. "forced": an instance named by the caller;
2. "tuned": the lowest cost measured in the problem's size bucket in this GPU's tuning database
   (gemmgen.select.tuning_db; `gemmgen profile-gemm --record` writes it): tuned_costs, a candidate's
   time over the fastest's under sustained load or over short runs, whichever is larger;
3. "heuristic": the lowest estimated time, where
       time ~ waves * blocks_per_sm * tile_m * tile_n * K / (tile efficiency * arch rate)
   waves = ceil(tiles / (SMs * blocks_per_sm)), blocks_per_sm from shared memory (at most 2);
   for stream-K instances, which split the K loops over idle SMs, tiles / (SMs * blocks_per_sm)
   times STREAM_K_FIXUP;
   tile efficiency = min(1, tile_m*tile_n / (tile_m+tile_n) / 64) (operand reuse of a tile
   against 128x128's), arch rate 2 for sm_90a wgmma kernels, 1 for mma.sync, 0.5 for the
   2-stage alignment-1 kernels; ties go to the earlier build directory, then the name.
"""
from __future__ import annotations

import dataclasses
import math
from gemmgen.kernels import abi
from gemmgen.select import registry, tuning_db
from gemmgen.select.device import DeviceFacts
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.select.registry import Candidate
from gemmgen.generator.space import FAMILIES, family_named

KIND = "gemm"
STRATEGIES = ("strided", "ptr")
MAX_BLOCKS_PER_SM = 2
STREAM_K_FIXUP = 1.1  # stream-K's estimate: perfectly balanced work, plus the partial-sum fixup
_MAX_CACHED = 4096


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

    @property
    def functional_key(self) -> str:
        layout = "nt" if self.b_transposed else "nn"
        return (f"gemm:{self.strategy}:{self.dtype}:{self.out_dtype}:{layout}:a{self.align}:c{self.align_c}"
                f":sm{self.device.cc[0]}{self.device.cc[1]}")

    @property
    def bucket(self) -> str:
        """Sizes rounded up to powers of two."""
        return f"bh{_pow2(self.batch_count)}_m{_pow2(self.m)}_n{_pow2(self.n)}_k{_pow2(self.k)}"

    def describe(self) -> str:
        layout = "A*B^T" if self.b_transposed else "A*B"
        return (f"{self.strategy} batched GEMM {layout}, {self.dtype} -> {self.out_dtype}, "
                f"{self.batch_count} x [{self.m}x{self.k}]*[{self.k}x{self.n}], alignment {self.align}/{self.align_c}")


def is_gemm(cand: Candidate) -> bool:
    """True when the candidate's family is a GEMM family this gemmgen knows."""
    try:
        return getattr(family_named(cand.entry.family), "KIND", "attention") == KIND
    except KeyError:
        return False


def reject_reason(cand: Candidate, problem: GemmProblem) -> str | None:
    """Why `cand` (a GEMM-family entry) cannot run `problem`, or None if it can."""
    entry, params = cand.entry, cand.entry.params
    checks = (("dtype", problem.dtype), ("out_dtype", problem.out_dtype),
              ("b_transposed", problem.b_transposed), ("strategy", problem.strategy))
    for key, want in checks:
        if params.get(key) != want:
            return f"{key} {params.get(key)}, the problem's is {want}"
    if int(params.get("align", 8)) > problem.align or int(params.get("align_c", 8)) > problem.align_c:
        return (f"needs alignment {params.get('align')}/{params.get('align_c')} elements (A, B / C), "
                f"the problem's is {problem.align}/{problem.align_c}")
    reason = family_named(entry.family).problem_reason(params, problem)
    if reason is not None:
        return reason
    reason = registry.build_reason(cand, problem.device.cc)
    if reason is not None:
        return reason
    if entry.smem_bytes > problem.device.smem_per_block:
        return f"needs {entry.smem_bytes} B of shared memory, this GPU allows {problem.device.smem_per_block} B"
    return None


def candidates(problem: GemmProblem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The GEMM instances that can run `problem`, and (label, reason) for every GEMM one rejected."""
    good, rejected = [], []
    for cand in registry.load()[0]:
        if not is_gemm(cand):
            continue
        reason = reject_reason(cand, problem)
        if reason is None:
            good.append(cand)
        else:
            rejected.append((cand.label, reason))
    return good, rejected


def estimate(cand: Candidate, problem: GemmProblem) -> float:
    """The heuristic's relative time of `cand` on `problem` (see the module docstring)."""
    p = cand.entry.params
    tm, tn, tk = p["tile_m"], p["tile_n"], p["tile_k"]
    smem_per_sm = problem.device.smem_per_sm or problem.device.smem_per_block
    per_sm = max(1, min(MAX_BLOCKS_PER_SM, smem_per_sm // max(cand.entry.smem_bytes, 1)))
    tiles = math.ceil(problem.m / tm) * math.ceil(problem.n / tn) * problem.batch_count
    slots = problem.device.sm_count * per_sm
    # Stream-K splits the K loops of the last wave over the idle SMs (less a fixup's cost).
    waves = tiles / slots * STREAM_K_FIXUP if p.get("tile_scheduler") == "streamk" else math.ceil(tiles / slots)
    efficiency = min(1.0, tm * tn / (tm + tn) / 64)
    rate = 0.5 if int(p.get("align", 8)) == 1 else 2.0 if any("90a" in g for g in cand.entry.gencode) else 1.0
    return waves * per_sm * tm * tn * math.ceil(problem.k / tk) * tk / (efficiency * rate)


@dataclasses.dataclass
class GemmDecision:
    """A GEMM selection and everything behind it."""

    problem: GemmProblem
    winner: Candidate
    source: str  # "forced" | "tuned" | "heuristic"
    candidates: list[Candidate]
    rejected: list[tuple[str, str]]
    measured: dict[str, float]  # name -> ms in the problem's bucket
    estimates: dict[str, float]
    short: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> ms_short, where taken
    alone: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> ms_alone, where taken
    costs: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> tuned_costs

    def report(self) -> str:
        """The decision as `gemmgen explain-gemm` prints it."""
        p = self.problem
        lines = [f"problem: {p.describe()}", f"GPU: {p.device.describe()}",
                 f"functional key: {p.functional_key}", f"bucket: {p.bucket}",
                 f"candidates ({len(self.candidates)}):"]
        for cand in self.candidates:
            mark = "*" if cand is self.winner else " "
            ms = self.measured.get(cand.name)
            tuned = "not measured" if ms is None else f"{ms:.4f} ms" if math.isfinite(ms) else "failed"
            if cand.name in self.short:
                tuned += f", short runs {self.short[cand.name]:.4f} ms"
            if cand.name in self.alone:
                tuned += f", alone under load {self.alone[cand.name]:.4f} ms"
            if cand.name in self.costs:
                tuned += f", cost {self.costs[cand.name]:.3f}"
            est = self.estimates.get(cand.name)
            lines.append(f"  {mark} {cand.name}  [{tuned}]" + (f"  heuristic cost {est:.3g}" if est else ""))
        lines.append(f"rejected ({len(self.rejected)}):")
        lines += [f"    {label}: {reason}" for label, reason in self.rejected]
        lines.append(f"winner: {self.winner.name} ({self.winner.build_dir})")
        lines.append(f"decided by: {self.source}")
        return "\n".join(lines)


def build_command(problem: GemmProblem) -> str | None:
    """The `gemmgen generate` command that builds an instance able to run `problem`, or None."""
    for family in FAMILIES:
        if getattr(family, "KIND", "attention") != KIND:
            continue
        for arch in family.ARCHS:
            if not registry.runs_on(arch.gencode, problem.device.cc):
                continue
            for inst in family.DEFAULT:
                p = inst.params()
                if (p["dtype"], p["out_dtype"], p["b_transposed"], p["strategy"]) == (
                        problem.dtype, problem.out_dtype, problem.b_transposed, problem.strategy) \
                        and p["align"] <= problem.align and p["align_c"] <= problem.align_c:
                    return f"gemmgen generate --arch {arch.value} --family {family.FAMILY}"
    return None


def no_instance_error(problem: GemmProblem, rejected: list[tuple[str, str]], headline: str) -> NoInstanceError:
    """The error listing each GEMM instance's reason and the command that builds one."""
    lines = [headline]
    if not rejected:
        dirs = ", ".join(str(d.resolve()) for d in registry.search_dirs())
        lines.append(f"No built GEMM instances found in {dirs} (set GEMMGEN_BUILD_DIR or call "
                     f"gemmgen.set_build_dirs).")
    lines += [f"  {label}: {reason}" for label, reason in rejected]
    lines += [f"  unreadable manifest: {err}" for err in registry.load()[1]]
    command = build_command(problem)
    lines.append(f"Build one with: {command}" if command else "No gemmgen GEMM family runs this on this GPU.")
    return NoInstanceError("\n".join(lines))


def database_for(problem: GemmProblem) -> tuning_db.TuningDB:
    """The tuning database of the problem's GPU (shared with the attention families)."""
    return tuning_db.cached(problem.device.fingerprint())


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


def decide(problem: GemmProblem, instance: str | None = None, *,
           db: tuning_db.TuningDB | None = None) -> GemmDecision:
    """The decision for `problem` (not cached). Raises InputError for an unknown instance name and
    NoInstanceError, with each GEMM instance's reason, when none can run it."""
    good, rejected = candidates(problem)
    if instance is not None:
        named = [c for c in good if c.name == instance]
        if not named:
            if not any(c.name == instance for c in registry.load()[0]):
                raise InputError(f"no instance named {instance!r} in the build directories")
            mine = [(label, reason) for label, reason in rejected if label.startswith(instance + " ")]
            raise no_instance_error(problem, mine, f"Instance {instance!r} cannot run {problem.describe()}:")
        return GemmDecision(problem, named[0], "forced", named, rejected, {}, {})
    db = database_for(problem) if db is None else db
    here = db.buckets(problem.functional_key).get(problem.bucket, {})
    usable = []
    for cand in good:
        rec = here.get(cand.content_hash)
        if rec is not None and not rec.ok:
            rejected.append((cand.label, f"failed when tuned for bucket {problem.bucket}: {rec.reason}"))
        else:
            usable.append(cand)
    if not usable:
        raise no_instance_error(problem, rejected, f"No gemmgen instance can run {problem.describe()}:")
    recs = {c.name: here[c.content_hash] for c in good if c.content_hash in here}
    measured = {name: r.ms for name, r in recs.items()}
    short = {name: r.ms_short for name, r in recs.items() if r.ms_short is not None}
    alone = {name: r.ms_alone for name, r in recs.items() if r.ms_alone is not None}
    costs = tuned_costs({c.name: recs[c.name] for c in usable if c.name in recs})
    timed = [(costs[c.name], c.order, c.name, i) for i, c in enumerate(usable) if c.name in costs]
    if timed:
        return GemmDecision(problem, usable[min(timed)[3]], "tuned", usable, rejected, measured, {}, short, alone,
                            costs)
    estimates = {c.name: estimate(c, problem) for c in usable}
    pick = min(range(len(usable)), key=lambda i: (estimates[usable[i].name], usable[i].order, usable[i].name))
    return GemmDecision(problem, usable[pick], "heuristic", usable, rejected, measured, estimates)


_selected: dict[tuple[GemmProblem, str | None], Candidate] = {}


def select(problem: GemmProblem, instance: str | None = None) -> Candidate:
    """The candidate that runs `problem` (decide(), cached per problem and instance name)."""
    key = (problem, instance)
    hit = _selected.get(key)
    if hit is None:
        hit = decide(problem, instance).winner
        if len(_selected) >= _MAX_CACHED:
            _selected.clear()
        _selected[key] = hit
    return hit


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


def softmax_candidate(dtype: str, device: DeviceFacts) -> Candidate:
    """The built row-softmax instance of the unfused path for `dtype` (most threads-per-row
    choice is a DEFAULT matter: the first built one wins); NoInstanceError with reasons if none."""
    rejected = []
    for cand in registry.load()[0]:
        if cand.entry.family != "softmax_sm80":
            continue
        if cand.entry.params.get("dtype") != dtype:
            reason = f"dtype {cand.entry.params.get('dtype')}, the problem's is {dtype}"
        elif cand.entry.state != "built" or not cand.library.is_file():
            reason = f"not built ({cand.entry.state})"
        elif not registry.runs_on(cand.entry.gencode, device.cc):
            reason = f"no code for sm_{device.cc[0]}{device.cc[1]}"
        else:
            return cand
        rejected.append((cand.label, reason))
    lines = [f"No softmax instance for {dtype} (the unfused attention path needs one):"]
    lines += [f"  {label}: {reason}" for label, reason in rejected]
    lines.append("Build one with: gemmgen generate --arch sm80 --family softmax_sm80")
    raise NoInstanceError("\n".join(lines))


def clear_cache() -> None:
    """Forget cached decisions (the registry's refresh() calls this)."""
    _selected.clear()


registry.on_refresh(clear_cache)
