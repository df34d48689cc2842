"""Where does causal time go? One causal instance timed with the diagonal moved.

For each named causal instance and its non-causal twin, at N tokens, prints TFLOP/s counted on
the work actually done: the causal instance with causal_offset = N (every key visible, so the
same work as the twin with one extra mask pass), and with offset 0 (the real causal problem).
If the first matches the twin, the causal gap is scheduling or the diagonal tiles, not the loop.

    python bench/causal_probe.py fa2_sm80_bf16_d64_causal_m128n64w4 [...] [--seq-len 8192]
"""
from __future__ import annotations

import argparse
import math

import torch

from gemmgen.kernels import abi
from gemmgen.select import registry

from fa_sweep import time_ms
from gemmgen.select.shapes import HIDDEN, TOKENS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("instances", nargs="+")
    ap.add_argument("--seq-len", type=int, default=8192)
    args = ap.parse_args()
    found = {c.name: c for c in registry.load()[0]}
    n = args.seq_len
    for name in args.instances:
        twin = name.replace("_causal_", "_none_")
        params = found[name].entry.params
        d, dtype = params["head_dim"], {"fp16": torch.float16, "bf16": torch.bfloat16}[params["dtype"]]
        b, h = TOKENS // n, HIDDEN // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        o = torch.empty_like(q)
        full = 4 * b * h * n * n * d

        def launch(kernel, offset):
            p = abi.AttnParams(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=o.data_ptr(), lse=None,
                               batch=b, heads=h, heads_kv=h, seqlen_q=n, seqlen_k=n, head_dim=d,
                               q_batch_stride=q.stride(0), q_head_stride=q.stride(1), q_row_stride=q.stride(2),
                               k_batch_stride=k.stride(0), k_head_stride=k.stride(1), k_row_stride=k.stride(2),
                               v_batch_stride=v.stride(0), v_head_stride=v.stride(1), v_row_stride=v.stride(2),
                               o_batch_stride=o.stride(0), o_head_stride=o.stride(1), o_row_stride=o.stride(2),
                               scale=1 / math.sqrt(d), causal_offset=offset)
            return lambda: kernel.run(p, torch.cuda.current_stream().cuda_stream)

        causal_k, twin_k = found[name].kernel, found[twin].kernel
        t_twin = time_ms(launch(twin_k, 0), 3, 20)
        t_all = time_ms(launch(causal_k, n), 3, 20)
        t_diag = time_ms(launch(causal_k, 0), 3, 20)
        print(f"{name} N={n}: twin {full / t_twin / 1e9:.0f}, causal kernel all-visible {full / t_all / 1e9:.0f}, "
              f"causal {full / 2 / t_diag / 1e9:.0f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
