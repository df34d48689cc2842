"""Selection: which candidate runs a problem, and why.

Order of decision, for the candidates the registry found (gemmgen.select.registry.candidates):

1. "forced": an instance named by the caller.
2. "tuned": the fastest candidate measured in the problem's own size bucket (gemmgen.select.buckets) in
   this GPU's tuning database.
3. "nearest-tuned": the fastest candidate measured in the nearest tuned bucket of the same
   functional key, if it is within NEAREST_MAX_DISTANCE doublings.
4. "heuristic": gemmgen.select.heuristic's cost model.
5. No candidate: NoInstanceError listing each instance's reason and the command that builds one.

A candidate whose measurement in this bucket failed (launch error, wrong result) is rejected here
with that reason; one that gave a wrong result in any bucket of the functional key is rejected for
every bucket. Decisions are cached per problem (select); refresh() forgets them.
"""
from __future__ import annotations

import dataclasses
from gemmgen.select import buckets, heuristic, registry, tuning_db
from gemmgen.errors import InputError
from gemmgen.select.problem import Problem
from gemmgen.select.registry import Candidate

NEAREST_MAX_DISTANCE = 2.0
WRONG_RESULT = "wrong result"  # prefix of a record's reason when the output check failed
SOURCES = ("forced", "tuned", "nearest-tuned", "heuristic")
_MAX_CACHED = 4096  # bound the caches for workloads with many distinct lengths


@dataclasses.dataclass
class Decision:
    """A selection and everything behind it."""

    problem: Problem
    winner: Candidate
    source: str  # one of SOURCES
    candidates: list[Candidate]
    rejected: list[tuple[str, str]]  # (label, reason)
    measured: dict[str, tuple[float, str | None]]  # name -> (ms, reason) in the bucket used
    estimates: dict[str, heuristic.Estimate]
    from_bucket: str | None = None  # the bucket whose measurements decided (tuned, nearest-tuned)
    database: str | None = None  # the tuning database's path

    def report(self) -> str:
        """The decision as `gemmgen explain` prints it."""
        p = self.problem
        lines = [f"problem: {p.describe()}, {p.describe_sizes()}",
                 f"GPU: {p.device.describe()}",
                 f"bucket: {p.bucket.key} (sizes rounded up to powers of two)",
                 f"tuning database: {self.database or 'none'}",
                 f"candidates ({len(self.candidates)}):"]
        for cand in self.candidates:
            mark = "*" if cand is self.winner else " "
            ms, reason = self.measured.get(cand.name, (None, None))
            tuned = ("not measured" if ms is None else f"{ms:.4f} ms" if ms != float("inf")
                     else f"failed: {reason}")
            est = self.estimates.get(cand.name)
            lines.append(f"  {mark} {cand.name}  [{tuned}]" + (f"  heuristic: {est.describe()}" if est else ""))
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
            gap = buckets.distance(self.problem.bucket, buckets.parse_key(self.from_bucket))
            return (f"nearest tuned bucket {self.from_bucket}, {gap:g} doublings away "
                    f"({self._measured_count()} measured)")
        return ("heuristic (no tuned bucket within "
                f"{NEAREST_MAX_DISTANCE:g} doublings; see gemmgen/heuristic.py)")

    def _measured_count(self) -> str:
        names = {c.name for c in self.candidates}
        done = sum(1 for n in self.measured if n in names)
        return f"{done} of {len(self.candidates)} candidates"


def database_for(problem: Problem) -> tuning_db.TuningDB:
    """The tuning database of the problem's GPU (empty when there is none)."""
    return tuning_db.cached(problem.device.fingerprint())


def _pick_measured(cands: list[Candidate], recs: dict[str, tuning_db.Record]) -> Candidate | None:
    timed = [(recs[c.content_hash].ms, c.order, c.name, i) for i, c in enumerate(cands)
             if c.content_hash in recs and recs[c.content_hash].ok]
    return cands[min(timed)[3]] if timed else None


def _measured(cands: list[Candidate], recs: dict[str, tuning_db.Record]) -> dict[str, tuple[float, str | None]]:
    return {c.name: (recs[c.content_hash].ms, recs[c.content_hash].reason) for c in cands
            if c.content_hash in recs}


def decide(problem: Problem, instance: str | None = None, *,
           db: tuning_db.TuningDB | None = None) -> Decision:
    """The decision for `problem` (not cached). Raises InputError for an unknown instance name and
    NoInstanceError, with each instance's reason, when no candidate can run it."""
    good, rejected = registry.candidates(problem)
    if instance is not None:
        if not any(c.name == instance for c in registry.load()[0]):
            known = sorted({c.name for c in registry.load()[0]})
            raise InputError(f"no instance named {instance!r} in the build directories; "
                             f"known: {', '.join(known) or 'none'}")
        named = [c for c in good if c.name == instance]
        if not named:
            mine = [(label, reason) for label, reason in rejected if label.startswith(instance + " ")]
            raise registry.no_instance_error(problem, mine, f"Instance {instance!r} cannot run "
                                                            f"{problem.describe()}:")
        return Decision(problem, named[0], "forced", named, rejected, {}, {})
    db = database_for(problem) if db is None else db
    by_bucket = db.buckets(problem.functional_key)
    bucket = problem.bucket.key
    here = by_bucket.get(bucket, {})
    wrong = {h for recs in by_bucket.values() for h, r in recs.items()
             if (r.reason or "").startswith(WRONG_RESULT)}
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
        raise registry.no_instance_error(problem, rejected, f"No gemmgen instance can run {problem.describe()}:")
    path = str(db.path) if db.path is not None and db.path.exists() else None
    winner = _pick_measured(usable, here)
    if winner is not None:
        return Decision(problem, winner, "tuned", usable, rejected, _measured(good, here), {},
                        from_bucket=bucket, database=path)
    near = []
    for key, recs in by_bucket.items():
        try:
            gap = buckets.distance(problem.bucket, buckets.parse_key(key))
        except InputError:
            continue
        pick = _pick_measured(usable, recs)
        if pick is not None and gap <= NEAREST_MAX_DISTANCE:
            near.append((gap, -len(recs), key, pick))
    if near:
        _, _, key, pick = min(near, key=lambda n: n[:3])
        return Decision(problem, pick, "nearest-tuned", usable, rejected, _measured(good, by_bucket[key]), {},
                        from_bucket=key, database=path)
    pick, estimates = heuristic.choose(usable, problem)
    return Decision(problem, pick, "heuristic", usable, rejected, _measured(good, here), estimates,
                    database=path)


_selected: dict[tuple[Problem, str | None], Candidate] = {}


def select(problem: Problem, instance: str | None = None) -> Candidate:
    """The candidate that runs `problem` (decide(), cached per problem and instance name)."""
    key = (problem, instance)
    hit = _selected.get(key)
    if hit is None:
        hit = decide(problem, instance).winner
        if len(_selected) >= _MAX_CACHED:
            _selected.clear()
        _selected[key] = hit
    return hit


def clear_cache() -> None:
    """Forget cached decisions (the registry's refresh() calls this)."""
    _selected.clear()


def needs_tuning(problem: Problem) -> bool:
    """True when some candidate of `problem` has no measurement in its bucket on this GPU."""
    good, _ = registry.candidates(problem)
    here = database_for(problem).buckets(problem.functional_key).get(problem.bucket.key, {})
    return any(c.content_hash not in here for c in good)


registry.on_refresh(clear_cache)
