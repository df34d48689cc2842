"""`gemmgen explain`: the candidates for one shape, why each other instance is rejected, the winner and
where the decision came from (tuned bucket, nearest tuned bucket, heuristic).

On a machine without the GPU in question, --cc/--sms (and --gpu, to use that GPU model's tuning
database from the cache, e.g. one imported with `gemmgen tune import`) describe it instead.

A shape with an empty size (B, H or Nq of 0: O has no elements; Nk of 0: no keys) has no decision:
fused_attention checks the tensors and returns without selecting an instance or launching a
kernel, and `gemmgen explain` says so.

--kv-cache explains a fused_attention_with_kvcache call instead (Nk: the cache's capacity per
sequence; causal aligned bottom-right, as that call's default causal=True with --causal; --paged:
through a block table). Where the winner splits keys over CTAs (the decode family), the report ends
with the split count the launch passes.
"""
from __future__ import annotations

import argparse
import re
import sys

from gemmgen.select import device, heuristic, registry, selection, tuning_db
from gemmgen.errors import DeviceError, InputError
from gemmgen.generator.space import supported_head_dims
from gemmgen.ops import padding
from gemmgen.ops.checks import check_softcap, check_window
from gemmgen.select.problem import ALIGN_BYTES, BwdProblem, Problem
from gemmgen.select.shapes import parse_shape


def parse_cc(text: str) -> tuple[int, int]:
    """ "9.0" -> (9, 0); raise InputError if malformed."""
    try:
        major, minor = (int(p) for p in text.split("."))
    except ValueError:
        raise InputError(f"malformed --cc {text!r}: expected MAJOR.MINOR, e.g. 9.0") from None
    return major, minor


