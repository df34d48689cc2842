"""Each side alone under continuous load: time per call, GPU power and SM clock (H200 power cap).

For each output-bound Q Kᵀ shape (fp16), cuBLAS (torch.matmul) and the named strided instances run
one after the other, each for a few seconds of back-to-back bursts (>= 40 ms each, queued behind a
spin kernel: timing.burst_ms), in the order listed and then in reverse. Printed per side: the
median time per call over the last 1.5 s and, from `nvidia-smi` sampled every 50 ms over the same
window, the mean power, SM and memory clocks, the peak temperature and the clock-event reasons
(0x4: the software power cap). Answers whether a gap under sustained load is the clock (power per
result) or the cycles a call needs at that clock (bench/NOTES.md, experiment 27).

    python bench/gemm_power.py gemm_sm90_strided_fp16_fp16_nt_m64n256k64_pp_c2_e64 [...] [--seconds 2.5]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile
import time

import torch

import gemmgen
from gemmgen.select import timing

SHAPES = [(512, 1024, 128), (64, 4096, 64), (4096, 512, 128)]  # (B*H, M = N, K)
QUERY = "timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active"


def run_for(fn, seconds: float, calls: int) -> list[tuple[float, float, float]]:
    """(wall start, wall end, ms per call) of each burst of `calls` calls, for `seconds`."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.time()
        ms = timing.burst_ms(fn, calls)
        out.append((t0, time.time(), ms))
    return out


def read_samples(path: str) -> list[tuple]:
    rows = []
    for line in open(path):
        p = [x.strip() for x in line.split(",")]
        try:
            ts = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(p[1]), float(p[2]), float(p[3]), float(p[4]), p[5]))
        except (ValueError, IndexError):
            continue  # a partial last line
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="+", help="strided fp16 Q K^T instance names")
    ap.add_argument("--seconds", type=float, default=2.5, help="load per side")
    args = ap.parse_args()
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=open(log, "w"))
    time.sleep(0.5)
    windows = []
    try:
        for bh, mn, k in SHAPES:
            a = torch.randn(1, bh, mn, k, device="cuda", dtype=torch.float16)
            b = torch.randn(1, bh, mn, k, device="cuda", dtype=torch.float16)
            c = torch.empty(1, bh, mn, mn, device="cuda", dtype=torch.float16)
            bt = b.transpose(-1, -2)
            sides = {"cuBLAS": lambda: torch.matmul(a, bt, out=c)}
            for name in args.instances:
                sides[name] = lambda name=name: gemmgen.batched_gemm(a, b, b_transposed=True, out=c, instance=name)
            for name in list(sides) + list(sides)[::-1]:
                calls = max(10, int(40 / timing.burst_ms(sides[name], 3)))
                windows.append(((bh, mn, k), name, run_for(sides[name], args.seconds, calls)))
            torch.cuda.synchronize()
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
    rows = read_samples(log)
    print(f"{'shape':16} {'side':56} ms/call     W  SMclk memclk   T reasons")
    for shape, name, recs in windows:
        t_end = recs[-1][1]
        t_from = t_end - 1.5
        ms = statistics.median(r[2] for r in recs if r[0] >= t_from)
        s = [r for r in rows if t_from <= r[0] <= t_end]
        if s:
            w, clk, mclk = (statistics.mean(r[i] for r in s) for i in (1, 2, 3))
            temp, reasons = max(r[4] for r in s), ",".join(sorted({r[5] for r in s}))
        else:
            w = clk = mclk = temp = float("nan")
            reasons = ""
        print(f"{str(shape):16} {name:56} {ms:7.4f} {w:5.0f} {clk:6.0f} {mclk:6.0f} {temp:3.0f} {reasons}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
