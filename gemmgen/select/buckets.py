"""Size buckets: the unit the tuning database remembers a winner for.

A problem's sizes fall into a bucket by rounding each of batch*heads, Nq and Nk up to a power of
two: a size n goes to the smallest power of two >= n, so 513..1024 share the bucket 1024 and the
powers of two that benchmarks use sit at the top of their bucket. The KV layout kind ("bhnd",
"bnhd" or "mixed", see gemmgen.select.problem) and the GQA ratio H / Hkv are kept exactly, since they
change the memory traffic, not only the amount of work.

A bucket's key is its text form, e.g. "bhnd_g1_bh512_q1024_k1024".

The distance between two buckets (used to borrow the winner of the nearest tuned bucket) counts
doublings: |log2 a - log2 b| summed over batch*heads, Nq and Nk, plus 1 for a different layout
kind and |log2| of the GQA ratios' quotient.
"""
from __future__ import annotations

import dataclasses
import math
import re

from gemmgen.errors import InputError

LAYOUTS = ("bhnd", "bnhd", "mixed")
_KEY_RE = re.compile(r"^(bhnd|bnhd|mixed)_g(\d+)_bh(\d+)_q(\d+)_k(\d+)$")


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """The bucketed sizes of a problem (see the module docstring)."""

    layout: str
    gqa: int
    batch_heads: int
    seqlen_q: int
    seqlen_k: int

    @property
    def key(self) -> str:
        """The text form stored in the tuning database."""
        return f"{self.layout}_g{self.gqa}_bh{self.batch_heads}_q{self.seqlen_q}_k{self.seqlen_k}"

    def __str__(self) -> str:
        return self.key


def bucket_of(*, layout: str, gqa: int, batch_heads: int, seqlen_q: int, seqlen_k: int) -> Bucket:
    """The bucket of a problem with these exact sizes."""
    return Bucket(layout, gqa, pow2_ceil(batch_heads), pow2_ceil(seqlen_q), pow2_ceil(seqlen_k))


def parse_key(key: str) -> Bucket:
    """The Bucket of a key written by Bucket.key; raise InputError for anything else."""
    match = _KEY_RE.match(key)
    if match is None:
        raise InputError(f"not a bucket key: {key!r} (expected e.g. bhnd_g1_bh512_q1024_k1024)")
    layout, *sizes = match.groups()
    return Bucket(layout, *(int(s) for s in sizes))


def _log2_gap(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


def distance(a: Bucket, b: Bucket) -> float:
    """Doublings between two buckets (0 for the same bucket)."""
    return (_log2_gap(a.batch_heads, b.batch_heads) + _log2_gap(a.seqlen_q, b.seqlen_q)
            + _log2_gap(a.seqlen_k, b.seqlen_k) + _log2_gap(a.gqa, b.gqa)
            + (0.0 if a.layout == b.layout else 1.0))
