"""Runtime registry: read the manifests of the build directories and find the instances that can
run a problem, keeping a reason for each one rejected (gemmgen.select.selection picks among them).

Build directories, in priority order (build_dirs):
- given explicitly, by gemmgen.set_build_dirs(...) or else by $GEMMGEN_BUILD_DIR (os.pathsep
  separated): exactly those folders;
- otherwise ./build of the current directory, then every folder `gemmgen generate` recorded in
  <cache>/builds.json that still exists, most recently generated first (gemmgen.cache);
then, in either case, the installed kernels packages that match this gemmgen
(gemmgen.kernels.packages: prebuilt wheels), then the instances compiled on demand, <cache>/jit.
Each holds <arch>/manifest.json files (a directory holding a manifest.json itself is read too).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Iterable

from gemmgen import cache
from gemmgen.kernels import abi, packages
from gemmgen.generator import manifest, ondemand
from gemmgen.errors import GemmgenLaunchError, ManifestError
from gemmgen.select.problem import Problem
from gemmgen.generator.families.base import AttentionInstance, Instance, Mask
from gemmgen.generator.space import FAMILIES, family_named, select_instances
from gemmgen.arch import Arch, parse_arch


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

    @functools.cached_property
    def label(self) -> str:
        """The name and the build directory, for messages."""
        return f"{self.name} ({self.build_dir})"

    @functools.cached_property
    def instance(self) -> Instance:
        """The typed instance, rebuilt from the entry's params by its family's INSTANCE.from_params.
        Raises KeyError for a family this gemmgen does not know, ValueError for params that
        describe no instance of it."""
        return family_named(self.entry.family).INSTANCE.from_params(self.entry.params)

    @functools.cached_property
    def kernel(self) -> abi.Instance | abi.BwdInstance:
        """The loaded and bound entry points (loaded on first use, then cached): a backward family's
        instance exports the backward's three, a forward's its two."""
        backward = family_named(self.entry.family).KIND == "attention_bwd"
        kernel = (abi.bind_bwd if backward else abi.bind)(self.library, self.entry.symbol)
        version = kernel.info().abi_version
        if version != abi.ABI_VERSION:
            raise GemmgenLaunchError(f"{self.library} implements ABI {version}, this gemmgen calls "
                                     f"{abi.ABI_VERSION}: rebuild it with `gemmgen generate`")
        return kernel


_build_dirs: list[Path] | None = None
_loaded: tuple[list[Candidate], list[str]] | None = None  # (candidates, manifest load errors)
_refresh_hooks: list[Callable[[], None]] = []


DEFAULT_BUILD_DIR = Path("build")


def set_build_dirs(dirs: Iterable[str | os.PathLike] | None) -> None:
    """Search exactly `dirs` (and the on-demand builds) for manifests from now on; None goes back to
    $GEMMGEN_BUILD_DIR, or where that is unset to ./build and the recorded builds."""
    global _build_dirs
    _build_dirs = None if dirs is None else [Path(d) for d in dirs]
    refresh()


def explicit_build_dirs() -> list[Path] | None:
    """The build directories given explicitly: set_build_dirs' list, else $GEMMGEN_BUILD_DIR's
    folders; None when neither is given."""
    if _build_dirs is not None:
        return list(_build_dirs)
    env = os.environ.get("GEMMGEN_BUILD_DIR")
    return [Path(d) for d in env.split(os.pathsep) if d] if env else None


def build_dirs() -> list[Path]:
    """The build directories searched, in priority order (the on-demand builds aside): those given
    explicitly, else ./build followed by the recorded builds that still exist and are not ./build."""
    explicit = explicit_build_dirs()
    if explicit is not None:
        return explicit
    here = DEFAULT_BUILD_DIR.resolve()
    return [DEFAULT_BUILD_DIR] + [d for d in cache.recorded_builds() if d != here]


def jit_dir() -> Path:
    """Where instances compiled on demand go: <cache>/jit."""
    return ondemand.jit_dir()


def package_dirs() -> list[Path]:
    """The folders of the installed kernels packages that match this gemmgen (gemmgen.kernels.packages)."""
    return [p.folder for p in packages.installed() if p.reason is None]


def search_dirs() -> list[Path]:
    """The build directories, then the installed kernels packages, then the on-demand builds (each
    folder once)."""
    dirs = build_dirs()
    seen = {d.resolve() for d in dirs}
    for extra in package_dirs() + [jit_dir()]:
        if extra.resolve() not in seen:
            dirs.append(extra)
            seen.add(extra.resolve())
    return dirs


def on_refresh(hook: Callable[[], None]) -> None:
    """Call `hook` on every refresh() (caches built on the loaded manifests register here)."""
    _refresh_hooks.append(hook)


def refresh() -> None:
    """Forget loaded manifests and cached selections (call after a new `gemmgen generate`)."""
    global _loaded, _shortlists
    _loaded = None
    _shortlists = None
    _build_reasons.clear()
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
                errors += [f"{path}: left out {why}" for why in data.dropped]
        errors += [f"{p.label} left out: {p.reason}" for p in packages.installed() if p.reason is not None]
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


def functional_reason(family: Any, inst: AttentionInstance, problem: Problem) -> str | None:
    """Why `inst`, an instance of the attention family `family`, cannot run `problem` whatever its
    build state: dtype, then head_dim and mask where the instance fixes them (None where it serves
    several, no mask and causal: its family checks them), the logit softcap (an instance built for
    one runs softcap calls only, the others none), then the family's own problem_reason."""
    mask = Mask(problem.mask)
    if inst.dtype.value != problem.dtype:
        return f"dtype {inst.dtype.value}, the problem is {problem.dtype}"
    if inst.head_dim is not None and inst.head_dim != problem.head_dim:
        return f"head_dim {inst.head_dim}, the problem has {problem.head_dim}"
    if inst.mask is not None and inst.mask is not mask:
        return f"mask {inst.mask.value}, the problem needs {mask.value}"
    if inst.mask is None and mask is Mask.LOCAL and not getattr(family, "SLIDING_WINDOW", False):
        # Such an instance serves no mask and causal; a family whose kernel reads the window says so.
        return f"{inst.family} has no sliding window (only instances built for the local mask run one)"
    softcap = getattr(inst, "softcap", False)
    if getattr(problem, "softcap", False) != softcap:  # an instance built for a softcap runs nothing else
        return ("built for a logit softcap; the problem has none" if softcap else
                f"{inst.name} has no logit softcap (only instances built for one, `_sc`, run it)")
    return family.problem_reason(inst, problem)


