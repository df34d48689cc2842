"""Compiling one instance while a program runs: the generator's entry point for the runtime.

The instance is built into <cache>/jit/<arch> by the ordinary build driver. A file lock
(<cache>/jit/<arch>/.jit.lock) makes N processes that need it build it once: each re-checks the
manifest after taking the lock. A killed build leaves nothing that can be loaded: ninja writes the
library under a temporary name and renames it, and the registry only loads what the manifest,
written last and atomically, lists.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from gemmgen import cache
from gemmgen.arch import Arch
from gemmgen.errors import ManifestError, ToolchainError
from gemmgen.generator import build, manifest, toolchain

_announced: set[str] = set()


def _say(message: str) -> None:
    print(f"gemmgen: {message}", file=sys.stderr, flush=True)


def check_toolchain() -> None:
    """Raise ToolchainError when nvcc or the CUTLASS headers cannot be found."""
    toolchain.find_nvcc()
    toolchain.cutlass_include_dirs()


def is_built(folder: Path, name: str) -> bool:
    """True when the manifest in `folder` lists `name` as built and its library exists."""
    try:
        entries = manifest.load(folder / manifest.MANIFEST_NAME).instances
    except ManifestError:
        return False
    return any(e.name == name and e.state == "built" and (folder / e.library).is_file() for e in entries)


def jit_dir() -> Path:
    """Where instances compiled on demand go: <cache>/jit (one <arch> folder each)."""
    return cache.cache_dir() / "jit"


def compile_instance(arch: Arch, inst: Any, *, purpose: str = "", log: Callable[[str], None] | None = None,
                     jobs: int | None = None) -> None:
    """Build `inst` for `arch` into <cache>/jit/<arch> unless it is built there already.

    `purpose` (the problem it is for) goes into the one-line notice printed before the compile.
    Raises ToolchainError when the toolchain is missing or the compile fails, CacheError when the
    cache directory is not writable."""
    check_toolchain()
    root = cache.writable_dir("jit")
    folder = root / arch.value
    folder.mkdir(exist_ok=True)
    lock = build.hold_lock(folder / ".jit.lock", f"waiting for another process compiling into {folder}", _say)
    try:
        if not is_built(folder, inst.name):
            if inst.name not in _announced:
                _announced.add(inst.name)
                _say(f"compiling {inst.name}{f' for {purpose}' if purpose else ''} into {folder} "
                     f"(once; about a minute)")
            result = build.generate(arch, [inst], out=root, jobs=jobs, log=log or (lambda _: None))
            if inst.name in result.failed:
                raise ToolchainError(f"compiling {inst.name} on demand failed:\n{result.failed[inst.name]}")
    finally:
        lock.release()
