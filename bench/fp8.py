"""fp8 attention (q, k, v in float8_e4m3fn, O in bf16) against bf16 and torch SDPA's bf16 backends.

fused_attention on fp8 inputs against the same call in bf16 and torch SDPA's backends on the
FlashAttention sweep's shapes; with --accuracy, the fp8 output's error instead.

    python bench/fp8.py [--head-dim 128] [--seq-len 512 ... 16384] [--rounds 3] [--reps 10] [--out FILE.md]
                        [--instance NAME ...]
    python bench/fp8.py --accuracy [--head-dim 64 128 256] [--out FILE.md]

16384 tokens, hidden 2048 (H = 2048 / d, B = 16384 / N, MHA), no mask and causal. The inputs are
standard normal values quantized per (batch, head) as a caller would: stored at the factor
amax / 448 (e4m3's largest value), the factors passed as [B, Hkv] float32 descales. Sides, each
eager and queued back to back with the host path, default build untuned, in --rounds alternating
rounds (gemmgen.select.timing.rounds_ms) of the median of --reps CUDA-event timings:
  fp8:         gemmgen.fused_attention on the fp8 tensors with their descales: the caller's call,
               V's transposed copy included (the registry's pick, or each --instance forced by name
               at the shapes of its head dim and mask: its instance in the table)
  bf16:        gemmgen.fused_attention on bf16 tensors of the same (dequantized) values
  cuDNN, flash: torch SDPA on the bf16 tensors, each backend forced with sdpa_kernel (a backend whose
               call raises is left out, the reason on stderr)
  torch fp8:   torch SDPA on the fp8 tensors, where this torch runs it ("-" where it raises)
One extra column times the fp8 side as kernels alone (each call queued behind a spin kernel, so the
host path is hidden): where the eager figure falls below it, the host is the bound. TFLOP/s =
4*B*H*N^2*d/t, halved for causal.

--accuracy: B = 2, H = 8, N = 1024 and 4096, each head dim, no mask and causal: the relative
Frobenius error ||O - ref|| / ||ref|| of the fp8 O against the float64 attention of the dequantized
inputs and against the bf16 call's O (and of that bf16 O against the same reference), and the
largest |LSE - ref| (natural log), as docs/fp8.md quotes them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fa_shapes, header, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.ops.reference import attention_reference  # noqa: E402
from gemmgen.select import calls, selection, timing  # noqa: E402
from gemmgen.select.shapes import SEQLENS  # noqa: E402

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value
BACKENDS = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
ACCURACY_SHAPE = (2, 8)  # (B, H) of --accuracy
ACCURACY_LENGTHS = (1024, 4096)


def quantized(b: int, h: int, n: int, d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """([q, k, v] in fp8 [B, H, N, d], [their descales, float32 [B, H]]): standard normal values
    stored at the factor amax / 448 of each (batch, head)."""
    stored, scales = [], []
    for _ in range(3):
        x = torch.randn(b, h, n, d, device="cuda")
        s = x.abs().amax(dim=(2, 3)) / E4M3_MAX
        stored.append((x / s[:, :, None, None]).to(FP8))
        scales.append(s.contiguous())
        del x
    return stored, scales


def dequantized(stored: list[torch.Tensor], scales: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The values the fp8 call attends to (each stored value times its head's factor, in float64)
    rounded to `dtype`."""
    return [(t.double() * s.double()[:, :, None, None]).to(dtype) for t, s in zip(stored, scales)]


def sdpa(q, k, v, causal: bool, backend: SDPBackend):
    """A call of torch SDPA restricted to one backend."""
    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def left_out(label: str, run) -> bool:
    """Whether `run` raises (a side this torch or GPU cannot run), saying why on stderr."""
    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"{label} left out: {first}", file=sys.stderr)
        return True
    return False


def instances_for(names: list[str] | None, d: int, causal: bool) -> list[str | None]:
    """The fp8 instances forced at shapes of head dim d and this mask ([None]: the registry's pick)."""
    if not names:
        return [None]
    from gemmgen.select import registry

    params = {c.name: c.entry.params for c in registry.load()[0]}
    missing = [n for n in names if n not in params]
    if missing:
        raise SystemExit(f"not built: {', '.join(missing)}")
    return [n for n in names if params[n]["head_dim"] == d and (params[n]["mask"] == "causal") == causal]


