"""Runtime registry: read the manifests of the build directories, find the instances that can run a
problem (keeping a reason for each one rejected) and pick one.

Build directories: gemmgen.set_build_dirs(...) if called, else $GEMMGEN_BUILD_DIR (os.pathsep
separated), else ./build. Each holds <arch>/manifest.json files (a directory holding a
manifest.json itself is read too).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path
from typing import Iterable

from gemmgen import abi, manifest
from gemmgen.errors import GemmgenLaunchError, InputError, ManifestError, NoInstanceError
from gemmgen.space import FAMILIES, family_named


@dataclasses.dataclass(frozen=True)
class Problem:
    """What decides which instances can run a call: the functional key, the GPU and the sizes."""

    dtype: str  # "fp16" | "bf16"
    head_dim: int
    causal: bool
    cc: tuple[int, int]  # device compute capability
    smem_limit: int  # shared memory one block may opt into on the device, bytes
    seqlen_q: int = 1
    seqlen_k: int = 1

    def describe(self) -> str:
        """A one-line description for messages."""
        mask = "causal" if self.causal else "no mask"
        return f"{self.dtype} head_dim={self.head_dim} {mask} on sm_{self.cc[0]}{self.cc[1]}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One instance entry of one manifest."""

    entry: manifest.InstanceEntry
    library: Path  # absolute
    build_dir: Path  # the folder of the manifest
    order: int  # position of the build directory in the search list (earlier wins ties)

    @property
    def name(self) -> str:
        """The instance's name."""
        return self.entry.name

    @functools.cached_property
    def kernel(self) -> abi.Instance:
        """The loaded and bound entry points (loaded on first use, then cached)."""
        kernel = abi.bind(self.library, self.entry.symbol)
        version = kernel.info().abi_version
        if version != abi.ABI_VERSION:
            raise GemmgenLaunchError(f"{self.library} implements ABI {version}, this gemmgen calls "
                                     f"{abi.ABI_VERSION}: rebuild it with `gemmgen generate`")
        return kernel


_build_dirs: list[Path] | None = None
_loaded: tuple[list[Candidate], list[str]] | None = None  # (candidates, manifest load errors)
_selected: dict[tuple, Candidate] = {}
_MAX_SELECTED = 4096  # bound the selection cache for workloads with many distinct lengths


def set_build_dirs(dirs: Iterable[str | os.PathLike] | None) -> None:
    """Search `dirs` for manifests from now on (None: back to $GEMMGEN_BUILD_DIR or ./build)."""
    global _build_dirs
    _build_dirs = None if dirs is None else [Path(d) for d in dirs]
    refresh()


def build_dirs() -> list[Path]:
    """The build directories searched, in priority order."""
    if _build_dirs is not None:
        return list(_build_dirs)
    env = os.environ.get("GEMMGEN_BUILD_DIR")
    return [Path(d) for d in env.split(os.pathsep) if d] if env else [Path("build")]


def refresh() -> None:
    """Forget loaded manifests and cached selections (call after a new `gemmgen generate`)."""
    global _loaded
    _loaded = None
    _selected.clear()


def manifest_paths(folder: Path) -> list[Path]:
    """The manifests in `folder`: its own manifest.json and those of its subfolders."""
    own = folder / manifest.MANIFEST_NAME
    return ([own] if own.is_file() else []) + sorted(folder.glob(f"*/{manifest.MANIFEST_NAME}"))


def load() -> tuple[list[Candidate], list[str]]:
    """All instance entries of all manifests (cached), and the errors of manifests that failed to load."""
    global _loaded
    if _loaded is None:
        found, errors = [], []
        for order, folder in enumerate(build_dirs()):
            for path in manifest_paths(folder.resolve()):
                try:
                    data = manifest.load(path)
                except ManifestError as exc:
                    errors.append(str(exc))
                    continue
                found += [Candidate(e, path.parent / e.library, path.parent, order) for e in data.instances]
        _loaded = (found, errors)
    return _loaded


def runs_on(gencode: Iterable[str], cc: tuple[int, int]) -> bool:
    """True if code built with these -gencode flags runs on a device of compute capability `cc`.

    code=sm_XY runs on major X with minor >= Y (sm_XYa only on exactly X.Y); code=compute_XY PTX
    is compiled by the driver for any cc >= X.Y.
    """
    for flag in gencode:
        match = re.search(r"(?:^|[,\s])code=\[?([\w,]+)\]?", flag)  # not the "code=" of "-gencode="
        for code in match.group(1).split(",") if match else ():
            target = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", code)
            if target is None:
                continue
            kind, major, minor, suffix = target.group(1), int(target.group(2)), int(target.group(3)), target.group(4)
            if suffix == "a":
                ok = cc == (major, minor)
            elif kind == "sm":
                ok = cc[0] == major and cc[1] >= minor
            else:
                ok = cc >= (major, minor) if suffix == "" else cc[0] == major and cc[1] >= minor
            if ok:
                return True
    return False


