"""The `gemmgen` command: generate (render + compile + register), package, list, run, profile, explain,
tune."""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from gemmgen import __version__
from gemmgen.generator import manifest, space
from gemmgen.arch import Arch, parse_arch
from gemmgen.errors import GemmgenError, GemmgenWarning, InputError, ManifestError

EXIT_USAGE = 2


def _fail(message: str, code: int = 1) -> int:
    print(f"gemmgen: error: {message}", file=sys.stderr)
    return code


def os_error_message(exc: OSError) -> str:
    """One line for an OSError: "<file>: <reason>" where the error names a file, else its text."""
    if exc.filename is not None and exc.strerror:
        files = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else f"{exc.filename}"
        return f"{files}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def check_regex(pattern: str | None) -> None:
    """Raise InputError("invalid regex '<pattern>' : <reason>") when `pattern` is not a valid regex."""
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as exc:
        raise InputError(f"invalid regex {pattern!r} : {exc}") from None


def generate_families(names: list[str] | None) -> set[str]:
    """The families `generate` builds: those named (KeyError for an unknown one; "all" names every
    family), else those built by default (fa2_sm80, fmha_sm90). The others build only when named,
    since the default set alone fills most of a small machine's build budget."""
    if not names:
        return {f.FAMILY for f in space.FAMILIES if space.built_by_default(f)}
    if "all" in names:
        return {f.FAMILY for f in space.FAMILIES}
    return {space.family_named(name).FAMILY for name in names}


def cmd_generate(args: argparse.Namespace) -> int:
    """Render and compile the default set (or --all, or --filter's) for each --arch into --out, then
    record the folder in the cache directory so that the registry finds it from any directory."""
    from gemmgen.generator import build  # imports filelock/jinja only when generating

    try:
        check_regex(args.filter)
    except InputError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        archs = [parse_arch(a) for a in args.arch]
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        families = generate_families(args.family)
    except KeyError as exc:
        known = ", ".join(f.FAMILY for f in space.FAMILIES)
        return _fail(f"unknown family {exc.args[0]!r}; known: {known}", EXIT_USAGE)
    plans: list[tuple[Arch, list]] = []
    for arch in archs:
        chosen = space.select_instances(arch, all_instances=args.all, pattern=args.filter, families=families)
        if not chosen:
            pool = "space" if args.all else "default set"
            hint = "" if args.all else "; --all searches the whole space"
            what = f"--filter {args.filter!r} matches" if args.filter else "there is"
            return _fail(f"{what} no instance of {', '.join(sorted(families))} in {arch.value}'s {pool}{hint}",
                         EXIT_USAGE)
        plans.append((arch, chosen))
    out = Path(args.out)
    built = failed = up_to_date = 0
    elapsed = 0.0
    recorded = False
    for arch, chosen in plans:
        try:
            result = build.generate(arch, chosen, out=out, jobs=args.jobs, compile=not args.no_compile)
        except GemmgenError as exc:
            return _fail(str(exc))
        if not recorded:
            record_build(out)
            recorded = True
        built, up_to_date = built + len(result.built), up_to_date + len(result.up_to_date)
        failed += len(result.failed)
        elapsed += result.elapsed
        for name, error in result.failed.items():
            print(f"\nFAILED {name}:\n{error}", file=sys.stderr)
        print(f"manifest: {result.manifest_path}")
    if args.no_compile:
        print(f"{sum(len(c) for _, c in plans)} rendered, not compiled, in {elapsed:.1f} s")
    else:
        print(f"{built} built, {failed} failed, {up_to_date} up to date in {elapsed:.1f} s")
    print(f"build folder: {out.resolve()}")
    explain_visibility(out)
    return 1 if failed else 0


