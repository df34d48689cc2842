"""The one selection engine: which built instance runs a problem, and why, for every kind of
operation (attention forward, batched GEMM; each kind plugs in as a Kind).

Order of decision, for the candidates the kind finds among the registry's entries:

1. "forced": an instance named by the caller.
2. "tuned": the lowest cost measured in the problem's own size bucket in this GPU's tuning
   database (the kind ranks the records: attention by time, GEMM by gemm_select.tuned_costs).
3. "nearest-tuned": the lowest cost in the nearest tuned bucket of the same functional key, within
   NEAREST_MAX_DISTANCE doublings (for kinds whose buckets have a distance).
4. "heuristic": the kind's cost model.
5. No candidate: NoInstanceError listing each instance's reason and the command that builds one.

A candidate whose measurement in this bucket failed (launch error, wrong result) is rejected with
that reason; one that gave a wrong result in any bucket of the functional key is rejected for every
bucket. Ties go to the earlier build directory, then the name.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Protocol

from gemmgen.errors import InputError, NoInstanceError
from gemmgen.select import registry, tuning_db
from gemmgen.select.registry import Candidate

NEAREST_MAX_DISTANCE = 2.0
WRONG_RESULT = "wrong result"  # prefix of a record's reason when the output check failed
SOURCES = ("forced", "tuned", "nearest-tuned", "heuristic")


class KindProblem(Protocol):
    """What the engine reads of a problem of any kind."""

    device: Any  # gemmgen.select.device.DeviceFacts

    @property
    def functional_key(self) -> str: ...

    @property
    def bucket_key(self) -> str: ...

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of operation as the engine sees it.

    candidates(problem) -> (instances that can run it, (label, reason) for each rejected one of
    this kind); heuristic(usable, problem) -> (pick, {name: estimate with describe()});
    costs({name: record}) -> {name: cost} for successful tuning records (lower wins);
    build_command(problem) -> the `gemmgen generate` command that builds an instance, or None;
    distance(problem, bucket_key) -> doublings to another bucket, or None where nearest-tuned does
    not apply; noun names the instances in messages."""

    name: str
    candidates: Callable[[Any], tuple[list[Candidate], list[tuple[str, str]]]]
    heuristic: Callable[[list[Candidate], Any], tuple[Candidate, dict[str, Any]]]
    costs: Callable[[dict[str, tuning_db.Record]], dict[str, float]]
    build_command: Callable[[Any], "str | None"]
    distance: Callable[[Any, str], "float | None"]
    noun: str = "instance"
    describe_sizes: Callable[[Any], str] = lambda problem: ""
    # candidates()'s good list with only some of the rejected (cheaper), for decisions nobody reads
    # the report of; None: candidates() serves both.
    shortlist: Callable[[Any], tuple[list[Candidate], list[tuple[str, str]]]] | None = None


def fastest(records: dict[str, tuning_db.Record]) -> dict[str, float]:
    """Costs as measured times: the fastest successful record wins."""
    return {name: r.ms for name, r in records.items() if r.ok}


