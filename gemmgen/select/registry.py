"""Runtime registry: read the manifests of the build directories and find the instances that can
run a problem, keeping a reason for each one rejected (gemmgen.select.selection picks among them).

Build directories: gemmgen.set_build_dirs(...) if called, else $GEMMGEN_BUILD_DIR (os.pathsep
separated), else ./build; then the instances compiled on demand, <cache>/jit. Each holds
<arch>/manifest.json files (a directory holding a manifest.json itself is read too).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from gemmgen import cache
from gemmgen.kernels import abi
from gemmgen.generator import manifest, ondemand
from gemmgen.errors import GemmgenLaunchError, ManifestError, NoInstanceError
from gemmgen.select.problem import Problem
from gemmgen.generator.space import FAMILIES, family_named


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

    @property
    def content_hash(self) -> str:
        """The instance's build key: what the tuning database files its measurements under."""
        return self.entry.content_hash

    @property
    def label(self) -> str:
        """The name and the build directory, for messages."""
        return f"{self.name} ({self.build_dir})"

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
_refresh_hooks: list[Callable[[], None]] = []


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


def jit_dir() -> Path:
    """Where instances compiled on demand go: <cache>/jit."""
    return ondemand.jit_dir()


def search_dirs() -> list[Path]:
    """The build directories, then the on-demand builds."""
    dirs = build_dirs()
    return dirs + ([jit_dir()] if jit_dir() not in dirs else [])


def on_refresh(hook: Callable[[], None]) -> None:
    """Call `hook` on every refresh() (caches built on the loaded manifests register here)."""
    _refresh_hooks.append(hook)


def refresh() -> None:
    """Forget loaded manifests and cached selections (call after a new `gemmgen generate`)."""
    global _loaded
    _loaded = None
    for hook in _refresh_hooks:
        hook()


def manifest_paths(folder: Path) -> list[Path]:
    """The manifests in `folder`: its own manifest.json and those of its subfolders."""
    own = folder / manifest.MANIFEST_NAME
    return ([own] if own.is_file() else []) + sorted(folder.glob(f"*/{manifest.MANIFEST_NAME}"))


def load() -> tuple[list[Candidate], list[str]]:
    """All instance entries of all manifests (cached), and the errors of manifests that failed to load."""
    global _loaded
    if _loaded is None:
        found, errors = [], []
        for order, folder in enumerate(search_dirs()):
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


def functional_reason(family: Any, params: dict, problem: Problem) -> str | None:
    """Why an instance of `family` with `params` cannot run `problem` whatever its build state:
    dtype, then head_dim and mask where the params fix them (a family whose instances serve a
    range of head dims or masks leaves them out and checks them itself), then the family's own
    problem_reason."""
    mask = "causal" if problem.causal else "none"
    if params.get("dtype") != problem.dtype:
        return f"dtype {params.get('dtype')}, the problem is {problem.dtype}"
    if "head_dim" in params and params["head_dim"] != problem.head_dim:
        return f"head_dim {params['head_dim']}, the problem has {problem.head_dim}"
    if "mask" in params and params["mask"] != mask:
        return f"mask {params['mask']}, the problem needs {mask}"
    return family.problem_reason(params, problem)


def build_reason(cand: Candidate, cc: tuple[int, int]) -> str | None:
    """Why `cand`'s build cannot run on a GPU of compute capability `cc` (any kind of family):
    not compiled, failed, library gone, or no code for the arch. None when it can."""
    entry = cand.entry
    if entry.state == "rendered":
        return "rendered but not compiled (run `gemmgen generate` without --no-compile)"
    if entry.state == "failed":
        first = (entry.error or "").strip().splitlines()
        return f"failed to build ({first[0] if first else 'no message'})"
    if not cand.library.is_file():
        return f"library {cand.library} is missing"
    if not runs_on(entry.gencode, cc):
        return f"no code for this GPU's arch sm_{cc[0]}{cc[1]} (built for {' '.join(entry.gencode)})"
    return None


def reject_reason(cand: Candidate, problem: Problem) -> str | None:
    """Why `cand` cannot run `problem`, or None if it can."""
    entry, params = cand.entry, cand.entry.params
    try:
        family = family_named(entry.family)
    except KeyError:
        return f"family {entry.family!r} is unknown to this gemmgen"
    if getattr(family, "KIND", "attention") != "attention":
        return f"family {entry.family} is not a fused attention family"
    reason = functional_reason(family, params, problem)
    if reason is not None:
        return reason
    # Fields the current family does not constrain (it runs any strided layout, any GQA ratio,
    # 16-byte aligned data): an instance that declares them in its params is held to them.
    if "layouts" in params and problem.layout not in params["layouts"]:
        return f"layouts {params['layouts']}, the problem's is {problem.layout}"
    if "gqa_ratios" in params and problem.gqa not in params["gqa_ratios"]:
        return f"GQA ratios {params['gqa_ratios']}, the problem's is {problem.gqa}"
    need = int(params.get("align_bytes", 16))
    if problem.align < need:
        return f"needs {need}-byte aligned data and strides, the problem's are {problem.align}-byte aligned"
    reason = build_reason(cand, problem.cc)
    if reason is not None:
        return reason
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
            rejected.append((cand.label, reason))
    return good, rejected


def build_target(problem: Problem) -> tuple[Any, Any] | None:
    """(arch, instance) that `gemmgen generate` would build to run `problem` (a family's DEFAULT
    tile first), or None when no family supports it on this GPU."""
    for family in FAMILIES:
        for arch in family.ARCHS:
            if not runs_on(arch.gencode, problem.cc):
                continue
            if getattr(family, "KIND", "attention") != "attention":
                continue
            for pool in (family.DEFAULT, family.SPACE):
                for inst in pool:
                    if (functional_reason(family, inst.params(), problem) is None
                            and inst.smem_bytes <= problem.smem_limit):
                        return arch, inst
    return None


def build_command(problem: Problem) -> str | None:
    """The `gemmgen generate` command that would build an instance for `problem`, or None."""
    target = build_target(problem)
    if target is None:
        return None
    out = "" if build_dirs() == [Path("build")] else f" --out {build_dirs()[0]}"
    return f"gemmgen generate --arch {target[0].value}{out} --filter {target[1].name}"


def no_instance_error(problem: Problem, rejected: list[tuple[str, str]], headline: str,
                      note: str | None = None) -> NoInstanceError:
    """The error listing each instance's reason, unreadable manifests and the command to build one."""
    errors = load()[1]
    lines = [headline]
    if not rejected:
        dirs = ", ".join(str(d.resolve()) for d in search_dirs())
        lines.append(f"No built instances found in {dirs} (set GEMMGEN_BUILD_DIR or call "
                     f"gemmgen.set_build_dirs).")
    lines += [f"  {label}: {reason}" for label, reason in rejected]
    lines += [f"  unreadable manifest: {err}" for err in errors]
    command = build_command(problem)
    lines.append(f"Build one with: {command}" if command else
                 "No gemmgen family supports this combination on this GPU.")
    if note and command:
        lines.append(note)
    return NoInstanceError("\n".join(lines))

