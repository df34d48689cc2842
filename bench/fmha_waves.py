"""d128 without a mask: what a part-full last wave of row tiles costs, against what the call's
length costs (bench/NOTES.md, experiment 43).

Shapes chosen in pairs: the same number of waves of 128-row tiles on the GPU's SMs (15.52, or 7.76)
at calls of 1.6, 3.3 and 7 ms, and the same call length (1.6 ms) at 15.52 and 16.00 waves. Each
side (the fmha_sm90 ping-pong and cooperative 128x128 `_lr` tiles, cuDNN) in --rounds alternating
rounds, first of the kernels alone (each call behind a spin kernel), then of 20 calls replayed back
to back from a CUDA graph. Last, each side alone under load for 2.5 s at the sweep's N = 16384
shape, with the power draw and SM clock nvidia-smi reports meanwhile.

    python bench/fmha_waves.py --rounds 4
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from gemm_power import QUERY, read_samples  # nvidia-smi's samples, parsed (same folder)
from gemmgen.select import timing

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = [  # (batch, heads, seqlen) at d128
    (1, 16, 16384),  # the sweep's: 2048 tiles, 15.52 waves on 132 SMs
    (1, 33, 16384),  # 32.00 waves
    (1, 8, 16384),   # 7.76 waves, half the call
    (2, 16, 8192),   # the sweep's: 15.52 waves
    (1, 33, 8192),   # 16.00 waves
    (1, 17, 8192),   # 8.24 waves
]
BF16_SHAPES = [(1, 16, 16384), (1, 33, 16384), (2, 16, 8192), (1, 33, 8192)]


def sides_for(q, k, v, dname: str) -> dict:
    base = f"fmha_sm90_{dname}_d128_none"

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)
    return {"pp": lambda: gemmgen.fused_attention(q, k, v, instance=f"{base}_pingpong_m128n128s5_lr"),
            "coop": lambda: gemmgen.fused_attention(q, k, v, instance=f"{base}_coop_m128n128s5_lr"),
            "cuDNN": cudnn}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mode in ("kernels", "graph"):
        for dname in DTYPES:
            for b, h, n in SHAPES if dname == "fp16" else BF16_SHAPES:
                q, k, v = (torch.randn(b, h, n, 128, device="cuda", dtype=DTYPES[dname]) for _ in range(3))
                sides = sides_for(q, k, v, dname)
                order = list(sides)
                times = {x: [] for x in order}
                for rnd in range(args.rounds):
                    for x in order[rnd % 3:] + order[:rnd % 3]:
                        if mode == "kernels":
                            times[x].append(timing.median_ms(lambda _i: sides[x](), 1, warmup=3, reps=20,
                                                             hide_host=True))
                        else:
                            times[x].append(timing.median_ms(lambda _i: sides[x](), 1, warmup=1, reps=5, graph=True))
                flops = 4 * b * h * n * n * 128
                tiles = b * h * n // 128
                print(f"{mode:7} {dname} B={b} H={h:2} N={n:5} tiles={tiles:4} waves={tiles / sms:5.2f} "
                      f"ms(pp)={statistics.median(times['pp']):.3f} "
                      + " ".join(f"{x}={flops / statistics.median(times[x]) / 1e9:4.0f}" for x in order), flush=True)
                del q, k, v, sides

    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=open(log, "w"))
    time.sleep(0.5)
    windows = []
    for dname in DTYPES:
        q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=DTYPES[dname]) for _ in range(3))
        sides = sides_for(q, k, v, dname)
        for x in ["pp", "cuDNN", "coop", "cuDNN", "pp"]:
            recs = []
            end = time.monotonic() + 2.5
            while time.monotonic() < end:
                t0 = time.time()
                ms = timing.burst_ms(sides[x], 12)
                recs.append((t0, time.time(), ms))
            windows.append((dname, x, recs))
        torch.cuda.synchronize()
    time.sleep(0.2)
    smi.terminate()
    smi.wait()
    rows = read_samples(log)
    flops = 4 * 16 * 16384 * 16384 * 128
    for dname, x, recs in windows:
        t_end = recs[-1][1]
        t_from = t_end - 1.5
        ms = statistics.median(r[2] for r in recs if r[0] >= t_from)
        s = [r for r in rows if t_from <= r[0] <= t_end]
        w = statistics.mean(r[1] for r in s) if s else float("nan")
        clk = statistics.mean(r[2] for r in s) if s else float("nan")
        print(f"load {dname} {x:6} {ms:.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s {w:4.0f} W {clk:5.0f} MHz "
              f"T {max((r[4] for r in s), default=0):.0f} {','.join(sorted(set(r[5] for r in s)))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
