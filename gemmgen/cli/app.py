"""The `gemmgen` command: generate (render + compile + register), list, run, profile, explain, tune."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from gemmgen.generator import manifest, space
from gemmgen.arch import Arch, parse_arch
from gemmgen.errors import GemmgenError, InputError, ManifestError, ToolchainError

EXIT_USAGE = 2


def _fail(message: str, code: int = 1) -> int:
    print(f"gemmgen: error: {message}", file=sys.stderr)
    return code


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
    """Render and compile the default set (or --all, or --filter's) for each --arch."""
    from gemmgen.generator import build  # imports filelock/jinja only when generating

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
    built = failed = up_to_date = 0
    elapsed = 0.0
    for arch, chosen in plans:
        try:
            result = build.generate(arch, chosen, out=Path(args.out), jobs=args.jobs,
                                    compile=not args.no_compile)
        except ToolchainError as exc:
            return _fail(str(exc))
        built, up_to_date = built + len(result.built), up_to_date + len(result.up_to_date)
        failed += len(result.failed)
        elapsed += result.elapsed
        for name, error in result.failed.items():
            print(f"\nFAILED {name}:\n{error}", file=sys.stderr)
        print(f"manifest: {result.manifest_path}")
    if args.no_compile:
        print(f"{sum(len(c) for _, c in plans)} rendered, not compiled, in {elapsed:.1f} s")
        return 0
    print(f"{built} built, {failed} failed, {up_to_date} up to date in {elapsed:.1f} s")
    return 1 if failed else 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print every instance of the manifests under --out."""
    from gemmgen.select.registry import manifest_paths

    paths = manifest_paths(Path(args.out))
    if not paths:
        return _fail(f"no manifest under {args.out}; run `gemmgen generate --arch sm80`")
    rows = [("name", "family", "params", "arch", "state")]
    for path in paths:
        try:
            data = manifest.load(path)
        except ManifestError as exc:
            return _fail(str(exc))
        for e in data.instances:
            params = " ".join(f"{k}={v}" for k, v in e.params.items())
            rows.append((e.name, e.family, params, e.arch, e.state))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run fused_attention on random inputs; optionally verify against float64 and time it."""
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


def parser() -> argparse.ArgumentParser:
    """The argument parser of the `gemmgen` command."""
    top = argparse.ArgumentParser(prog="gemmgen", description="CUTLASS-based fused attention kernels.")
    sub = top.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="render, compile and register instances")
    gen.add_argument("--arch", action="append", required=True, help="target, e.g. sm80 (repeatable)")
    gen.add_argument("--out", default="build", help="build directory (default: build)")
    gen.add_argument("--filter", help="substring or regex an instance name must match")
    gen.add_argument("--all", action="store_true", help="the whole instance space, not the default set")
    gen.add_argument("--jobs", type=int, help="parallel nvcc jobs (default: cores, <= free GB / 4)")
    gen.add_argument("--no-compile", action="store_true", help="render sources and manifest only")
    gen.add_argument("--family", action="append",
                     help="build this family (repeatable; 'all' for every family; default: fa2_sm80 and "
                          "fmha_sm90). Dropout, masks and varlen need mea_sm80; the unfused path "
                          "gemm_sm80 and softmax_sm80")
    gen.set_defaults(func=cmd_generate)

    lst = sub.add_parser("list", help="list the instances of a build directory")
    lst.add_argument("--out", default="build", help="build directory (default: build)")
    lst.set_defaults(func=cmd_list)

    run = sub.add_parser("run", help="run fused attention on random inputs")
    run.add_argument("--batch", type=int, default=32)
    run.add_argument("--heads", type=int, default=12)
    run.add_argument("--heads-kv", type=int, help="key/value heads (GQA/MQA; default: --heads)")
    run.add_argument("--seq-len", type=int, default=512)
    run.add_argument("--seq-len-k", type=int, help="key/value length (default: --seq-len)")
    run.add_argument("--head-dim", type=int, default=64)
    run.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    run.add_argument("--causal", action="store_true")
    run.add_argument("--bottom-right", action="store_true", help="bottom-right causal alignment")
    run.add_argument("--instance", help="force an instance by name")
    run.add_argument("--verify", action="store_true", help="compare with the float64 reference")
    run.add_argument("--time", action="store_true", help="time with CUDA events")
    run.add_argument("--iters", type=int, default=100, help="timed iterations (default: 100)")
    run.add_argument("--build-dir", action="append", help="where to find manifests (repeatable)")
    run.set_defaults(func=cmd_run)

    from gemmgen.cli import explain as cli_explain, profile as cli_profile, tune as cli_tune  # these import torch only when run

    prof = sub.add_parser("profile", help="time every candidate per shape against torch SDPA")
    cli_profile.add_arguments(prof)
    prof.set_defaults(func=_guarded(cli_profile.run))
    expl = sub.add_parser("explain", help="which instance runs a shape, and why")
    cli_explain.add_arguments(expl)
    expl.set_defaults(func=_guarded(cli_explain.run))
    from gemmgen.cli import gemm as cli_gemm

    expl_gemm = sub.add_parser("explain-gemm", help="which batched-GEMM instance runs a shape, and why")
    cli_gemm.add_arguments(expl_gemm, profile=False)
    expl_gemm.set_defaults(func=_guarded(cli_gemm.run_explain))
    prof_gemm = sub.add_parser("profile-gemm", help="time every batched-GEMM candidate against torch.matmul")
    cli_gemm.add_arguments(prof_gemm, profile=True)
    prof_gemm.set_defaults(func=_guarded(cli_gemm.run_profile))
    tune = sub.add_parser("tune", help="the tuning databases: path, show, export, import")
    cli_tune.add_arguments(tune)
    tune.set_defaults(func=_guarded(cli_tune.run))
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gemmgen` command; returns the exit status."""
    args = parser().parse_args(argv)
    if getattr(args, "jobs", None) is not None and args.jobs < 1:
        return _fail("--jobs must be at least 1", EXIT_USAGE)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into a reader that quit early, e.g. `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
