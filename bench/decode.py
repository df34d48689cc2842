"""Decode and key-value-cache attention: gemmgen.fused_attention_with_kvcache against torch SDPA's backends.

Shapes: two decode headlines (B=4 H=32 Hkv=8 Nq=1 Nk=65536 d=128; B=16 Nk=8192), one chunked
prefill (B=1 H=32 Hkv=8 Nq=1024 Nk=8192, causal bottom-right) and a grid: B in (1, 8, 32, 128), Nk in
(1024, 8192, 32768, 131072), Hkv 8 (GQA 32:8) and 32 (MHA), d 64 and 128, Nq 1 and 4, H = 32. A shape
whose K and V caches together exceed --max-cache-gib is skipped with a note. Every sequence holds
all Nk keys (cache_seqlens = Nk), so every side computes the same attention: the kvcache call's
causal mask (bottom-right) is no mask at Nq = 1.

    python bench/decode.py [--quick] [--dtype bf16] [--rounds 5] [--graph] [--out FILE.md]

Sides, all in the same process on the same cache data:

    contiguous   gemmgen.fused_attention_with_kvcache, cache [B, Nk, Hkv, d]
    paged-P      the same with a paged cache [pages, P, Hkv, d] and a random block table (P = 64, 256)
    dense        gemmgen.fused_attention(q, k, v, causal=True, causal_alignment="bottom_right") on
                 [B, H, Nq, d] / [B, Hkv, Nk, d] tensors (where it runs)
    cuDNN, FA2, efficient
                 torch SDPA restricted to one backend, on a [B, Hkv, Nk, d] copy of the cache made
                 outside timing, enable_gqa=True for GQA (K/V expanded outside timing where this
                 torch has no enable_gqa). At Nq > 1 SDPA gets an explicit bool mask of the
                 bottom-right causal pattern (its is_causal is top-left), which FA2 cannot take.
                 A backend that raises for a shape shows "-".

GB/s counts K and V read once, Q read and O written once: (2 * B * Nk * Hkv + 2 * B * Nq * H) * d *
bytes per element, over the time per call. Caches smaller than L2 stay there between calls and read
faster than memory. The copy bandwidth (dst.copy_(src) of --copy-gib GiB, read + write counted) is
measured at the start of the run; "of copy" is the contiguous side's GB/s over it.

Timing: each side's calls are queued back to back, eager, the host path included (with --graph: one
CUDA graph per side holding a batch of calls, replayed, so the host path is gone); CUDA events around
a batch of 10 to 50 calls (fewer for large caches, --batch-ms per batch), one batch per side per
round, the sides in alternating order round by round (gemmgen.select.timing.alternating_rounds),
each side the median over --rounds rounds. SDPA's backend restriction is entered once per batch,
outside its calls. The kvcache calls leave the lengths and the block table on the GPU (no
check_values), so they queue ahead of the GPU as SDPA's do; --graph shows the kernels without the
host path. Before timing, every gemmgen side's output is compared with an SDPA
backend's (max abs diff column).

The chunked-prefill shape also reports TFLOP/s (4 * B * H * d * visible pairs) and, timed in the
same rounds, gemmgen.fused_attention on a dense causal prefill (Nq = Nk = N) of about the same
visible pairs. The table goes to --out (default bench/results/decode_<gpu>.md) and last to stdout,
with the summary lines: the lowest gemmgen/best-SDPA ratio, the lowest fraction of the copy
bandwidth over caches with B * Hkv * Nk >= 2**20, the largest paged slowdown against the
contiguous cache, and the chunked prefill's rate against the dense causal rate.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import re
import shlex
import statistics
import sys
import warnings
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from common import DTYPES, header
from gemmgen.select import timing

BACKENDS = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "FA2": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
DENSE_CAUSAL = "dense causal"  # the chunked prefill's comparison side

HEADS = 32
GRID = {"batch": (1, 8, 32, 128), "seqlen_k": (1024, 8192, 32768, 131072), "heads_kv": (8, 32),
        "head_dim": (64, 128), "seqlen_q": (1, 4)}
QUICK_GRID = {"batch": (1, 32), "seqlen_k": (8192, 32768), "heads_kv": (8, 32), "head_dim": (128,),
              "seqlen_q": (1, 4)}
PAGE_SIZES = (64, 256)
BAR_MIN_KEYS = 2**20  # B * Hkv * Nk from which a cache is far larger than L2: the copy-fraction bar
GIB = 2**30
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One benchmark shape: q [B, Nq, H, d] against B sequences of Nk keys in Hkv heads."""

    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    tag: str = ""  # "decode", "chunked prefill" for the headline shapes

    @property
    def label(self) -> str:
        """e.g. "decode B4 H32 Hkv8 Nq1 Nk65536 d128"."""
        sizes = (f"B{self.batch} H{self.heads} Hkv{self.heads_kv} Nq{self.seqlen_q} Nk{self.seqlen_k} "
                 f"d{self.head_dim}")
        return f"{self.tag} {sizes}" if self.tag else sizes

    @property
    def keys(self) -> int:
        """B * Hkv * Nk: the key rows the call reads."""
        return self.batch * self.heads_kv * self.seqlen_k

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs per (batch, head) the bottom-right causal mask lets through."""
        return visible_pairs(self.seqlen_q, self.seqlen_k)

    @property
    def flops(self) -> float:
        """4 * B * H * d * visible pairs."""
        return 4.0 * self.batch * self.heads * self.head_dim * self.visible_pairs


def cache_bytes(shape: DecodeShape, elem: int) -> int:
    """Bytes of the K and V caches together: 2 * B * Nk * Hkv * d * elem."""
    return 2 * shape.batch * shape.seqlen_k * shape.heads_kv * shape.head_dim * elem


def moved_bytes(shape: DecodeShape, elem: int) -> int:
    """The bytes a call must move: K and V read once, Q read and O written once."""
    qo = 2 * shape.batch * shape.seqlen_q * shape.heads * shape.head_dim * elem
    return cache_bytes(shape, elem) + qo


def visible_pairs(nq: int, nk: int) -> int:
    """Pairs with key j <= i + nk - nq (bottom-right causal), for query rows i < nq."""
    return sum(max(0, min(nk, i + nk - nq + 1)) for i in range(nq))


def dense_causal_n(pairs: int, multiple: int = 128) -> int:
    """N (a multiple of `multiple`) whose square causal problem's N(N+1)/2 pairs are nearest `pairs`."""
    n = math.sqrt(2 * pairs)
    return max(multiple, round(n / multiple) * multiple)