_build_reasons: dict[tuple, str | None] = {}


def build_reason(cand: Candidate, cc: tuple[int, int]) -> str | None:
    """Why `cand`'s build cannot run on a GPU of compute capability `cc` (any kind of family):
    not compiled, failed, library gone, or no code for the arch. None when it can. Cached until
    refresh() (it looks at the library on disk, for every candidate of every new problem)."""
    key = (str(cand.library), cand.entry.symbol, cand.entry.state, tuple(cand.entry.gencode), cc)
    if key not in _build_reasons:
        _build_reasons[key] = _build_reason(cand, cc)
    return _build_reasons[key]


def _build_reason(cand: Candidate, cc: tuple[int, int]) -> str | None:
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


# Features a family adds after its first builds, named in its MARKED: its instances' params carry
# the mark (True), and an entry built before, without it, is kept from problems that ask for the
# feature. mark -> (what it is, whether a problem asks for it).
MARKS: dict[str, tuple[str, Callable[[Problem], bool]]] = {
    "window": ("sliding windows", lambda problem: getattr(problem, "window", None) is not None),
    "varlen": ("variable lengths", lambda problem: bool(getattr(problem, "varlen", False))),
    "kv_cache": ("key-value caches (key counts on the GPU)", lambda problem: bool(getattr(problem, "kv_cache", False))),
    "deterministic_varlen": ("deterministic calls over variable lengths",
                             lambda problem: bool(getattr(problem, "varlen", False))
                             and bool(getattr(problem, "deterministic", False))),
}


def reject_reason(cand: Candidate, problem: Problem) -> str | None:
    """Why `cand` cannot run `problem`, or None if it can."""
    entry, params = cand.entry, cand.entry.params
    try:
        family = family_named(entry.family)
    except KeyError:
        return f"family {entry.family!r} is unknown to this gemmgen"
    if family.KIND != problem.kind:
        return f"family {entry.family} serves {family.KIND}, not {problem.kind}"
    try:
        inst = cand.instance
    except ValueError as exc:
        return f"its params describe no {entry.family} instance ({exc})"
    reason = functional_reason(family, inst, problem)
    if reason is not None:
        return reason
    for mark in getattr(family, "MARKED", ()):
        what, asks = MARKS[mark]
        if asks(problem) and not params.get(mark):
            return f"built before its family ran {what}: rebuild it with `gemmgen generate`"
    # Fields the current family does not constrain (it runs any strided layout, any GQA ratio,
    # 16-byte aligned data): an instance that declares them in its params is held to them.
    if "layouts" in params and problem.layout not in params["layouts"]:
        return f"layouts {params['layouts']}, the problem's is {problem.layout}"
    if "gqa_ratios" in params and problem.gqa not in params["gqa_ratios"]:
        return f"GQA ratios {params['gqa_ratios']}, the problem's is {problem.gqa}"
    need = int(params.get("align_bytes", 16))
    if problem.align < need:
        return f"needs {need}-byte aligned data and strides, the problem's are {problem.align}-byte aligned"
    reason = build_reason(cand, problem.device.cc)
    if reason is not None:
        return reason
    limit = problem.device.smem_per_block  # what one block may opt into
    if entry.smem_bytes > limit:
        return f"needs {entry.smem_bytes} B of shared memory, this GPU allows {limit} B per block"
    return None


