"""A few Q Kᵀ calls (K = 128, fp16) to profile with Nsight Compute: cuBLAS first, then each named
gemmgen instance, three calls each, so `--launch-skip 2 --launch-count 1` takes a warm third call.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:nvjet \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python bench/gemm_ncu_probe.py 4096 512
    ncu ... -k regex:device_kernel ... python bench/gemm_ncu_probe.py 4096 512 INSTANCE

bench/NOTES.md, experiment 24, and bench/results/gemm_ncu_h200.txt hold what it measured.
"""
from __future__ import annotations

import argparse

import torch

import gemmgen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bh", type=int, help="batch * heads")
    ap.add_argument("mn", type=int, help="M = N")
    ap.add_argument("instances", nargs="*", help="gemmgen instances to run after cuBLAS")
    args = ap.parse_args()
    a = torch.randn(args.bh, 1, args.mn, 128, device="cuda", dtype=torch.float16)
    b = torch.randn(args.bh, 1, args.mn, 128, device="cuda", dtype=torch.float16)
    out = torch.empty(args.bh, 1, args.mn, args.mn, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.matmul(a, b.transpose(-1, -2), out=out)
    for name in args.instances:
        for _ in range(3):
            gemmgen.batched_gemm(a, b, b_transposed=True, out=out, instance=name)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
