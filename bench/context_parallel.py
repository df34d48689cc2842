"""Context-parallel attention: gemmgen.distributed.ring_attention over 1, 2, 4, ... GPUs.

Shapes: global sequence N (default 32768, 65536, 131072 tokens), B = 1, H = --heads (16), d = 128,
bf16, causal, --layout (zigzag). Every world size W from 1 up to --gpus (powers of two, and --gpus)
runs on the first W ranks of one NCCL group, each rank holding N / W rows; the other ranks wait.

    python bench/context_parallel.py --gpus 2 [--seq-len 32768 65536 131072] [--out FILE.md]
    torchrun --nproc-per-node 4 bench/context_parallel.py [...]     (the world comes from torchrun)

Without torchrun the script spawns one process per GPU itself. Per shape and W it times:

    ring      ring_attention as a user calls it: fwd under no_grad; fwd+bwd the forward and
              torch.autograd.grad(o, (q, k, v), do)
    compute   the same, on a ring whose transfers are replaced by handing back the sent tensor
              (the attention, merges and copies alone)
    comm      the transfers alone, in the schedule's order (fwd: W-1 key/value blocks; fwd+bwd
              also W-1 blocks and W gradient partials, overlapping as in the backward)

and reports the ring's time, TFLOP/s per GPU (4*B*H*N^2*d / 2 for the causal forward, 3.5x that
for fwd+bwd, divided by W and the time), the scaling efficiency t(1 GPU) / (W * t(W)) against the
ring on one GPU, the comm time, and the fraction of the communication hidden behind the attention,
(compute + comm - ring) / comm clipped to [0, 1]. A row "1 (fused_attention)" times
gemmgen.fused_attention on the whole sequence on one GPU: the ring's overhead at W = 1. Each time
is the longest rank's host wall time from a barrier and a synchronize to a synchronize, the median
of --reps after one warm-up call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gemmgen
import gemmgen.distributed as cp
from common import header, median_wall_s
from gemmgen.distributed.schedule import DKV_TAG, KV_TAG

HEAD_DIM = 128
DTYPE = torch.bfloat16
DEVICE = "cuda"


class _Ready:
    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor


class LoopbackRing:
    """A ring of `world` ranks without transfers: each rank gets back the tensor it sends, so the
    schedule does all its attention, merges and copies and moves nothing."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def exchange(self, tensor: torch.Tensor, tag: int) -> _Ready:
        return _Ready(tensor)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("a LoopbackRing moves nothing")

    def check_device(self, device: torch.device) -> None:
        pass


def transfers_only(ring: cp.Ring, kv: torch.Tensor, dkv: torch.Tensor, backward: bool) -> None:
    """The schedule's transfers without its attention: the forward's W-1 block exchanges, and with
    `backward` the backward's W-1 block exchanges overlapped with W partial exchanges."""
    buf = kv
    for _ in range(ring.world - 1):
        buf = ring.exchange(buf, KV_TAG).wait()
    if not backward:
        return
    buf, partial = kv, None
    for step in range(ring.world):
        pending_kv = ring.exchange(buf, KV_TAG) if step + 1 < ring.world else None
        partial = ring.exchange(partial.wait() if partial is not None else dkv, DKV_TAG)
        if pending_kv is not None:
            buf = pending_kv.wait()
    partial.wait()


def timed(fn: Callable[[], None], group, reps: int) -> float:
    """Milliseconds: the median over `reps` calls (after one warm-up) of the longest rank's time."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - start], device=DEVICE)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        times.append(took.item() * 1e3)
    return statistics.median(times)


def measure(n: int, world: int, group, args) -> dict[str, float]:
    """This rank's part of the timings of one shape at one world size (every rank of `group` calls)."""
    rank = dist.get_rank(group)
    local = n // world
    q = torch.randn(1, args.heads, local, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    for t in (q, k, v):
        t.requires_grad_()
    loopback = LoopbackRing(rank, world)

    def forward(ring):
        def run():
            with torch.no_grad():
                cp.ring_attention(q, k, v, group=ring, causal=True, layout=args.layout)
        return run

    def forward_backward(ring):
        def run():
            o = cp.ring_attention(q, k, v, group=ring, causal=True, layout=args.layout)
            torch.autograd.grad(o, (q, k, v), do)
        return run

    got = {"fwd": timed(forward(group), group, args.reps),
           "fwd+bwd": timed(forward_backward(group), group, args.reps)}
    if world > 1:
        ring = cp.ring_for(group)
        kv = torch.stack((k.detach(), v.detach()))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=DEVICE)
        got["fwd compute"] = timed(forward(loopback), group, args.reps)
        got["fwd+bwd compute"] = timed(forward_backward(loopback), group, args.reps)
        got["fwd comm"] = timed(lambda: transfers_only(ring, kv, dkv, False), group, args.reps)
        got["fwd+bwd comm"] = timed(lambda: transfers_only(ring, kv, dkv, True), group, args.reps)
    return got


