"""Packed sequences of different lengths (fused_attention_varlen) against the same tokens run dense and
against torch's own varlen attention, forward or backward.

    python bench/varlen.py [--dtype bf16] [--head-dim 128] [--rounds 3] [--backward] [--out FILE.md]
    python bench/varlen.py --window 256 0 [...]   # a sliding window (top-left) instead of no mask / causal
    python bench/varlen.py --backward --deterministic [...]   # gemmgen's backwards with deterministic=True

16384 tokens, H * d = 2048 (MHA), in three packings: 16 sequences of 1024, 4 of 4096, and 12 mixed
lengths (a fixed draw between 128 and 4096 summing to 16384); no mask and causal. Sides, each eager
and queued back to back with the host path, default build untuned, in --rounds alternating rounds
(gemmgen.select.timing.rounds_ms) of the median of --reps CUDA-event timings:
  varlen:      gemmgen.fused_attention_varlen, the registry's pick (its instance in the table)
  mea:         the same call on mea_sm80 (forward only, where built: what varlen ran on before)
  dense:       gemmgen.fused_attention on [B, H, N, d] (equal lengths only: the same work dense)
  torch:       torch.nn.attention.varlen.varlen_attn (where this torch has it; torch's flash kernel)
With --window L R the one mask is that window (mea and torch sides left out) and an `fa2` side runs
the varlen call on fa2_sm80's local instance (forced by name, where built). With --backward
--deterministic gemmgen's sides (varlen, fa2, dense) pass deterministic=True (dQ added key tile by
key tile in order; the instance column the registry's deterministic pick); torch's side is unchanged.
Forward only, two extra columns time varlen and dense as kernels alone (each call queued behind a
spin kernel, so the host path is hidden): where the eager figure falls below these, the host is the
bound. TFLOP/s count the visible (query, key) pairs: 4 * H * d * pairs / t, 2.5x that for the backward.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, backward_alone, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.ops import offsets  # noqa: E402
from gemmgen.select import calls, registry, selection, timing  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
MIXED = [2048, 512, 128, 4096, 1000, 3000, 256, 777, 1536, 1024, 1967, 40]  # sums to 16384
PACKINGS = {"16x1024": [1024] * 16, "4x4096": [4096] * 4, "mixed 40-4096": MIXED}


def torch_varlen():
    """torch's varlen_attn and the keyword that asks it for a causal mask, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    params = inspect.signature(varlen_attn).parameters
    causal_kw = ({"window_size": (-1, 0)} if "window_size" in params else
                 {"is_causal": True} if "is_causal" in params else None)
    return None if causal_kw is None else (varlen_attn, causal_kw)


def mea_name(dtype: str, d: int) -> str | None:
    """A built mea_sm80 forward instance for this dtype and head dim on this GPU, or None."""
    cc = torch.cuda.get_device_capability()
    found = sorted((c.instance.max_head_dim, c.name) for c in registry.load()[0] if c.entry.family == "mea_sm80"
                   and c.instance.dtype.value == dtype and c.instance.max_head_dim >= d
                   and registry.build_reason(c, cc) is None)
    return found[0][1] if found else None


def fa2_local_name(dtype: str, d: int) -> str | None:
    """A built fa2_sm80 local instance for this dtype and head dim on this GPU, or None."""
    cc = torch.cuda.get_device_capability()
    found = sorted(c.name for c in registry.load()[0] if c.entry.family == "fa2_sm80"
                   and c.entry.params.get("mask") == "local" and c.instance.dtype.value == dtype
                   and c.instance.head_dim == d and not c.entry.params.get("softcap")
                   and registry.build_reason(c, cc) is None)
    return found[0] if found else None