def device_facts(args: argparse.Namespace) -> tuple[device.DeviceFacts, tuning_db.TuningDB | None]:
    """The GPU to explain for, and its tuning database when it is not this machine's GPU."""
    if args.cc:
        if not args.sms or args.sms < 1:
            raise InputError("--cc needs --sms N (the GPU's SM count)")
        facts = device.synthetic(parse_cc(args.cc), args.sms, args.gpu or "")
        return facts, find_database(facts)
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(f"no CUDA GPU visible to this torch ({torch.__version__}); describe the GPU "
                          f"with --cc X.Y --sms N [--gpu NAME]")
    if not 0 <= args.device < torch.cuda.device_count():
        raise InputError(f"--device {args.device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device.facts(args.device), None


def find_database(facts: device.DeviceFacts) -> tuning_db.TuningDB | None:
    """The most recent readable database in the cache made on a GPU of this name and cc."""
    cc = f"{facts.cc[0]}.{facts.cc[1]}"
    found = []
    for path in tuning_db.database_files():
        db = tuning_db.read_any(path)
        if db is None:  # reported and set aside
            continue
        if db.device.get("gpu") == facts.name and str(db.device.get("cc")) == cc:
            found.append((path.stat().st_mtime, str(path), db))
    return max(found)[2] if found else tuning_db.TuningDB(device=facts.fingerprint())


def shape_sizes(text: str) -> tuple[list[int], bool] | None:
    """([B, H, Nq, Nk, d], causal) of a well-formed shape text "B,H,N,d" or "B,H,Nq,Nk,d"
    (optionally ",causal"), zeros allowed; None when malformed (parse_shape says why)."""
    parts = [p.strip() for p in text.split(",")]
    causal = bool(parts) and parts[-1].lower() == "causal"
    parts = parts[:-1] if causal else parts
    if len(parts) not in (4, 5) or not all(re.fullmatch(r"\d+", p) for p in parts):
        return None
    sizes = [int(p) for p in parts]
    if len(sizes) == 4:
        sizes.insert(3, sizes[2])
    return sizes, causal


def empty_report(sizes: list[int], *, causal: bool, dtype: str, heads_kv: int | None,
                 instance: str | None) -> str:
    """What fused_attention does for sizes with a zero among B, H, Nq, Nk: the checks it still makes
    (InputError for a head dim no family supports or key/value heads that cannot divide H), then
    no instance and no kernel. `sizes` is [B, H, Nq, Nk, d]."""
    b, h, nq, nk, d = sizes
    kv = h if heads_kv is None else heads_kv
    if kv < 1 or h % kv:
        raise InputError(f"key/value heads {kv} (--heads-kv, default H) must be at least 1 and divide H = {h}")
    if d not in supported_head_dims() and padding.padded_head_dim(d) == d:
        raise InputError(f"head dim {d} is not supported; supported: {padding.describe()}")
    n = f"Nq=Nk={nq}" if nq == nk else f"Nq={nq} Nk={nk}"
    lines = [f"shape: B={b} H={h}{f' Hkv={kv}' if kv != h else ''} {n} d={d} {dtype}{' causal' if causal else ''}"]
    if b * h * nq == 0:
        empty = ", ".join(f"{name} = 0" for name, v in (("B", b), ("H", h), ("Nq", nq)) if v == 0)
        lines.append(f"empty problem ({empty}): O [{b}, {h}, {nq}, {d}] and the LSE [{b}, {h}, {nq}] have "
                     f"no elements")
    else:
        lines.append(f"no keys (Nk = 0): every row of O [{b}, {h}, {nq}, {d}] is 0 and its LSE is -inf")
    lines.append("decision: none needed: fused_attention checks the tensors and returns this without "
                 "selecting an instance or launching a kernel, on any GPU")
    if instance:
        lines.append(f"(--instance {instance} is not looked up: no instance runs)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the decision for --shape (or, for a shape with an empty size, what fused_attention
    does instead); returns the exit status."""
    if args.build_dir:
        registry.set_build_dirs(args.build_dir)
    parsed = shape_sizes(args.shape)
    if parsed is not None:
        sizes, causal = parsed
        if sizes[4] == 0:
            raise InputError(f"head dim 0 in shape {args.shape!r}: it must be positive")
        if 0 in sizes[:4]:
            print(empty_report(sizes, causal=causal or args.causal, dtype=args.dtype, heads_kv=args.heads_kv,
                               instance=args.instance))
            return 0
    shape = parse_shape(args.shape, dtype=args.dtype, causal=args.causal, heads_kv=args.heads_kv,
                        layout=args.layout or "bhnd")
    causal, window = shape.causal, None
    if args.window is not None:
        try:
            window = tuple(int(x) for x in args.window.split(","))
        except ValueError:
            window = ()
        if len(window) != 2:
            raise InputError(f"--window {args.window!r}: expected LEFT,RIGHT (two ints, -1 unbounded)")
        causal, window = check_window(window, causal)
    softcap = check_softcap(args.softcap) > 0
    if args.paged and not args.kv_cache:
        raise InputError("--paged describes a key-value cache: add --kv-cache")
    if args.kv_cache and (args.backward or softcap):
        raise InputError("--kv-cache explains a forward without a softcap: drop --backward and --softcap")
    if args.kv_cache and args.causal_alignment == "top_left":
        raise InputError("--kv-cache: a key-value-cache call aligns its mask bottom-right per sequence; "
                         "drop --causal-alignment top_left")
    if args.kv_cache and args.layout is not None:
        raise InputError("--kv-cache: a key-value-cache call's q is [B, Nq, H, d] (its caches any strides); "
                         "drop --layout")
    facts, db = device_facts(args)
    head_dim = padding.padded_head_dim(shape.head_dim)  # the backward of a padded call is padded too
    fields = dict(dtype=shape.dtype, head_dim=head_dim, causal=causal, device=facts,
                  batch_heads=shape.batch * shape.heads, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                  gqa=shape.heads // shape.kv_heads, layout=shape.layout, align=ALIGN_BYTES,
                  causal_alignment=args.causal_alignment or "top_left", window=window, softcap=softcap)
    if args.kv_cache:  # calls.problem_for_kvcache's problem: q [B, Nq, H, d], bottom-right per sequence
        fields.update(layout="bnhd", causal_alignment="bottom_right", kv_cache=True, paged=args.paged)
    notes = [] if head_dim == shape.head_dim else [
        f"head_dim {shape.head_dim} has no tile: the call runs on copies of q, k, v padded to {head_dim}"]
    if args.backward:  # the backward reads K and V expanded to Q's heads (GQA summed afterwards)
        problem = BwdProblem(**{**fields, "gqa": 1}, deterministic=args.deterministic)
        bwd_dim = selection.padded_backward_head_dim(problem)
        if bwd_dim != head_dim:
            notes.append(f"the backward runs padded to head_dim {bwd_dim}: its family there weighs faster "
                         f"than head_dim {head_dim}'s")
            problem = selection.at_head_dim(problem, bwd_dim)
    elif args.deterministic:
        raise InputError("--deterministic describes a backward: add --backward")
    else:
        problem = Problem(**fields)
    decision = selection.decide(problem, args.instance, db=db)
    print(f"shape: {shape.describe()}")
    for note in notes:
        print(note)
    print(decision.report())
    splits = selection.splits(decision.winner, problem) if not args.backward else 0
    if splits:
        row_tiles = heuristic.split_plan(decision.winner.instance, problem)[0]
        cache = "a paged cache" if problem.paged else "a contiguous cache" if problem.kv_cache else "dense K and V"
        print(f"launch: {splits} key split(s) per row tile ({row_tiles} row tile(s) per KV head, "
              f"{problem.batch_heads // problem.gqa} KV heads), {cache}: gemmgen.select.heuristic.num_splits")
    sys.stdout.flush()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `gemmgen explain`."""
    p.add_argument("--shape", required=True, metavar="B,H,Nq,Nk,d",
                   help="B,H,Nq,Nk,d (or B,H,N,d), optionally ,causal; a size of 0 is an empty problem")
    p.add_argument("--causal", action="store_true", help="causal mask (as ,causal in --shape)")
    p.add_argument("--causal-alignment", choices=("top_left", "bottom_right"),
                   help="where a causal mask's (or window's) diagonal sits when Nq != Nk (default top_left, as torch; "
                        "bottom_right with --kv-cache)")
    p.add_argument("--window", metavar="LEFT,RIGHT",
                   help="a sliding window around the diagonal, as fused_attention's window= (-1: unbounded)")
    p.add_argument("--softcap", type=float, default=0.0, metavar="C",
                   help="a logit softcap, as fused_attention's softcap= (default 0: none)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="element type (default: bf16)")
    p.add_argument("--heads-kv", type=int, help="key/value heads (GQA/MQA; default: H)")
    p.add_argument("--layout", choices=("bhnd", "bnhd", "mixed"),
                   help="storage order of q and k/v (default: bhnd)")
    p.add_argument("--backward", action="store_true",
                   help="explain the backward pass (dQ, dK, dV) of the shape instead of its forward")
    p.add_argument("--deterministic", action="store_true",
                   help="with --backward: a backward whose result does not depend on scheduling")
    p.add_argument("--kv-cache", action="store_true",
                   help="a fused_attention_with_kvcache call: Nk cached keys per sequence; with --causal (the "
                        "call's default) aligned bottom-right")
    p.add_argument("--paged", action="store_true", help="with --kv-cache: the cache is read through a block table")
    p.add_argument("--instance", help="explain this instance instead of the pick")
    p.add_argument("--build-dir", action="append",
                   help="where to find manifests (repeatable; default: $GEMMGEN_BUILD_DIR, else ./build "
                        "and the builds `gemmgen generate` recorded)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default: 0)")
    p.add_argument("--cc", help="explain for a GPU that is not here: compute capability, e.g. 9.0")
    p.add_argument("--sms", type=int, help="with --cc: its number of SMs")
    p.add_argument("--gpu", help="with --cc: its name as torch reports it (selects its tuning database)")
