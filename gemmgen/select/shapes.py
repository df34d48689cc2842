"""Problem shapes for autotune, profile and the benchmarks: parsing "B,H,N,d[,causal]" and the
FlashAttention sweep (one source for `gemmgen profile --sweep fa` and bench/)."""
from __future__ import annotations

import math

import dataclasses
import re

from gemmgen.select.buckets import LAYOUTS
from gemmgen.errors import InputError

DTYPES = ("bf16", "fp16")

# FlashAttention's benchmark: batch * seqlen = 16384 tokens, heads * head_dim = 2048, Nq = Nk = N.
TOKENS, HIDDEN = 16384, 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128)
SWEEPS = ("fa",)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem to run: sizes, dtype, mask and layout kind (see gemmgen.select.buckets)."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"
    heads_kv: int | None = None  # None: heads (no GQA)
    layout: str = "bhnd"

    def __post_init__(self) -> None:
        if min(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim) < 1:
            raise InputError(f"sizes must be positive: {self}")
        if self.heads % self.kv_heads:
            raise InputError(f"heads_kv {self.heads_kv} must divide heads {self.heads}")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise InputError(f"layout {self.layout!r}; supported: {', '.join(LAYOUTS)}")

    @property
    def kv_heads(self) -> int:
        """Hkv (heads when not GQA)."""
        return self.heads_kv or self.heads

    @property
    def flops(self) -> float:
        """4 * B * H * Nq * Nk * d, halved for causal (the FlashAttention papers' convention)."""
        return 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim / (
            2 if self.causal else 1)

    def describe(self) -> str:
        """e.g. "B=32 H=16 Nq=Nk=512 d=128 bf16 causal"."""
        n = f"Nq=Nk={self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Nq={self.seqlen_q} Nk={self.seqlen_k}"
        kv = f" Hkv={self.kv_heads}" if self.kv_heads != self.heads else ""
        lay = f" {self.layout}" if self.layout != "bhnd" else ""
        return (f"B={self.batch} H={self.heads}{kv} {n} d={self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''}{lay}")

    def spec(self) -> str:
        """The compact text stored with measurements: "B,H,Hkv,Nq,Nk,d"."""
        return f"{self.batch},{self.heads},{self.kv_heads},{self.seqlen_q},{self.seqlen_k},{self.head_dim}"


def parse_shape(text: str, *, dtype: str = "bf16", causal: bool = False, heads_kv: int | None = None,
                layout: str = "bhnd") -> Shape:
    """Parse "B,H,N,d", "B,H,Nq,Nk,d", either followed by ",causal"; raise InputError if malformed."""
    parts = [p.strip() for p in text.split(",")]
    if parts and parts[-1].lower() == "causal":
        causal, parts = True, parts[:-1]
    if len(parts) not in (4, 5) or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise InputError(f"malformed shape {text!r}: expected B,H,N,d or B,H,Nq,Nk,d (positive "
                         f"integers), optionally followed by ,causal")
    sizes = [int(p) for p in parts]
    if len(sizes) == 4:
        sizes.insert(3, sizes[2])
    b, h, nq, nk, d = sizes
    return Shape(b, h, nq, nk, d, causal=causal, dtype=dtype, heads_kv=heads_kv, layout=layout)


def fa_sweep(dtypes: tuple[str, ...] = DTYPES, head_dims: tuple[int, ...] = SWEEP_HEAD_DIMS,
             seqlens: tuple[int, ...] = SEQLENS) -> list[Shape]:
    """The FlashAttention sweep: per dtype, head dim, mask (none, causal) and N, B = TOKENS / N and
    H = HIDDEN / d, in that order."""
    return [Shape(TOKENS // n, HIDDEN // d, n, n, d, causal=causal, dtype=dt)
            for dt in dtypes for d in head_dims for causal in (False, True) for n in seqlens]


def sweep(name: str, **kwargs: tuple) -> list[Shape]:
    """The shapes of a named sweep (`--sweep fa`); raise InputError for an unknown name."""
    if name != "fa":
        raise InputError(f"unknown sweep {name!r}; known: {', '.join(SWEEPS)}")
    return fa_sweep(**{k: v for k, v in kwargs.items() if v})


def tflops(shape: Shape, ms: float) -> float:
    """TFLOP/s of one call of `ms` milliseconds on `shape` (0 for a failed one)."""
    return shape.flops / ms / 1e9 if math.isfinite(ms) and ms > 0 else 0.0
