"""Selection for every kind of operation, through the one engine (gemmgen.select.engine): a
problem's `kind` names its Kind (attention forward and backward, batched GEMM, row softmax); decide() explains, select()
caches the winner per problem and instance name. refresh() of the registry forgets the cache."""
from __future__ import annotations

import dataclasses

from gemmgen.errors import GemmgenError
from gemmgen.generator.space import FAMILIES, family_named
from gemmgen.select import (attention_bwd_select, attention_select, engine, gemm_select, heuristic, registry,
                            softmax_select)
from gemmgen.select.engine import NEAREST_MAX_DISTANCE, SOURCES, WRONG_RESULT, Decision  # noqa: F401 (the engine's names, for callers of this module)
from gemmgen.select.registry import Candidate

KINDS: dict[str, engine.Kind] = {k.name: k for k in (attention_select.KIND, attention_bwd_select.KIND,
                                                   gemm_select.KIND, softmax_select.KIND)}
_MAX_CACHED = 4096  # bound the cache for workloads with many distinct lengths
_selected: dict[tuple[object, str | None], Candidate] = {}


def kind_of(problem: engine.KindProblem) -> engine.Kind:
    """The Kind that selects for `problem` (by its `kind` field)."""
    return KINDS[problem.kind]


def decide(problem: engine.KindProblem, instance: str | None = None, *, db=None, report: bool = True) -> Decision:
    """The decision for `problem` (not cached): see gemmgen.select.engine for the order. report=False
    skips listing every rejected instance (the winner is the same)."""
    return engine.decide(kind_of(problem), problem, instance, db=db, report=report)


def select(problem: engine.KindProblem, instance: str | None = None) -> Candidate:
    """The candidate that runs `problem` (decide()'s winner, cached per problem and instance name)."""
    key = (problem, instance)
    hit = _selected.get(key)
    if hit is None:
        hit = decide(problem, instance, report=False).winner
        if len(_selected) >= _MAX_CACHED:
            _selected.clear()
        _selected[key] = hit
    return hit


def splits(cand: Candidate, problem: engine.KindProblem) -> int:
    """The num_splits a launch of `cand` on `problem` passes: the heuristic's count for a family
    that splits keys over CTAs (PACKS_GQA), 0 (none) for the others."""
    if not getattr(family_named(cand.instance.family), "PACKS_GQA", False):
        return 0
    return heuristic.split_plan(cand.instance, problem)[1]


def padded_backward_head_dim(problem) -> int:
    """The head dim a backward `problem` (a BwdProblem) runs at: its own, or a larger one its
    inputs are padded to with zero columns (gemmgen.ops.padding), where that one's best instance
    belongs to a family enough faster: its RELATIVE_SPEED times d / D (the extra columns' cost)
    above that of the best instance at d. The larger head dims tried are each default-built backward
    family's next one above d (fmha_bwd_sm90's 128 for 96 on Hopper, where fa2_bwd_sm80 runs 96 at
    half its speed, or for a sliding window at 32, which only split-dQ instances run).
    `problem.head_dim` when nothing runs it at any of them (selection reports that)."""
    d = problem.head_dim
    try:
        best, found = family_named(select(problem).entry.family).RELATIVE_SPEED, d
    except GemmgenError:
        best, found = 0.0, d
    for dp in _next_backward_head_dims(d):
        try:
            speed = family_named(select(at_head_dim(problem, dp)).entry.family).RELATIVE_SPEED * d / dp
        except GemmgenError:
            continue
        if speed > best:
            best, found = speed, dp
    return found


def at_head_dim(problem, dp: int):
    """`problem` with its inputs padded to head dim dp: the head dim, and the offsets grown with it."""
    d = problem.head_dim
    return dataclasses.replace(problem, head_dim=dp, max_offset=problem.max_offset * dp // d + dp)


def _next_backward_head_dims(d: int) -> list[int]:
    """Each default-built backward family's smallest head dim above d."""
    nxt = {min((x for x in f.HEAD_DIMS if x > d), default=None)
           for f in FAMILIES if f.KIND == "attention_bwd" and f.BUILT_BY_DEFAULT}
    return sorted(x for x in nxt if x is not None)


def needs_tuning(problem: engine.KindProblem) -> bool:
    """True when some candidate of `problem` has no measurement in its bucket on this GPU."""
    return engine.needs_tuning(kind_of(problem), problem)


def database_for(problem: engine.KindProblem):
    """The tuning database of the problem's GPU (empty when there is none)."""
    return engine.database_for(problem)


def no_instance_error(problem: engine.KindProblem, rejected: list[tuple[str, str]], headline: str):
    """The NoInstanceError for `problem`: each reason and the command that builds an instance."""
    return engine.no_instance_error(kind_of(problem), problem, rejected, headline)


def clear_cache() -> None:
    """Forget cached decisions (the registry's refresh() calls this)."""
    _selected.clear()


registry.on_refresh(clear_cache)