def cmd_package(args: argparse.Namespace) -> int:
    """Build the chosen instances of one --arch into --build-dir (as generate does; --no-build takes
    the folder as it is), then write the built ones as a kernels wheel into --out-dir."""
    from gemmgen.generator import package

    try:
        arch = parse_arch(args.arch)
        families = generate_families(args.family)
        check_regex(args.filter)
    except (ValueError, InputError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyError as exc:
        return _fail(f"unknown family {exc.args[0]!r}; known: {', '.join(f.FAMILY for f in space.FAMILIES)}",
                     EXIT_USAGE)
    names = None
    if not args.no_build:
        generate = argparse.Namespace(arch=[args.arch], out=args.build_dir, filter=args.filter, all=args.all,
                                      jobs=args.jobs, no_compile=False, family=args.family)
        status = cmd_generate(generate)
        if status != 0:
            return _fail("not packaged: the build above did not complete", status)
        names = {i.name for i in space.select_instances(arch, all_instances=args.all, pattern=args.filter,
                                                         families=families)}
    try:
        wheel = package.write_wheel(Path(args.build_dir), arch, Path(args.out_dir), names)
    except GemmgenError as exc:
        return _fail(str(exc))
    print(f"wrote {wheel.path} ({wheel.instances} instances, {wheel.path.stat().st_size / 2**20:.1f} MiB)")
    print(f"install it next to gemmgen {__version__}: pip install {wheel.path}")
    return 0


def record_build(out: Path) -> None:
    """Record `out` in the cache directory's list of builds; a cache that cannot be written costs a
    warning, not the build."""
    from gemmgen import cache

    try:
        cache.record_build(out)
    except GemmgenError as exc:
        print(f"gemmgen: warning: {exc}", file=sys.stderr)


def explain_visibility(out: Path) -> None:
    """Say whether the registry will search `out`: always, unless build directories are given
    explicitly ($GEMMGEN_BUILD_DIR) without it."""
    from gemmgen.select import registry

    explicit = registry.explicit_build_dirs()
    if explicit is not None and out.resolve() not in {d.resolve() for d in explicit}:
        print(f"note: GEMMGEN_BUILD_DIR is set and does not name {out.resolve()}: only its folders are "
              f"searched, so add this one to it to use this build", file=sys.stderr)


def manifest_summary(path: Path) -> tuple[str, str, str]:
    """(arch, instance count, states) of the manifest at `path`; an unreadable one says why."""
    try:
        data = manifest.load(path)
    except ManifestError as exc:
        return path.parent.name, "?", f"unreadable: {' '.join(str(exc).split())}"
    states: dict[str, int] = {}
    for e in data.instances:
        states[e.state] = states.get(e.state, 0) + 1
    text = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return data.arch, str(len(data.instances)), text or "empty"


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def cmd_list(args: argparse.Namespace) -> int:
    """Without --out: every build the registry searches (folder, arch, instance counts by state).
    With --out: every instance of the manifests under that folder."""
    from gemmgen.select import registry

    if args.out is None:
        from gemmgen.kernels import packages

        rows = [("folder", "arch", "instances", "states")]
        searched = registry.search_dirs()
        for folder in searched:
            for path in registry.manifest_paths(folder.resolve()):
                rows.append((str(folder.resolve()), *manifest_summary(path)))
        rows += [(p.label, p.info.get("arch", "?"), str(p.info.get("instances", "?")), f"left out: {p.reason}")
                 for p in packages.installed() if p.reason is not None]
        if len(rows) == 1:
            where = ", ".join(str(d.resolve()) for d in searched)
            return _fail(f"no builds found (searched {where}); run `gemmgen generate --arch sm80`")
        _print_table(rows)
        print("(the instances of one build: gemmgen list --out FOLDER)")
        return 0
    paths = registry.manifest_paths(Path(args.out))
    if not paths:
        return _fail(f"no manifest under {args.out}; run `gemmgen generate --arch sm80 --out {args.out}`")
    rows = [("name", "family", "params", "arch", "state")]
    for path in paths:
        try:
            data = manifest.load(path)
        except ManifestError as exc:
            return _fail(str(exc))
        for e in data.instances:
            params = " ".join(f"{k}={v}" for k, v in e.params.items())
            rows.append((e.name, e.family, params, e.arch, e.state))
    _print_table(rows)
    return 0


def check_run_args(args: argparse.Namespace) -> None:
    """Raise InputError for `gemmgen run` arguments no call could run: sizes below 1, key/value
    heads that do not divide --heads, a head dim no family supports, --iters below 1."""
    for option, value in (("--batch", args.batch), ("--heads", args.heads), ("--seq-len", args.seq_len),
                          ("--head-dim", args.head_dim), ("--heads-kv", args.heads_kv),
                          ("--seq-len-k", args.seq_len_k), ("--iters", args.iters)):
        if value is not None and value < 1:
            raise InputError(f"{option} must be at least 1, got {value}")
    if args.heads_kv is not None and args.heads % args.heads_kv:
        raise InputError(f"--heads-kv {args.heads_kv} must divide --heads {args.heads}")
    from gemmgen.generator.space import describe_head_dims

    dims = space.supported_head_dims()
    if args.head_dim not in dims:
        raise InputError(f"--head-dim {args.head_dim} is not supported; supported: {describe_head_dims(dims)}")


def cmd_run(args: argparse.Namespace) -> int:
    """Check the arguments, then (on a CUDA GPU) run fused_attention on random inputs; optionally
    verify against float64 and time it."""
    try:
        check_run_args(args)
    except InputError as exc:
        return _fail(str(exc), EXIT_USAGE)
    from gemmgen.cli import run as runner  # imports torch

    try:
        return runner.run(args)
    except GemmgenError as exc:
        return _fail(str(exc))


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A handler that calls `run(args)`, turning gemmgen errors into a message and an exit status:
    2 for bad arguments (InputError), 1 otherwise."""
    def handler(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except InputError as exc:
            return _fail(str(exc), EXIT_USAGE)
        except GemmgenError as exc:
            return _fail(str(exc))
    return handler


def _command(sub: argparse._SubParsersAction, name: str, help: str, description: str | None = None
             ) -> argparse.ArgumentParser:
    """A sub-command whose --help starts with `description` (default: `help`)."""
    return sub.add_parser(name, help=help, description=description or help[0].upper() + help[1:] + ".")


def _module_command(sub: argparse._SubParsersAction, module: Any, name: str, help: str,
                    description: str | None = None) -> argparse.ArgumentParser:
    """A sub-command (as `_command`) served by a module of gemmgen.cli: its arguments from
    `module.add_arguments`, its handler `module.run`, guarded."""
    p = _command(sub, name, help, description)
    module.add_arguments(p)
    p.set_defaults(func=_guarded(module.run))
    return p


def parser() -> argparse.ArgumentParser:
    """The argument parser of the `gemmgen` command."""
    top = argparse.ArgumentParser(
        prog="gemmgen", description="Fused-attention and batched-GEMM kernels generated from CUTLASS "
                                    "templates: build them, see which one runs a shape and why, time them.",
        epilog="Environment: GEMMGEN_BUILD_DIR (build folders, ':'-separated; when set, the only ones "
               "searched besides the on-demand builds), GEMMGEN_CACHE_DIR, GEMMGEN_NVCC, CUTLASS_PATH, "
               "GEMMGEN_JIT=0, GEMMGEN_AUTOTUNE=1. Each command has --help.")
    top.add_argument("--version", action="version", version=f"gemmgen {__version__}",
                     help="print gemmgen's version and exit")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = _command(sub, "generate", "render, compile and register instances",
                   "Render the instances of each --arch into --out, compile them with nvcc and write the "
                   "manifest the runtime reads; the folder is recorded in the cache directory, so the "
                   "registry finds it from any working directory.")
    gen.add_argument("--arch", action="append", required=True, help="target, e.g. sm80 (repeatable)")
    gen.add_argument("--out", default="build", help="build directory (default: build)")
    gen.add_argument("--filter", metavar="REGEX",
                     help="build only the instances whose name contains this regex (re.search)")
    gen.add_argument("--all", action="store_true", help="the whole instance space, not the default set")
    gen.add_argument("--jobs", type=int, help="parallel nvcc jobs (default: cores, <= free GB / 4)")
    gen.add_argument("--no-compile", action="store_true", help="render sources and manifest only")
    gen.add_argument("--family", action="append",
                     help="build this family (repeatable; 'all' for every family; default: "
                          f"{', '.join(f.FAMILY for f in space.FAMILIES if space.built_by_default(f))}). "
                          "Dropout, masks and varlen need mea_sm80; the "
                          "unfused path gemm_sm80 and softmax_sm80")
    gen.set_defaults(func=cmd_generate)

    pkg = _command(sub, "package", "build a kernels wheel that runs without nvcc",
                   "Build the chosen instances of --arch into --build-dir (as `generate` does, reusing what "
                   "is up to date), then write the built ones as a wheel into --out-dir. Installed with pip "
                   "next to the same gemmgen version, the registry finds its kernels with no nvcc and no "
                   "build folder.")
    pkg.add_argument("--arch", required=True, help="target, e.g. sm90 (one per wheel)")
    pkg.add_argument("--out-dir", "-o", default="dist", help="where the wheel goes (default: dist)")
    pkg.add_argument("--build-dir", default="build", help="build directory to build into and package from "
                                                          "(default: build)")
    pkg.add_argument("--no-build", action="store_true",
                     help="package every built instance of --build-dir as it is, compiling nothing")
    pkg.add_argument("--filter", metavar="REGEX", help="only the instances whose name contains this regex")
    pkg.add_argument("--all", action="store_true", help="the whole instance space, not the default set")
    pkg.add_argument("--jobs", type=int, help="parallel nvcc jobs (default: cores, <= free GB / 4)")
    pkg.add_argument("--family", action="append", help="this family (repeatable; 'all' for every family; "
                                                       "default: those built by default)")
    pkg.set_defaults(func=cmd_package)

    lst = _command(sub, "list", "list the builds, or the instances of one build",
                   "Without --out: every build the registry searches (./build, the folders `gemmgen "
                   "generate` recorded, or GEMMGEN_BUILD_DIR's; the installed kernels packages, with the "
                   "reason for any left out; and the on-demand builds), with its arch and instance counts. "
                   "With --out: every instance of that build.")
    lst.add_argument("--out", metavar="FOLDER",
                     help="list the instances of this build directory (default: a summary of every build)")
    lst.set_defaults(func=cmd_list)

    run = _command(sub, "run", "run fused attention on random inputs",
                   "Run fused_attention once on random [B, H, N, d] inputs on the GPU and print the "
                   "instance it ran; optionally check it against float64 and time it. The arguments "
                   "are checked before the GPU is looked for.")
    run.add_argument("--batch", type=int, default=32, help="batch size B (default: 32)")
    run.add_argument("--heads", type=int, default=12, help="query heads H (default: 12)")
    run.add_argument("--heads-kv", type=int, help="key/value heads (GQA/MQA; default: --heads)")
    run.add_argument("--seq-len", type=int, default=512, help="query length Nq (default: 512)")
    run.add_argument("--seq-len-k", type=int, help="key/value length (default: --seq-len)")
    run.add_argument("--head-dim", type=int, default=64,
                     help="head dim d, one that some family supports (default: 64)")
    run.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="element type (default: fp16)")
    run.add_argument("--causal", action="store_true", help="causal mask (top-left unless --bottom-right)")
    run.add_argument("--bottom-right", action="store_true", help="bottom-right causal alignment")
    run.add_argument("--instance", help="force an instance by name")
    run.add_argument("--verify", action="store_true", help="compare with the float64 reference")
    run.add_argument("--time", action="store_true", help="time with CUDA events")
    run.add_argument("--iters", type=int, default=100, help="timed iterations (default: 100)")
    run.add_argument("--build-dir", action="append",
                     help="where to find manifests (repeatable; default: $GEMMGEN_BUILD_DIR, else ./build "
                          "and the builds `gemmgen generate` recorded)")
    run.set_defaults(func=cmd_run)

    from gemmgen.cli import explain as cli_explain, profile as cli_profile, tune as cli_tune  # these import torch only when run

    _add_op(_module_command(sub, cli_profile, "profile", "time every candidate per shape against torch SDPA",
                            "Time every built candidate of each shape (checked against float64 first) next "
                            "to torch SDPA's backends, print a table per shape and store the times in this "
                            "GPU's tuning database."), "profile")
    _add_op(_module_command(sub, cli_explain, "explain", "which instance runs a shape, and why",
                            "Print the candidates for a shape, the reason every other instance is rejected, "
                            "the winner and which step chose it; for a GPU that is not here, describe it "
                            "with --cc and --sms."), "explain")
    from gemmgen.cli import gemm as cli_gemm

    expl_gemm = _command(sub, "explain-gemm", "which batched-GEMM instance runs a shape, and why "
                         "(also: explain --op gemm)")
    cli_gemm.add_arguments(expl_gemm, profile=False)
    expl_gemm.set_defaults(func=_guarded(cli_gemm.run_explain))
    prof_gemm = _command(sub, "profile-gemm", "time every batched-GEMM candidate against torch.matmul "
                         "(also: profile --op gemm)")
    cli_gemm.add_arguments(prof_gemm, profile=True)
    prof_gemm.set_defaults(func=_guarded(cli_profile.run), op="gemm")
    _module_command(sub, cli_tune, "tune", "the tuning databases: path, show, export, import")
    return top


_python_warning = warnings.formatwarning
OPS = ("attention", "gemm")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """gemmgen's own warnings as the one line they are written as; others as Python shows them."""
    if issubclass(category, GemmgenWarning):
        return f"{message}\n"
    return _python_warning(message, category, filename, lineno, line)


def _add_op(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--op", choices=OPS, default="attention",
                   help=f"the kind of operation (default: attention); `{command} --op gemm` takes a "
                        f"batched GEMM shape instead: see `gemmgen {command} --op gemm --help`")


def route_op(argv: list[str]) -> list[str]:
    """`explain --op gemm ...` and `profile --op gemm ...` as the parsers of the GEMM's shape
    arguments (`explain-gemm`, `profile-gemm`): one command per question, a shape per kind of
    operation; both profile parsers run the one gemmgen.cli.profile.run, by `op`."""
    if not argv or argv[0] not in ("explain", "profile"):
        return argv
    rest, op, i = [], "attention", 1
    while i < len(argv):
        if argv[i] == "--op" and i + 1 < len(argv):
            op, i = argv[i + 1], i + 2
        elif argv[i].startswith("--op="):
            op, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if op == "gemm":
        return [f"{argv[0]}-gemm", *rest]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gemmgen` command; returns the exit status: 0 on success, 2 for bad
    arguments, 1 for other errors. A GemmgenError or OSError is one message on stderr, not a traceback."""
    args = parser().parse_args(route_op(list(sys.argv[1:] if argv is None else argv)))
    warnings.formatwarning = _one_line_warning
    if getattr(args, "jobs", None) is not None and args.jobs < 1:
        return _fail("--jobs must be at least 1", EXIT_USAGE)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into a reader that quit early, e.g. `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except InputError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except GemmgenError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(os_error_message(exc))