def headline_shapes() -> list[DecodeShape]:
    """The issue's three headline shapes."""
    return [DecodeShape(4, HEADS, 8, 1, 65536, 128, "decode"),
            DecodeShape(16, HEADS, 8, 1, 8192, 128, "decode"),
            DecodeShape(1, HEADS, 8, 1024, 8192, 128, "chunked prefill")]


def grid_shapes(grid: dict[str, Iterable[int]]) -> Iterator[DecodeShape]:
    """The grid's shapes in table order: d, then Hkv, Nq, B, Nk (H fixed at HEADS)."""
    for d, hkv, nq, b, nk in itertools.product(grid["head_dim"], grid["heads_kv"], grid["seqlen_q"],
                                                grid["batch"], grid["seqlen_k"]):
        yield DecodeShape(b, HEADS, hkv, nq, nk, d)


def skip_reason(shape: DecodeShape, elem: int, max_cache_bytes: int, page_sizes: Iterable[int]) -> str | None:
    """Why a shape is not run, or None: its K+V caches over the budget, or Nk not whole pages."""
    size = cache_bytes(shape, elem)
    if size > max_cache_bytes:
        return f"K+V cache {size / GIB:.1f} GiB > budget {max_cache_bytes / GIB:.1f} GiB"
    for p in page_sizes:
        if shape.seqlen_k % p:
            return f"Nk {shape.seqlen_k} is not a multiple of page size {p}"
    return None


