"""The row-softmax kind of the selection engine (the unfused attention path's middle step): any
built softmax_sm80 instance of the dtype that has code for the GPU runs it; among several, the
tuned one or else the earliest built (the threads-per-row choice is a DEFAULT matter)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gemmgen.select import engine, registry
from gemmgen.select.device import DeviceFacts
from gemmgen.select.registry import Candidate

FAMILY = "softmax_sm80"


@dataclasses.dataclass(frozen=True)
class SoftmaxProblem:
    """One row-softmax launch as selection sees it: dtype and GPU (no size buckets)."""

    dtype: str  # "fp16" | "bf16"
    device: DeviceFacts
    kind: ClassVar[str] = "softmax"

    @property
    def functional_key(self) -> str:
        return f"softmax:{self.dtype}:sm{self.device.cc[0]}{self.device.cc[1]}"

    @property
    def bucket_key(self) -> str:
        return "all"

    def describe(self) -> str:
        return f"row softmax, {self.dtype}"


def candidates(problem: SoftmaxProblem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The softmax instances that can run `problem`, and (label, reason) for each rejected one."""
    def reason(cand: Candidate) -> str | None:
        dtype = cand.entry.params.get("dtype")
        return (f"dtype {dtype}, the problem's is {problem.dtype}" if dtype != problem.dtype
                else registry.build_reason(cand, problem.device.cc))

    return registry.partition((c for c in registry.load()[0] if c.entry.family == FAMILY), reason)


@dataclasses.dataclass(frozen=True)
class FirstBuilt:
    """The heuristic's "estimate": every candidate runs the same rows; the first one built wins."""

    def describe(self) -> str:
        return "first built"


def first_built(usable: list[Candidate], problem: SoftmaxProblem) -> tuple[Candidate, dict[str, FirstBuilt]]:
    return usable[0], {c.name: FirstBuilt() for c in usable}


KIND = engine.Kind(name="softmax", candidates=candidates, heuristic=first_built, costs=engine.fastest,
                   build_command=lambda problem: f"gemmgen generate --arch sm80 --family {FAMILY}",
                   distance=lambda problem, key: None, noun="softmax instance")
