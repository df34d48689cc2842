"""The attention forward kind of the selection engine: candidates and their reasons from the
registry, the heuristic's cost model, buckets with a distance (nearest-tuned applies), the fastest
measured time wins a tuned bucket."""
from __future__ import annotations

from typing import Any

from gemmgen.errors import InputError
from gemmgen.select import buckets, engine, heuristic, registry
from gemmgen.select.problem import Problem


def _distance(problem: Problem, key: str) -> float | None:
    try:
        return buckets.distance(problem.bucket, buckets.parse_key(key))
    except InputError:
        return None


def _sizes(problem: Any) -> str:
    return problem.describe_sizes()


KIND = engine.Kind(name="attention", candidates=registry.candidates, heuristic=heuristic.choose,
                   costs=engine.fastest, build_command=registry.build_command, distance=_distance,
                   describe_sizes=_sizes, shortlist=registry.shortlist)