def calls_per_batch(est_ms: float, batch_ms: float, lo: int = 10, hi: int = 50) -> int:
    """Calls in one timed batch: enough to last `batch_ms`, within [lo, hi]."""
    if not est_ms > 0 or not math.isfinite(est_ms):
        return hi
    return max(lo, min(hi, math.ceil(batch_ms / est_ms)))


def gpu_slug(name: str) -> str:
    """A short file-name tag for a GPU name: "NVIDIA H100 80GB HBM3" -> "h100"."""
    tokens = [t for t in re.findall(r"[a-z0-9]+", name.lower()) if t not in ("nvidia", "geforce", "tesla")]
    for t in tokens:
        if re.search(r"[a-z]", t) and re.search(r"[0-9]", t):
            return t
    return "_".join(tokens) or "gpu"


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


@dataclasses.dataclass
class Result:
    """What one shape measured: ms per call of each side that ran, gemmgen's max abs diffs."""

    shape: DecodeShape
    ms: dict[str, float]
    diffs: dict[str, float]
    nbytes: int
    dense_n: int = 0  # the chunked prefill's dense causal N, 0 elsewhere
    notes: list[str] = dataclasses.field(default_factory=list)

    def gbps(self, side: str) -> float | None:
        t = self.ms.get(side)
        return self.nbytes / t / 1e6 if t else None

    def best_sdpa(self) -> tuple[str | None, float | None]:
        got = [(self.gbps(b), b) for b in BACKENDS if self.gbps(b)]
        if not got:
            return None, None
        rate, name = max(got)
        return name, rate

    def ratio(self) -> float | None:
        """The contiguous side's rate over the fastest SDPA backend's."""
        _, best = self.best_sdpa()
        mine = self.gbps("contiguous")
        return mine / best if mine and best else None

    def tflops(self, side: str) -> float | None:
        t = self.ms.get(side)
        if not t:
            return None
        if side == DENSE_CAUSAL:
            return 4.0 * self.shape.batch * self.shape.heads * self.shape.head_dim * \
                visible_pairs(self.dense_n, self.dense_n) / t / 1e9
        return self.shape.flops / t / 1e9


def table_columns(page_sizes: Iterable[int]) -> list[str]:
    return (["shape", "contiguous GB/s"] + [f"paged-{p} GB/s" for p in page_sizes]
            + ["dense API GB/s", "best SDPA GB/s", "gemmgen/SDPA", "of copy", "max abs diff"])


def table_head(page_sizes: Iterable[int]) -> list[str]:
    cols = table_columns(page_sizes)
    return ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]


def table_row(r: Result, page_sizes: Iterable[int], copy_gbps: float) -> str:
    """One markdown row; SDPA at Nq > 1 ran with an explicit mask (marked "m")."""
    name, best = r.best_sdpa()
    mine = r.gbps("contiguous")
    mark = " m" if r.shape.seqlen_q > 1 else ""
    sdpa = "-" if name is None else f"{name}{mark} {best:.0f}"
    diff = max(r.diffs.values()) if r.diffs else None
    cells = ([r.shape.label, fmt(mine)] + [fmt(r.gbps(f"paged-{p}")) for p in page_sizes]
             + [fmt(r.gbps("dense")), sdpa, fmt(r.ratio(), 2),
                fmt(mine / copy_gbps if mine and copy_gbps else None, 2),
                "-" if diff is None else f"{diff:.1e}"])
    return "| " + " | ".join(cells) + " |"