def visible_pairs(n: int, window: tuple[int, int] | None, causal: bool) -> int:
    """(query, key) pairs a sequence of n queries and n keys sees: all, causal, or a top-left window."""
    if window is None:
        return n * (n + 1) // 2 if causal else n * n
    left, right = window
    i = torch.arange(n, dtype=torch.int64)
    lo = torch.clamp(i - left, min=0) if left >= 0 else torch.zeros_like(i)
    hi = torch.clamp(i + right, max=n - 1) if right >= 0 else torch.full_like(i, n - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--head-dim", nargs="+", type=int, default=[128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backward", action="store_true", help="time the backward alone (2.5x the FLOPs)")
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--window", nargs=2, type=int, metavar=("LEFT", "RIGHT"),
                    help="a sliding window (top-left alignment) instead of no mask and causal")
    ap.add_argument("--deterministic", action="store_true",
                    help="with --backward: gemmgen's sides with deterministic=True (torch's side unchanged)")
    args = ap.parse_args()
    if args.deterministic and not args.backward:
        ap.error("--deterministic describes a backward: add --backward")
    det = {"deterministic": True} if args.deterministic else {}  # gemmgen's calls' keyword
    window = None if args.window is None else tuple(args.window)
    dtype, grad = DTYPES[args.dtype], args.backward
    peer = torch_varlen()
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    other = "mea" if window is None else "fa2"  # the family packed sequences ran on before
    mask_col = "causal" if window is None else "window"
    rows = [f"| d | {mask_col} | packing | varlen instance | varlen | {other} | dense | torch varlen_attn | varlen / dense "
            f"| varlen / torch | varlen / {other} | varlen kernel | dense kernel |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in args.head_dim:
        h = HIDDEN // d
        mea = None if grad or window is not None else mea_name(args.dtype, d)
        fa2 = None if window is None else fa2_local_name(args.dtype, d)
        for causal in ((False, True) if window is None else (False,)):
            for label, lens in PACKINGS.items():
                assert sum(lens) == TOKENS
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                n_max = max(lens)
                q, k, v = (torch.randn(TOKENS, h, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3))

                def attend(**kw):
                    return lambda: gemmgen.fused_attention_varlen(q, k, v, cu, cu, n_max, n_max, causal=causal,
                                                                  window=window, **det, **kw)

                sides = {"varlen": attend()}
                if mea is not None:
                    sides["mea"] = attend(instance=mea)
                if fa2 is not None:
                    sides["fa2"] = attend(instance=fa2)
                if len(set(lens)) == 1:  # the same tokens as [B, H, N, d]
                    b = len(lens)
                    qd, kd, vd = (t.detach().view(b, n_max, h, d).transpose(1, 2).requires_grad_(grad)
                                  for t in (q, k, v))
                    sides["dense"] = lambda: gemmgen.fused_attention(qd, kd, vd, causal=causal, window=window, **det)
                if peer is not None and window is None:
                    fn, causal_kw = peer
                    sides["torch"] = lambda: fn(q, k, v, cu, cu, n_max, n_max, **(causal_kw if causal else {}))
                    try:
                        sides["torch"]()
                    except (RuntimeError, TypeError) as exc:  # no kernel for this GPU, dtype or head dim
                        print(f"torch varlen_attn left out: {exc}", file=sys.stderr)
                        del sides["torch"]
                if grad:
                    inputs = {"dense": (qd, kd, vd)} if "dense" in sides else {}
                    sides = {s: backward_alone(f, inputs.get(s, (q, k, v))) for s, f in sides.items()}
                if grad:
                    problem = calls.problem_for_bwd_varlen(q.detach(), k.detach(), len(lens), n_max, n_max, causal,
                                                           window=window, deterministic=args.deterministic)
                else:
                    problem = calls.problem_for_varlen(q, k, v, len(lens), n_max, n_max, causal, window=window,
                                                       short_keys=offsets.short_keys(cu, cu,
                                                                                     causal or window is not None))
                name = selection.select(problem).name
                ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
                alone = {} if grad else timing.rounds_ms({s: f for s, f in sides.items() if s in ("varlen", "dense")},
                                                         rounds=args.rounds, reps=args.reps, warmup=2, hide_host=True)
                pairs = sum(visible_pairs(n, window, causal) for n in lens)
                flops = (2.5 if grad else 1.0) * 4 * h * d * pairs
                tf = {s: flops / t / 1e9 for s, t in ms.items()}
                tf_alone = {s: flops / t / 1e9 for s, t in alone.items()}
                ratio = lambda s: "-" if s not in tf else f"{tf['varlen'] / tf[s]:.2f}"  # noqa: E731
                mask = ("Y" if causal else "N") if window is None else f"({window[0]}, {window[1]})"
                row = (f"| {d} | {mask} | {label} | {name} | {fmt(tf['varlen'])} | "
                       f"{fmt(tf.get(other))} | {fmt(tf.get('dense'))} | {fmt(tf.get('torch'))} | {ratio('dense')} | "
                       f"{ratio('torch')} | {ratio(other)} | {fmt(tf_alone.get('varlen'))} | "
                       f"{fmt(tf_alone.get('dense'))} |")
                rows.append(row)
                print(row, flush=True)
                del q, k, v, sides
    what = "backward alone (torch.autograd.grad of a forward that requires grad), " if grad else ""
    deterministic = "; gemmgen's sides with deterministic=True" if args.deterministic else ""
    head = header(f"{what}{args.dtype}, 16384 tokens, hidden 2048, MHA; eager calls queued back to back, host path "
                  f"included, default build untuned; each side the median over {args.rounds} rounds in alternating "
                  f"order of the median of {args.reps} CUDA-event timings; TFLOP/s = "
                  f"{'2.5*' if grad else ''}4*H*d*(visible pairs)/t{deterministic}; "
                  f"command: python bench/varlen.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
