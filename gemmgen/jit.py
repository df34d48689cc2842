"""Compiling an instance on demand, when no built instance can run a call (GEMMGEN_JIT=0 turns it off).

The instance `gemmgen generate` would build for the problem (gemmgen.registry.build_target) is
built into <cache>/jit/<arch> by the ordinary build driver. A file lock (<cache>/jit/<arch>/.jit.lock)
makes N processes that need it build it once: each re-checks the manifest after taking the lock.
A killed build leaves nothing that can be loaded: ninja writes the library under a temporary name
and renames it, and the registry only loads what the manifest, written last and atomically, lists.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from gemmgen import build, cache, manifest, registry, toolchain
from gemmgen.errors import ManifestError, NoInstanceError, ToolchainError
from gemmgen.problem import Problem
from gemmgen.registry import Candidate

OFF_NOTE = "Compiling on demand is off (GEMMGEN_JIT=0): run the command above, or unset GEMMGEN_JIT."
_announced: set[str] = set()


def enabled() -> bool:
    """False when GEMMGEN_JIT=0."""
    return os.environ.get("GEMMGEN_JIT", "1").strip() != "0"


def is_built(folder: Path, name: str) -> bool:
    """True when the manifest in `folder` lists `name` as built and its library exists."""
    try:
        entries = manifest.load(folder / manifest.MANIFEST_NAME).instances
    except ManifestError:
        return False
    return any(e.name == name and e.state == "built" and (folder / e.library).is_file() for e in entries)


def _say(message: str) -> None:
    print(f"gemmgen: {message}", file=sys.stderr, flush=True)


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
        toolchain.find_nvcc()
        toolchain.cutlass_include_dirs()
    except ToolchainError as exc:
        raise NoInstanceError(f"{why}\nCannot compile it on demand: {exc}") from None
    root = cache.writable_dir("jit")
    folder = root / arch.value
    folder.mkdir(exist_ok=True)
    lock = build.hold_lock(folder / ".jit.lock", f"waiting for another process compiling into {folder}", _say)
    try:
        if not is_built(folder, inst.name):
            if inst.name not in _announced:
                _announced.add(inst.name)
                _say(f"compiling {inst.name} for {problem.describe()} into {folder} (once; about a minute)")
            result = build.generate(arch, [inst], out=root, jobs=jobs, log=log or (lambda _: None))
            if inst.name in result.failed:
                raise ToolchainError(f"compiling {inst.name} on demand failed:\n{result.failed[inst.name]}")
    finally:
        lock.release()
    registry.refresh()
    return inst.name



def select_or_build(problem: Problem, instance: str | None = None) -> Candidate:
    """The selected candidate for `problem`; when there is none (and no instance is named),
    compile one on demand unless GEMMGEN_JIT=0, whose error then says how to build one."""
    from gemmgen import selection

    try:
        return selection.select(problem, instance)
    except NoInstanceError as exc:
        if instance is not None:
            raise
        if not enabled():
            raise NoInstanceError(f"{exc}\n{OFF_NOTE}") from None
        ensure_built(problem, str(exc))
    return selection.select(problem)