def partition(cands: Iterable[Candidate], reason_of: Callable[[Candidate], str | None]
              ) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """(the candidates whose reason_of is None, (label, reason) for every other one)."""
    good, rejected = [], []
    for cand in cands:
        reason = reason_of(cand)
        if reason is None:
            good.append(cand)
        else:
            rejected.append((cand.label, reason))
    return good, rejected


def _of_kind(cand: Candidate, kind: str) -> bool:
    """True when the candidate's family serves `kind`, or is unknown (its reject reason says so)."""
    try:
        return family_named(cand.entry.family).KIND == kind
    except KeyError:
        return True


def candidates(problem: Problem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The instances of the problem's kind (forward or backward attention) that can run it, and
    (label, reason) for every one of that kind rejected."""
    return partition([c for c in load()[0] if _of_kind(c, problem.kind)], lambda cand: reject_reason(cand, problem))


_shortlists: dict[tuple, list[tuple[int, Candidate]]] | None = None


def shortlist(problem: Problem) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """candidates(problem)'s instances that can run it, found among the entries of its kind, dtype,
    head dim and mask only (an index of the loaded entries: every other entry fails those checks),
    with the reasons of the few of those rejected. The same good list at a fraction of the cost, for
    selection's cached path; candidates() gives every reason, for reports and errors."""
    global _shortlists
    if _shortlists is None:
        index: dict[tuple, list[tuple[int, Candidate]]] = {}
        for position, cand in enumerate(load()[0]):
            try:
                inst = cand.instance
                key = (family_named(cand.entry.family).KIND, inst.dtype.value, inst.head_dim,
                       None if inst.mask is None else inst.mask.value)
            except (KeyError, ValueError, AttributeError):
                continue  # an unknown family or params: rejected with its reason by candidates()
            index.setdefault(key, []).append((position, cand))
        _shortlists = index
    keys = {(problem.kind, problem.dtype, hd, m) for hd in (problem.head_dim, None) for m in (problem.mask, None)}
    pool = [c for _, c in sorted(e for key in keys for e in _shortlists.get(key, ()))]  # in load order
    return partition(pool, lambda cand: reject_reason(cand, problem))


def build_target(problem: Problem) -> tuple[Any, Any] | None:
    """(arch, instance) that `gemmgen generate` would build to run `problem` (a family's DEFAULT
    tile first), or None when no family supports it on this GPU."""
    for family in FAMILIES:
        for arch in family.ARCHS:
            if not runs_on(arch.gencode, problem.device.cc):
                continue
            if family.KIND != problem.kind:
                continue
            for pool in (family.DEFAULT, family.SPACE):
                for inst in pool:
                    if (functional_reason(family, inst, problem) is None
                            and inst.smem_bytes <= problem.device.smem_per_block):
                        return arch, inst
    return None


def generate_command(arch: Arch | str, family_name: str, instance_name: str, in_default: bool, *,
                     out: str | os.PathLike | None = None) -> str:
    """The `gemmgen generate` command that builds exactly the instance `instance_name` of the family
    `family_name` for `arch`, pasteable into a POSIX shell: --family always, --all unless the
    instance is in the family's DEFAULT set (`in_default`), --filter the name (anchored as
    ^name$ when the bare name would also match another instance of that pool), and --out `out`
    when given. Raises KeyError for an unknown family or arch."""
    arch = arch if isinstance(arch, Arch) else parse_arch(arch)
    family = family_named(family_name)
    pattern = instance_name
    if len(select_instances(arch, all_instances=not in_default, pattern=pattern,
                            families={family.FAMILY})) != 1:
        pattern = f"^{instance_name}$"
    words = ["gemmgen", "generate", "--arch", arch.value]
    if out is not None:
        words += ["--out", str(out)]
    words += ["--filter", pattern, "--family", family.FAMILY]
    if not in_default:
        words.append("--all")
    return " ".join(shlex.quote(w) for w in words)


def build_command(problem: Problem) -> str | None:
    """The `gemmgen generate` command that would build an instance for `problem` (build_target's),
    or None; with build directories given explicitly it writes into the first of them (--out)."""
    target = build_target(problem)
    if target is None:
        return None
    arch, inst = target
    family = family_named(inst.family)
    explicit = explicit_build_dirs()
    return generate_command(arch, family.FAMILY, inst.name, inst in family.DEFAULT,
                            out=explicit[0] if explicit else None)