def summary_lines(results: list[Result], page_sizes: Iterable[int], copy_gbps: float) -> list[str]:
    """The bars' lines: lowest ratio to the best SDPA backend (all shapes, and Nq = 1 alone),
    the shapes below 1.00, the lowest fraction of the copy bandwidth where B * Hkv * Nk >= 2**20, the
    largest paged slowdown at page size >= 64, and the chunked prefill against the dense causal rate."""
    out = []
    ratios = [(r.ratio(), r.shape.label) for r in results if r.ratio() is not None]
    if ratios:
        low, where = min(ratios)
        out.append(f"- min gemmgen contiguous / best SDPA: {low:.2f} ({where}) over {len(ratios)} shapes")
        plain = [(r.ratio(), r.shape.label) for r in results if r.ratio() is not None and r.shape.seqlen_q == 1]
        if plain:
            low1, where1 = min(plain)
            out.append(f"- min at Nq = 1 (SDPA without a mask): {low1:.2f} ({where1}) over {len(plain)} shapes")
        below = sorted(x for x in ratios if x[0] < 1.0)
        out.append("- below 1.00: " + (", ".join(f"{label} {x:.2f}" for x, label in below) or "none"))
    else:
        out.append("- min gemmgen contiguous / best SDPA: no shape with both measured")
    fracs = [(r.gbps("contiguous") / copy_gbps, r.shape.label) for r in results
             if r.shape.keys >= BAR_MIN_KEYS and r.gbps("contiguous") and copy_gbps]
    out.append(f"- min fraction of copy bandwidth ({copy_gbps:.0f} GB/s), B*Hkv*Nk >= 2**20: "
               + (f"{min(fracs)[0]:.2f} ({min(fracs)[1]}) over {len(fracs)} shapes" if fracs else "no shape"))
    slow = [(r.ms[f"paged-{p}"] / r.ms["contiguous"], f"paged-{p} {r.shape.label}") for r in results
            for p in page_sizes if p >= 64 and f"paged-{p}" in r.ms and "contiguous" in r.ms]
    out.append("- max paged slowdown vs contiguous (time ratio), page size >= 64: "
               + (f"{max(slow)[0]:.2f}x ({max(slow)[1]}) over {len(slow)} measurements" if slow else "none measured"))
    for r in results:
        if r.dense_n:
            mine, dense = r.tflops("contiguous"), r.tflops(DENSE_CAUSAL)
            ratio = f" = {mine / dense:.2f}" if mine and dense else ""
            out.append(f"- {r.shape.label}: contiguous {fmt(mine)} TFLOP/s vs dense causal "
                       f"N={r.dense_n} (gemmgen.fused_attention, same rounds) {fmt(dense)} TFLOP/s{ratio}")
    return out


def prefill_table(results: list[Result], page_sizes: Iterable[int]) -> list[str]:
    """TFLOP/s of every side at the chunked-prefill shapes (visible pairs counted)."""
    rows = []
    for r in results:
        if not r.dense_n:
            continue
        sides = ["contiguous"] + [f"paged-{p}" for p in page_sizes] + ["dense", *BACKENDS, DENSE_CAUSAL]
        names = [s if s != DENSE_CAUSAL else f"dense causal N={r.dense_n}" for s in sides]
        rows += [f"### {r.shape.label}, TFLOP/s (4*B*H*d*visible pairs; SDPA with a bool mask)", "",
                 "| " + " | ".join(names) + " |", "|---" * len(names) + "|",
                 "| " + " | ".join(fmt(r.tflops(s)) for s in sides) + " |", ""]
    return rows


# --- GPU side ---------------------------------------------------------------------------------------

def has_enable_gqa() -> bool:
    """Whether this torch's SDPA takes enable_gqa (torch 2.5 and later)."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def batch_ms(go: Callable[[], None], calls: int) -> float:
    """Milliseconds per call of one batch `go` of `calls` calls, CUDA events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    go()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def copy_gbps(gib: float, rounds: int, calls: int = 10) -> float:
    """Device copy bandwidth, read + write counted: dst.copy_(src) of `gib` GiB, median of rounds."""
    n = int(gib * GIB)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def go():
        for _ in range(calls):
            dst.copy_(src)
    go()
    ms = statistics.median(batch_ms(go, calls) for _ in range(rounds))
    return 2 * n / ms / 1e6


Side = tuple[Callable[[], torch.Tensor], Callable[[], contextlib.AbstractContextManager] | None]


def eager_batch(side: Side, calls: int) -> Callable[[], None]:
    fn, ctx = side

    def go():
        with ctx() if ctx else contextlib.nullcontext():
            for _ in range(calls):
                fn()
    return go