def measure_fused(n: int, args) -> dict[str, float]:
    """gemmgen.fused_attention on the whole sequence on this GPU alone."""
    q = torch.randn(1, args.heads, n, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k, v, do = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    for t in (q, k, v):
        t.requires_grad_()

    def fwd():
        with torch.no_grad():
            gemmgen.fused_attention(q, k, v, causal=True)

    def fwd_bwd():
        torch.autograd.grad(gemmgen.fused_attention(q, k, v, causal=True), (q, k, v), do)

    return {"fwd": _alone(fwd, args.reps), "fwd+bwd": _alone(fwd_bwd, args.reps)}


def _alone(fn: Callable[[], None], reps: int) -> float:
    """Milliseconds on this GPU alone: the median over `reps` calls after one warm-up."""
    fn()
    return median_wall_s(fn, reps) * 1e3


def worlds_up_to(gpus: int) -> list[int]:
    """1, 2, 4, ... up to `gpus`, and `gpus` itself."""
    out, w = [], 1
    while w <= gpus:
        out.append(w)
        w *= 2
    return sorted(set(out) | {gpus})


def flops(n: int, heads: int, mode: str) -> float:
    forward = 4 * heads * n * n * HEAD_DIM / 2  # causal: half the pairs
    return forward * (1.0 if mode == "fwd" else 3.5)


def row(n: int, label: str, world: int, got: dict[str, float], base: dict[str, float] | None, heads: int) -> str:
    cells = [str(n), label]
    for mode in ("fwd", "fwd+bwd"):
        ms = got[mode]
        tf = flops(n, heads, mode) / (ms * 1e-3) / world / 1e12
        eff = f"{base[mode] / (world * ms):.2f}" if base else "-"
        comm = got.get(f"{mode} comm")
        if comm is None:
            cells += [f"{ms:.1f}", f"{tf:.0f}", eff, "-", "-"]
            continue
        hidden = (got[f"{mode} compute"] + comm - ms) / comm if comm > 0 else 1.0
        cells += [f"{ms:.1f}", f"{tf:.0f}", eff, f"{comm:.1f}", f"{min(1.0, max(0.0, hidden)):.2f}"]
    return "| " + " | ".join(cells) + " |"


TABLE_HEAD = ["| N | GPUs | fwd ms | fwd TFLOP/s/GPU | fwd eff | fwd comm ms | fwd hidden | fwd+bwd ms | "
              "fwd+bwd TFLOP/s/GPU | fwd+bwd eff | fwd+bwd comm ms | fwd+bwd hidden |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def run(rank: int, world: int, args) -> None:
    """The benchmark on every rank of an initialized NCCL group of `world` processes; rank 0 prints
    the table and writes --out."""
    worlds = worlds_up_to(world)
    groups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank creates every group
    lines = []
    if rank == 0:
        lines.append(header(f"gemmgen.distributed.ring_attention, layout {args.layout}, B=1 H={args.heads} "
                            f"d={HEAD_DIM} bf16 causal; times: the longest rank's wall time, median of {args.reps}; "
                            f"eff: against the ring on 1 GPU; hidden: (compute + comm - ring) / comm"))
        lines += ["", *TABLE_HEAD]
        print("\n".join(lines), flush=True)
    for n in args.seq_len:
        base = None
        if rank == 0:
            line = row(n, "1 (fused_attention)", 1, measure_fused(n, args), None, args.heads)
            lines.append(line)
            print(line, flush=True)
        dist.barrier()
        for w in worlds:
            if rank < w:
                got = measure(n, w, groups[w], args)
                if rank == 0:
                    base = base or got
                    line = row(n, str(w), w, got, base, args.heads)
                    lines.append(line)
                    print(line, flush=True)
            torch.cuda.empty_cache()
            dist.barrier()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def spawned(rank: int, world: int, init_file: str, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count(),
                    help="largest world size (default: every GPU); ignored under torchrun")
    ap.add_argument("--seq-len", nargs="+", type=int, default=[32768, 65536, 131072])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layout", default="zigzag", choices=list(cp.LAYOUTS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    if not 1 <= args.gpus <= torch.cuda.device_count():
        print(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(args.gpus, os.path.join(tmp, "init"), args), nprocs=args.gpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