def reject_reason(cand: Candidate, problem: Problem) -> str | None:
    """Why `cand` cannot run `problem`, or None if it can."""
    entry, params = cand.entry, cand.entry.params
    mask = "causal" if problem.causal else "none"
    if params.get("dtype") != problem.dtype:
        return f"dtype {params.get('dtype')}, the problem is {problem.dtype}"
    if params.get("head_dim") != problem.head_dim:
        return f"head_dim {params.get('head_dim')}, the problem has {problem.head_dim}"
    if params.get("mask") != mask:
        return f"mask {params.get('mask')}, the problem needs {mask}"
    if entry.state == "rendered":
        return "rendered but not compiled (run `gemmgen generate` without --no-compile)"
    if entry.state == "failed":
        first = (entry.error or "").strip().splitlines()
        return f"failed to build ({first[0] if first else 'no message'})"
    if not cand.library.is_file():
        return f"library {cand.library} is missing"
    if not runs_on(entry.gencode, problem.cc):
        return f"no code for this GPU's arch sm_{problem.cc[0]}{problem.cc[1]} (built for {' '.join(entry.gencode)})"
    if entry.smem_bytes > problem.smem_limit:
        return f"needs {entry.smem_bytes} B of shared memory, this GPU allows {problem.smem_limit} B per block"
    return None


def candidates(problem: Problem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The instances that can run `problem`, and (label, reason) for every one rejected."""
    good, rejected = [], []
    for cand in load()[0]:
        reason = reject_reason(cand, problem)
        if reason is None:
            good.append(cand)
        else:
            rejected.append((f"{cand.name} ({cand.build_dir})", reason))
    return good, rejected


def _is_default(cand: Candidate) -> bool:
    try:
        return any(inst.name == cand.name for inst in family_named(cand.entry.family).DEFAULT)
    except KeyError:
        return False


def rank_key(cand: Candidate, problem: Problem) -> tuple:
    """The heuristic, smallest first: fewest padded query rows (ceil(Nq / block_m) * block_m, so a
    short sequence does not pay for a tall tile), then the family's DEFAULT tile, then the earlier
    build directory, then the name (deterministic)."""
    block_m = int(cand.entry.params.get("block_m", 1))
    padded = math.ceil(problem.seqlen_q / block_m) * block_m
    return (padded, not _is_default(cand), cand.order, cand.name)


def build_command(problem: Problem) -> str | None:
    """The `gemmgen generate` command that would build an instance for `problem`, or None."""
    mask = "causal" if problem.causal else "none"
    out = "" if build_dirs() == [Path("build")] else f" --out {build_dirs()[0]}"
    for family in FAMILIES:
        for arch in family.ARCHS:
            if not runs_on(arch.gencode, problem.cc):
                continue
            for pool in (family.DEFAULT, family.SPACE):
                for inst in pool:
                    p = inst.params()
                    if (p["dtype"], p["head_dim"], p["mask"]) == (problem.dtype, problem.head_dim, mask):
                        return f"gemmgen generate --arch {arch.value}{out} --filter {inst.name}"
    return None


def _no_instance(problem: Problem, rejected: list[tuple[str, str]], headline: str) -> NoInstanceError:
    errors = load()[1]
    lines = [headline]
    if not rejected:
        dirs = ", ".join(str(d.resolve()) for d in build_dirs())
        lines.append(f"No built instances found in {dirs} (set GEMMGEN_BUILD_DIR or call "
                     f"gemmgen.set_build_dirs).")
    lines += [f"  {label}: {reason}" for label, reason in rejected]
    lines += [f"  unreadable manifest: {err}" for err in errors]
    command = build_command(problem)
    lines.append(f"Build one with: {command}" if command else
                 "No gemmgen family supports this combination on this GPU.")
    return NoInstanceError("\n".join(lines))


def select(problem: Problem, instance: str | None = None) -> Candidate:
    """The instance to run `problem` (cached per problem): `instance` if named, else the heuristic's pick.

    Raises NoInstanceError listing each instance's reason when none can run it, InputError for an
    unknown instance name.
    """
    key = (problem.dtype, problem.head_dim, problem.causal, problem.cc, problem.smem_limit,
           problem.seqlen_q, instance)
    hit = _selected.get(key)
    if hit is not None:
        return hit
    good, rejected = candidates(problem)
    if instance is not None:
        named = [c for c in load()[0] if c.name == instance]
        if not named:
            known = sorted({c.name for c in load()[0]})
            raise InputError(f"no instance named {instance!r} in the build directories; "
                             f"known: {', '.join(known) or 'none'}")
        good = [c for c in good if c.name == instance]
        rejected = [(label, reason) for label, reason in rejected if label.startswith(instance + " ")]
        if not good:
            raise _no_instance(problem, rejected, f"Instance {instance!r} cannot run {problem.describe()}:")
    if not good:
        raise _no_instance(problem, rejected, f"No gemmgen instance can run {problem.describe()}:")
    best = min(good, key=lambda c: rank_key(c, problem))
    if len(_selected) >= _MAX_SELECTED:
        _selected.clear()
    _selected[key] = best
    return best
