"""Selection with compiling on demand: when no built instance can run a call, the instance
`gemmgen generate` would build for it (registry.build_target) is compiled into <cache>/jit through
the generator's entry point (gemmgen.generator.ondemand). GEMMGEN_JIT=0 turns it off."""
from __future__ import annotations

import os
from typing import Callable

from gemmgen.errors import NoInstanceError, ToolchainError
from gemmgen.generator import ondemand
from gemmgen.select import registry, selection
from gemmgen.select.problem import Problem
from gemmgen.select.registry import Candidate

OFF_NOTE = "Compiling on demand is off (GEMMGEN_JIT=0): run the command above, or unset GEMMGEN_JIT."
is_built = ondemand.is_built


def enabled() -> bool:
    """False when GEMMGEN_JIT=0."""
    return os.environ.get("GEMMGEN_JIT", "1").strip() != "0"


def ensure_built(problem: Problem, why: str = "", *, log: Callable[[str], None] | None = None,
                 jobs: int | None = None) -> str:
    """Build the instance that runs `problem` into <cache>/jit unless it is built already; returns its
    name. Raises NoInstanceError (with `why`, the registry's message) when no family supports the
    problem or nvcc / CUTLASS are missing, ToolchainError when the compile fails, CacheError when
    the cache directory is not writable."""
    target = registry.build_target(problem)
    if target is None:
        raise NoInstanceError(why or f"No gemmgen family supports {problem.describe()}.")
    arch, inst = target
    try:
        ondemand.check_toolchain()
    except ToolchainError as exc:
        raise NoInstanceError(f"{why}\nCannot compile it on demand: {exc}") from None
    ondemand.compile_instance(arch, inst, purpose=problem.describe(), log=log, jobs=jobs)
    registry.refresh()
    return inst.name


def select_or_build(problem: Problem, instance: str | None = None) -> Candidate:
    """The selected candidate for `problem`; when there is none (and no instance is named),
    compile one on demand unless GEMMGEN_JIT=0, whose error then says how to build one."""
    try:
        return selection.select(problem, instance)
    except NoInstanceError as exc:
        if instance is not None:
            raise
        if not enabled():
            raise NoInstanceError(f"{exc}\n{OFF_NOTE}") from None
        ensure_built(problem, str(exc))
    return selection.select(problem)
