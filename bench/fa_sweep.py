"""FlashAttention sweep: every built gemmgen candidate against torch SDPA's backends.

Shapes as in FlashAttention's benchmark: batch*seqlen = 16384 tokens, heads*head_dim = 2048,
Nq = Nk = N. TFLOP/s = 4*B*H*N^2*d / time, halved for causal. Every tensor is 64 MB, larger
than the H200's 60 MB L2, so no input stays cache-resident between repeats.

    python bench/fa_sweep.py [--dtype bf16 fp16] [--head-dim 64 128] [--rounds 3] [--kernels]
                             [--out bench/results/x.md]

Prints one markdown table (and writes it to --out): per shape, the best instance of each gemmgen
family built, the instance the registry picks by default (its TFLOP/s and name), and the SDPA flash
(FlashAttention-2), efficient and cuDNN backends, all measured in the same process on the same
inputs; "pick/peer" is the pick against the fastest SDPA backend. Every side of a shape (each
candidate instance and each backend) is timed in --rounds rounds whose order alternates
(gemmgen.select.timing.alternating_rounds), each round the median of --reps CUDA-event timings, and
reported as its median over the rounds: under the power cap a side timed once, always right after
the same other side, reads up to 15% off (bench/NOTES.md, experiment 32). With --kernels each
call is queued behind a spin kernel, so the events time the kernels alone, not the host path.
Every candidate's figure goes to stderr ("all:" lines) and the summary lines count the shapes where
the pick matches the fastest backend.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from common import add_sweep_args, fa_shapes, header, rounds_method
from gemmgen.select import calls, registry, timing
from gemmgen.generator.space import FAMILIES

BACKENDS = {"FA2": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cuDNN": SDPBackend.CUDNN_ATTENTION}


def time_ms(fn, warmup: int, reps: int) -> float:
    """Median of `reps` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def sdpa(q, k, v, causal: bool, backend: SDPBackend):
    """A call of torch SDPA restricted to one backend."""
    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def below_line(ratios: list[tuple[float, str]]) -> str:
    """The summary line naming each (ratio, shape) below 1.00, lowest first."""
    below = sorted(r for r in ratios if r[0] < 1.0)
    return "- below 1.00: " + (", ".join(f"{label} {r:.3f}" for r, label in below) or "none")


def finish(header: str, rows: list[str], summary: list[str], out: str | None) -> None:
    """Print the summary lines; write the header, the table and them to `out` when given."""
    print("\n".join(summary), flush=True)
    if out:
        with open(out, "w") as f:
            f.write(header + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(summary) + "\n")


def built_instances(q: torch.Tensor, k: torch.Tensor, causal: bool) -> list[str]:
    """Names of the built instances (any family) that can run this call."""
    return [c.name for c in registry.candidates(calls.problem_for(q, k, causal))[0]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(ap, reps=20)
    ap.add_argument("--kernels", action="store_true",
                    help="time the kernels alone: each call queued behind a spin kernel")
    args = ap.parse_args()

    alone = " of the kernels alone (each call behind a spin kernel)" if args.kernels else ""
    head = header(f"{rounds_method(args)}{alone}; TFLOP/s = 4*B*H*N^2*d/t (halved for causal)")
    families = [f.FAMILY for f in FAMILIES if getattr(f, "KIND", "attention") == "attention"]
    rows = ["| dtype | d | causal | N | " + " | ".join(families) + " | pick | picked instance | FA2 | efficient "
            "| cuDNN | pick/peer |", "|---" * (len(families) + 10) + "|"]
    ratios = []
    print(head, flush=True)
    for dname, dtype, d, causal, n, b, h, flops in fa_shapes(args.dtype, args.head_dim, args.seq_len):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        sides = {name: (lambda name=name: gemmgen.fused_attention(q, k, v, causal=causal, instance=name))
                 for name in built_instances(q, k, causal)}
        for label, backend in BACKENDS.items():
            run = sdpa(q, k, v, causal, backend)
            try:  # a backend that cannot run this shape is left out
                run()
            except RuntimeError:
                continue
            sides[label] = run
        ms = timing.rounds_ms(sides, rounds=args.rounds, reps=args.reps, warmup=3,
                              hide_host=args.kernels)
        tflops = {side: flops / t / 1e9 for side, t in ms.items()}
        measured = {name: t for name, t in tflops.items() if name not in BACKENDS}
        peers = {label: tflops.get(label) for label in BACKENDS}
        pick = gemmgen.selected_instance(q, k, v, causal=causal) if measured else None
        fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
        best_of = [max((t for name, t in measured.items() if name.startswith(fam + "_")), default=None)
                   for fam in families]
        peer = max((t for t in peers.values() if t is not None), default=None)
        ratio = measured[pick] / peer if pick in measured and peer else None
        if ratio is not None:
            ratios.append((ratio, f"{dname} d{d} {'causal' if causal else 'none'} N={n}"))
        row = (f"| {dname} | {d} | {'Y' if causal else 'N'} | {n} | "
               + " | ".join(fmt(t) for t in best_of)
               + f" | {fmt(measured.get(pick))} | {pick or '-'} | {fmt(peers['FA2'])} | "
               f"{fmt(peers['efficient'])} | {fmt(peers['cuDNN'])} | "
               f"{'-' if ratio is None else f'{ratio:.2f}'} |")
        rows.append(row)
        print(row, flush=True)
        print("    all: " + ", ".join(f"{name}={t:.0f}" for name, t in
                                  sorted(measured.items(), key=lambda kv: -kv[1])), file=sys.stderr,
              flush=True)
    ahead = sum(r >= 1.0 for r, _ in ratios)
    finish(head, rows, [f"- pick >= fastest SDPA backend at {ahead} of {len(ratios)} shapes", below_line(ratios)],
           args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