@dataclasses.dataclass
class Decision:
    """A selection and everything behind it."""

    problem: Any
    kind: Kind
    winner: Candidate
    source: str  # one of SOURCES
    candidates: list[Candidate]
    rejected: list[tuple[str, str]]  # (label, reason)
    records: dict[str, tuning_db.Record]  # name -> record in the bucket used
    estimates: dict[str, Any]  # name -> the heuristic's estimate (describe())
    costs: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> tuned cost
    from_bucket: str | None = None  # the bucket whose measurements decided (tuned, nearest-tuned)
    database: str | None = None  # the tuning database's path

    @property
    def measured(self) -> dict[str, tuple[float, str | None]]:
        """name -> (ms, failure reason) in the bucket used."""
        return {name: (r.ms, r.reason) for name, r in self.records.items()}

    def report(self) -> str:
        """The decision as `gemmgen explain` prints it."""
        p = self.problem
        sizes = self.kind.describe_sizes(p)
        lines = [f"problem: {p.describe()}{', ' + sizes if sizes else ''}",
                 f"GPU: {p.device.describe()}",
                 f"functional key: {p.functional_key}",
                 f"bucket: {p.bucket_key} (sizes rounded up to powers of two)",
                 f"tuning database: {self.database or 'none'}",
                 f"candidates ({len(self.candidates)}):"]
        for cand in self.candidates:
            mark = "*" if cand is self.winner else " "
            lines.append(f"  {mark} {cand.name}  [{_tuned_text(self.records.get(cand.name), self.costs.get(cand.name))}]"
                         + (f"  heuristic: {self.estimates[cand.name].describe()}" if cand.name in self.estimates else ""))
        lines.append(f"rejected ({len(self.rejected)}):")
        lines += [f"    {label}: {reason}" for label, reason in self.rejected]
        lines.append(f"winner: {self.winner.name} ({self.winner.build_dir})")
        lines.append(f"decided by: {self.explain_source()}")
        return "\n".join(lines)

    def explain_source(self) -> str:
        """Where the decision came from, in words."""
        if self.source == "forced":
            return "forced (instance named by the caller)"
        if self.source == "tuned":
            return f"tuned bucket {self.from_bucket} ({self._measured_count()} measured)"
        if self.source == "nearest-tuned":
            gap = self.kind.distance(self.problem, self.from_bucket)
            return (f"nearest tuned bucket {self.from_bucket}, {gap:g} doublings away "
                    f"({self._measured_count()} measured)")
        return f"heuristic (no tuned bucket within {NEAREST_MAX_DISTANCE:g} doublings; the {self.kind.name} cost model)"

    def _measured_count(self) -> str:
        names = {c.name for c in self.candidates}
        done = sum(1 for n in self.records if n in names)
        return f"{done} of {len(self.candidates)} candidates"


def _tuned_text(rec: tuning_db.Record | None, cost: float | None) -> str:
    if rec is None:
        return "not measured"
    if not rec.ok:
        return f"failed: {rec.reason}"
    text = f"{rec.ms:.4f} ms"
    if rec.ms_short is not None:
        text += f", short runs {rec.ms_short:.4f} ms"
    if rec.ms_alone is not None:
        text += f", alone under load {rec.ms_alone:.4f} ms"
    if cost is not None and cost != rec.ms:
        text += f", cost {cost:.3f}"
    return text


def database_for(problem: KindProblem) -> tuning_db.TuningDB:
    """The tuning database of the problem's GPU (empty when there is none)."""
    return tuning_db.cached(problem.device.fingerprint())


def no_instance_error(kind: Kind, problem: KindProblem, rejected: list[tuple[str, str]],
                      headline: str) -> NoInstanceError:
    """The error listing each instance's reason, what the registry could not read or left out (manifests,
    kernels packages) and the command that builds one."""
    lines = [headline]
    if not rejected:
        dirs = ", ".join(str(d.resolve()) for d in registry.search_dirs())
        lines.append(f"No built {kind.noun}s found in {dirs} (`gemmgen list` shows the builds gemmgen "
                     f"knows of; GEMMGEN_BUILD_DIR or gemmgen.set_build_dirs name others).")
    lines += [f"  {label}: {reason}" for label, reason in rejected]
    lines += [f"  not read: {err}" for err in registry.load()[1]]
    command = kind.build_command(problem)
    lines.append(f"Build one with: {command}" if command else
                 "No gemmgen family supports this combination on this GPU.")
    return NoInstanceError("\n".join(lines))


def _cheapest(cands: list[Candidate], costs: dict[str, float]) -> Candidate | None:
    timed = [(costs[c.name], c.order, c.name, i) for i, c in enumerate(cands) if c.name in costs]
    return cands[min(timed)[3]] if timed else None