def speed(args: argparse.Namespace) -> int:
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    rows = ["| d | causal | N | fp8 instance | fp8 | fp8 kernel | bf16 | cuDNN bf16 | flash bf16 | torch fp8 "
            "| fp8 / bf16 | fp8 / best bf16 SDPA |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, _, d, causal, n, b, h, flops in fa_shapes(["bf16"], args.head_dim, args.seq_len):
        for forced in instances_for(args.instance, d, causal):
            (q8, k8, v8), (qd, kd, vd) = quantized(b, h, n, d)
            q, k, v = dequantized((q8, k8, v8), (qd, kd, vd), torch.bfloat16)
            sides = {"fp8": lambda: gemmgen.fused_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                             v_descale=vd, instance=forced),
                     "bf16": lambda: gemmgen.fused_attention(q, k, v, causal=causal)}
            for label, backend in BACKENDS.items():
                sides[label] = sdpa(q, k, v, causal, backend)
            sides["torch fp8"] = lambda: F.scaled_dot_product_attention(q8, k8, v8, is_causal=causal)
            for label in list(sides):
                if left_out(f"{label} (d {d}, causal {causal}, N {n})", sides[label]):
                    del sides[label]
            name = forced or (selection.select(calls.problem_for(q8, k8, causal, v=v8)).name if "fp8" in sides else "-")
            ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=2)
            alone = timing.rounds_ms({"fp8": sides["fp8"]}, rounds=args.rounds, reps=args.reps, warmup=2,
                                     hide_host=True) if "fp8" in sides else {}
            tf = {s: flops / t / 1e9 for s, t in ms.items()}
            peer = max((tf[s] for s in BACKENDS if s in tf), default=None)
            row = (f"| {d} | {'Y' if causal else 'N'} | {n} | {name} | {fmt(tf.get('fp8'))} | "
                   f"{fmt(flops / alone['fp8'] / 1e9 if 'fp8' in alone else None)} | {fmt(tf.get('bf16'))} | "
                   f"{fmt(tf.get('cuDNN'))} | {fmt(tf.get('flash'))} | {fmt(tf.get('torch fp8'))} | "
                   f"{ratio(tf.get('fp8'), tf.get('bf16'))} | {ratio(tf.get('fp8'), peer)} |")
            rows.append(row)
            print(row, flush=True)
    head = header(f"fp8 (e4m3) q, k, v with per-head [B, Hkv] descales, O in bf16, against bf16 on the same "
                  f"values; 16384 tokens, hidden 2048, MHA; eager calls queued back to back, host path included "
                  f"(fp8 kernel: the kernels alone, behind a spin kernel), default build untuned; each side the "
                  f"median over {args.rounds} rounds in alternating order of the median of {args.reps} CUDA-event "
                  f"timings; TFLOP/s = 4*B*H*N^2*d/t (halved for causal); "
                  f"command: python bench/fp8.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((o.double() - ref).norm() / ref.norm()).item()


def accuracy(args: argparse.Namespace) -> int:
    b, h = ACCURACY_SHAPE
    rows = ["| d | causal | N | fp8 instance | fp8 vs float64 | fp8 vs bf16 | bf16 vs float64 | fp8 LSE max abs err |",
            "|---|---|---|---|---|---|---|---|"]
    for d in args.head_dim:
        for causal in (False, True):
            for n in ACCURACY_LENGTHS:
                torch.manual_seed(n * 1000 + d)
                stored, scales = quantized(b, h, n, d)
                name = selection.select(calls.problem_for(stored[0], stored[1], causal, v=stored[2])).name
                o8, lse8 = gemmgen.fused_attention(*stored, causal=causal, return_lse=True, q_descale=scales[0],
                                                   k_descale=scales[1], v_descale=scales[2])
                o16 = gemmgen.fused_attention(*dequantized(stored, scales, torch.bfloat16), causal=causal)
                ref_o, ref_lse = attention_reference(*dequantized(stored, scales, torch.float64), causal)
                finite = torch.isfinite(ref_lse)
                lse_err = (lse8.double() - ref_lse)[finite].abs().max().item()
                row = (f"| {d} | {'Y' if causal else 'N'} | {n} | {name} | {rel_err(o8, ref_o):.2e} | "
                       f"{rel_err(o8, o16):.2e} | {rel_err(o16, ref_o):.2e} | {lse_err:.2e} |")
                rows.append(row)
                print(row, flush=True)
                del stored, o8, o16, ref_o, ref_lse
    head = header(f"accuracy of fp8 (e4m3) attention, O in bf16: B={b}, H={h}, MHA; inputs standard normal, "
                  f"quantized per (batch, head) at the factor amax / {E4M3_MAX:.0f}, passed as [B, Hkv] descales; "
                  f"relative Frobenius error ||O - ref|| / ||ref|| against the float64 attention of the "
                  f"dequantized inputs and against gemmgen's bf16 O of them, LSE error in natural log; "
                  f"command: python bench/fp8.py {' '.join(sys.argv[1:])}".rstrip())
    publish(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", nargs="+", type=int, default=[128])
    ap.add_argument("--seq-len", "--seq-lens", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--accuracy", action="store_true",
                    help="print the fp8 output's errors (N = 1024 and 4096, B = 2, H = 8) instead of timings")
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--instance", nargs="+", help="fp8 instances to force, each at the shapes it runs")
    args = ap.parse_args()
    return accuracy(args) if args.accuracy else speed(args)


if __name__ == "__main__":
    raise SystemExit(main())