def graph_batch(side: Side, calls: int) -> Callable[[], None]:
    """A CUDA graph of `calls` calls of the side (warmed on a side stream first), as its replay."""
    go = eager_batch(side, calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager_batch(side, 1)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go()
    return graph.replay


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:160]


def try_side(label: str, side: Side, notes: list[str]) -> torch.Tensor | None:
    """One call of a side (its output), or None with a note when it raises."""
    fn, ctx = side
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ctx() if ctx else contextlib.nullcontext():
                out = fn()
            torch.cuda.synchronize()
        return out
    except (RuntimeError, ValueError, NotImplementedError, gemmgen.GemmgenError) as exc:
        if isinstance(exc, OOM):
            torch.cuda.empty_cache()
        notes.append(f"{label}: not run ({first_line(exc)})")
        return None


def max_abs_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def measure(shape: DecodeShape, dtype: torch.dtype, args, copy_rate: float, gqa_kw: bool,
            dev: str = "cuda") -> Result:
    """Build the shape's tensors, check and time every side that runs it."""
    b, h, hkv, nq, nk, d = shape.batch, shape.heads, shape.heads_kv, shape.seqlen_q, shape.seqlen_k, shape.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    notes: list[str] = []
    q = torch.randn(b, nq, h, d, device=dev, dtype=dtype)
    k_cache = torch.randn(b, nk, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn(b, nk, hkv, d, device=dev, dtype=dtype)
    seqlens = torch.full((b,), nk, dtype=torch.int32, device=dev)
    sides: dict[str, Side] = {
        "contiguous": (lambda: gemmgen.fused_attention_with_kvcache(q, k_cache, v_cache, seqlens), None)}
    for p in args.page_sizes:
        pages = b * (nk // p)
        perm = torch.randperm(pages, device=dev)  # block_table[b, j] = perm[b * pages_per_seq + j]
        kp = torch.empty(pages, p, hkv, d, device=dev, dtype=dtype)
        vp = torch.empty_like(kp)
        kp.index_copy_(0, perm, k_cache.view(pages, p, hkv, d))
        vp.index_copy_(0, perm, v_cache.view(pages, p, hkv, d))
        table = perm.to(torch.int32).view(b, nk // p)
        sides[f"paged-{p}"] = (lambda kp=kp, vp=vp, table=table: gemmgen.fused_attention_with_kvcache(
            q, kp, vp, seqlens, block_table=table), None)
    # SDPA's and the dense API's layout: [B, H, Nq, d] and [B, Hkv, Nk, d], copies made here.
    qb = q.transpose(1, 2).contiguous()
    kb = k_cache.transpose(1, 2).contiguous()
    vb = v_cache.transpose(1, 2).contiguous()
    sides["dense"] = (lambda: gemmgen.fused_attention(qb, kb, vb, causal=True, causal_alignment="bottom_right"),
                      None)
    mask = None
    if nq > 1:  # bottom-right causal: query i sees keys j <= i + nk - nq
        mask = torch.ones(nq, nk, dtype=torch.bool, device=dev).tril(diagonal=nk - nq)
    kw = {}
    ks, vs = kb, vb
    if hkv != h:
        if gqa_kw:
            kw["enable_gqa"] = True
        else:
            ks, vs = kb.repeat_interleave(h // hkv, dim=1), vb.repeat_interleave(h // hkv, dim=1)
            notes.append("SDPA: K/V expanded to H heads outside timing (no enable_gqa in this torch)")
    for label, backend in BACKENDS.items():
        sides[label] = (lambda: F.scaled_dot_product_attention(qb, ks, vs, attn_mask=mask, **kw),
                        lambda backend=backend: sdpa_kernel([backend]))
    dense_n = 0
    if shape.tag == "chunked prefill":
        dense_n = dense_causal_n(shape.visible_pairs)
        dq = torch.randn(b, h, dense_n, d, device=dev, dtype=dtype)
        dk, dv = (torch.randn(b, hkv, dense_n, d, device=dev, dtype=dtype) for _ in range(2))
        sides[DENSE_CAUSAL] = (lambda: gemmgen.fused_attention(dq, dk, dv, causal=True), None)

    outs = {}
    for label in list(sides):
        out = try_side(label, sides[label], notes)
        if out is None:
            del sides[label]
        else:
            outs[label] = out
    ref_name = next((x for x in BACKENDS if x in outs), None)
    ref = outs.get(ref_name)
    if ref is None:  # no backend runs it: torch's math path, if it fits
        ref = try_side("math reference", (lambda: F.scaled_dot_product_attention(qb, ks, vs, attn_mask=mask, **kw),
                                          lambda: sdpa_kernel([SDPBackend.MATH])), notes)
        ref_name = "math" if ref is not None else None
    diffs = {}
    if ref is not None:
        for label, out in outs.items():
            if label in BACKENDS or label == DENSE_CAUSAL:
                continue
            o = out if label == "dense" else out.transpose(1, 2)  # kvcache O is [B, Nq, H, d]
            diffs[label] = max_abs_diff(o, ref)
    del outs, ref

    nbytes = moved_bytes(shape, elem)
    calls = calls_per_batch(nbytes / copy_rate / 1e6, args.batch_ms)
    batches = {}
    for label, side in list(sides.items()):
        try:
            batches[label] = graph_batch(side, calls) if args.graph else eager_batch(side, calls)
        except (RuntimeError, gemmgen.GemmgenError) as exc:
            notes.append(f"{label}: no CUDA graph ({first_line(exc)})")
    for go in batches.values():  # warm-up: one batch each
        go()
    torch.cuda.synchronize()
    timers = {label: (lambda go=go: batch_ms(go, calls)) for label, go in batches.items()}
    got = timing.alternating_rounds(timers, args.rounds)
    ms = {label: statistics.median(t) for label, t in got.items()}
    notes.append(f"{calls} calls per batch; diffs vs {ref_name if ref_name else 'nothing (no reference ran)'}")
    del batches, timers, sides
    return Result(shape, ms, diffs, nbytes, dense_n, notes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Needs a CUDA GPU and gemmgen's default build (the decode family).")
    ap.add_argument("--quick", action="store_true",
                    help="the headline shapes and a small grid subset instead of the whole grid")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--batch", nargs="+", type=int, help=f"grid B (default {GRID['batch']})")
    ap.add_argument("--seqlen-k", nargs="+", type=int, help=f"grid Nk (default {GRID['seqlen_k']})")
    ap.add_argument("--heads-kv", nargs="+", type=int, help=f"grid Hkv with H={HEADS} (default {GRID['heads_kv']})")
    ap.add_argument("--head-dim", nargs="+", type=int, help=f"grid d (default {GRID['head_dim']})")
    ap.add_argument("--seqlen-q", nargs="+", type=int, help=f"grid Nq (default {GRID['seqlen_q']})")
    ap.add_argument("--no-headline", action="store_true", help="skip the three headline shapes")
    ap.add_argument("--no-grid", action="store_true", help="only the headline shapes")
    ap.add_argument("--page-sizes", nargs="+", type=int, default=list(PAGE_SIZES))
    ap.add_argument("--max-cache-gib", type=float, default=8.0,
                    help="skip shapes whose K+V caches together exceed this (GiB; default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds in alternating order per shape")
    ap.add_argument("--batch-ms", type=float, default=25.0,
                    help="target length of one timed batch (10 to 50 calls; default 25 ms)")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth probe (GiB)")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each batch instead of eager calls (no host path)")
    ap.add_argument("--out", help="markdown file for the table (default bench/results/decode[_graph]_<gpu>.md)")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print(f"bench/decode.py needs a CUDA GPU: this torch ({torch.__version__}) sees none.", file=sys.stderr)
        return 2
    grid = dict(QUICK_GRID if args.quick else GRID)
    for key in grid:
        if getattr(args, key) is not None:
            grid[key] = tuple(getattr(args, key))
    shapes = ([] if args.no_headline else headline_shapes()) + ([] if args.no_grid else list(grid_shapes(grid)))
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    out = args.out or (f"bench/results/decode{'_graph' if args.graph else ''}_"
                       f"{gpu_slug(torch.cuda.get_device_name(0))}.md")
    gqa_kw = has_enable_gqa()

    copy_rate = copy_gbps(args.copy_gib, args.rounds)
    torch.cuda.empty_cache()
    command = "python " + shlex.join(["bench/decode.py", *sys.argv[1:]])
    mode = ("CUDA-graph replays of a batch of calls (no host path)" if args.graph else
            "eager calls queued back to back, host path included")
    head = header(
        f"{args.dtype}, {mode}, default build untuned; CUDA events around a batch of 10-50 calls, the median "
        f"over {args.rounds} rounds with the sides in alternating order; GB/s = (K + V read once + Q read + O "
        f"written) / t; copy bandwidth {copy_rate:.0f} GB/s ({args.copy_gib:g} GiB dst.copy_(src), read + write); "
        f"\"of copy\" = contiguous GB/s / copy bandwidth; gemmgen/SDPA = contiguous / fastest SDPA backend; "
        f"SDPA {'with enable_gqa=True' if gqa_kw else 'on K/V expanded outside timing'} for GQA, at Nq > 1 "
        f"with a bottom-right causal bool mask (marked m; FA2 cannot take one); max abs diff: the gemmgen "
        f"sides against an SDPA backend; command: {command}")
    print(head, flush=True)
    print(f"{len(shapes)} shapes; the first call of each gemmgen side selects (and, unbuilt, builds) its "
          f"instance", file=sys.stderr, flush=True)

    free, _ = torch.cuda.mem_get_info()
    budget = int(args.max_cache_gib * GIB)
    results, skipped = [], []
    copies = 2 + len(args.page_sizes)  # the cache, its SDPA copy and one paged copy per page size
    for i, shape in enumerate(shapes):
        reason = skip_reason(shape, elem, budget, args.page_sizes)
        if reason is None and not gqa_kw and shape.heads_kv != shape.heads:
            copies_x = copies + shape.heads // shape.heads_kv
        else:
            copies_x = copies
        if reason is None and copies_x * cache_bytes(shape, elem) > 0.9 * free:
            reason = (f"{copies_x} copies of the K+V cache ({copies_x * cache_bytes(shape, elem) / GIB:.1f} GiB) "
                      f"exceed 90% of free memory ({free / GIB:.1f} GiB)")
        if reason:
            skipped.append(f"{shape.label}: {reason}")
            print(f"[{i + 1}/{len(shapes)}] {shape.label}: skipped ({reason})", flush=True)
            continue
        r = measure(shape, dtype, args, copy_rate, gqa_kw)
        torch.cuda.empty_cache()
        results.append(r)
        row = table_row(r, args.page_sizes, copy_rate)
        print(f"[{i + 1}/{len(shapes)}] {row}", flush=True)
        detail = "    GB/s: " + ", ".join(f"{s}={r.gbps(s):.0f}" for s in r.ms if s != DENSE_CAUSAL)
        if r.dense_n:
            detail += "; TFLOP/s: " + ", ".join(f"{s}={r.tflops(s):.0f}" for s in r.ms)
        detail += "; diff: " + (", ".join(f"{s}={x:.1e}" for s, x in r.diffs.items()) or "-")
        print(detail, file=sys.stderr, flush=True)
        for note in r.notes:
            print(f"    {note}", file=sys.stderr, flush=True)

    end_rate = copy_gbps(args.copy_gib, args.rounds)
    rows = table_head(args.page_sizes) + [table_row(r, args.page_sizes, copy_rate) for r in results]
    summary = summary_lines(results, args.page_sizes, copy_rate)
    summary.append(f"- copy bandwidth {copy_rate:.0f} GB/s at the start of the run, {end_rate:.0f} GB/s at the end")
    if skipped:
        summary.append(f"- skipped {len(skipped)}: " + "; ".join(skipped))
    text = "\n".join([head, "", *rows, "", *prefill_table(results, args.page_sizes), *summary]) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print("\n" + text, end="", flush=True)
    print(f"wrote {out}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