def _by_name(cands: list[Candidate], recs: dict[str, tuning_db.Record]) -> dict[str, tuning_db.Record]:
    return {c.name: recs[c.content_hash] for c in cands if c.content_hash in recs}


def decide(kind: Kind, problem: KindProblem, instance: str | None = None, *,
           db: tuning_db.TuningDB | None = None, report: bool = True) -> Decision:
    """The decision for `problem` (not cached). Raises InputError for an unknown instance name and
    NoInstanceError, with each instance's reason, when no candidate can run it. report=False: the
    same winner from the kind's shortlist, the Decision's rejected list then partial (errors still
    list every reason)."""
    short = not report and kind.shortlist is not None
    good, rejected = kind.shortlist(problem) if short else kind.candidates(problem)
    if short and (instance is not None and not any(c.name == instance for c in good) or not good):
        return decide(kind, problem, instance, db=db)  # an error to raise: with every reason
    if instance is not None:
        named = [c for c in good if c.name == instance]
        if not named:
            mine = [(label, reason) for label, reason in rejected if label.startswith(instance + " ")]
            if not mine:
                known = sorted({c.name for c in good} | {label.split(" ")[0] for label, _ in rejected})
                raise InputError(f"no instance named {instance!r} among the {kind.name} instances in the build "
                                 f"directories; known: {', '.join(known) or 'none'}")
            raise no_instance_error(kind, problem, mine, f"Instance {instance!r} cannot run {problem.describe()}:")
        return Decision(problem, kind, named[0], "forced", named, rejected, {}, {})
    db = database_for(problem) if db is None else db
    by_bucket = db.buckets(problem.functional_key)
    bucket = problem.bucket_key
    here = by_bucket.get(bucket, {})
    wrong = {h for recs in by_bucket.values() for h, r in recs.items() if (r.reason or "").startswith(WRONG_RESULT)}
    usable = []
    for cand in good:
        rec = here.get(cand.content_hash)
        if rec is not None and not rec.ok:
            rejected.append((cand.label, f"failed when tuned for bucket {bucket}: {rec.reason}"))
        elif cand.content_hash in wrong:
            rejected.append((cand.label, "gave a wrong result when tuned for another bucket"))
        else:
            usable.append(cand)
    if not usable:
        if short:
            return decide(kind, problem, instance, db=db)  # the error with every reason
        raise no_instance_error(kind, problem, rejected, f"No gemmgen {kind.noun} can run {problem.describe()}:")
    path = str(db.path) if db.path is not None and db.path.exists() else None
    costs = kind.costs(_by_name(usable, here))
    winner = _cheapest(usable, costs)
    if winner is not None:
        return Decision(problem, kind, winner, "tuned", usable, rejected, _by_name(good, here), {}, costs,
                        from_bucket=bucket, database=path)
    near = []
    for key, recs in by_bucket.items():
        gap = kind.distance(problem, key)
        if gap is None or not math.isfinite(gap) or gap > NEAREST_MAX_DISTANCE:
            continue
        there = kind.costs(_by_name(usable, recs))
        pick = _cheapest(usable, there)
        if pick is not None:
            near.append((gap, -len(recs), key, pick, there))
    if near:
        _, _, key, pick, there = min(near, key=lambda n: n[:3])
        return Decision(problem, kind, pick, "nearest-tuned", usable, rejected, _by_name(good, by_bucket[key]), {},
                        there, from_bucket=key, database=path)
    pick, estimates = kind.heuristic(usable, problem)
    return Decision(problem, kind, pick, "heuristic", usable, rejected, _by_name(good, here), estimates,
                    database=path)


def needs_tuning(kind: Kind, problem: KindProblem) -> bool:
    """True when some candidate of `problem` has no measurement in its bucket on this GPU."""
    good, _ = kind.candidates(problem)
    here = database_for(problem).buckets(problem.functional_key).get(problem.bucket_key, {})
    return any(c.content_hash not in here for c in good)
