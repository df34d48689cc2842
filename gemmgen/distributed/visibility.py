"""Which query rows of a rank see which keys of the block in hand, at each step of the ring.

At step s rank r holds the key/value block of rank (r - s) mod W (blocks travel to rank + 1). A
query at global position i sees a key at position j when the mask allows it: always without a
causal mask, j <= i with one. Chunks are equal, so for a query chunk a and a key chunk b the
whole rectangle is visible when b < a, nothing is when b > a, and when b == a it is the causal
triangle (top-left: local key j visible to local query i when j <= i).

Causal, contiguous layout (rank r holds chunk r): the own block is the triangle; a block from a
lower rank is fully visible; a block from a higher rank is skipped (no compute).

Causal, zigzag layout (rank r holds chunks r and 2W-1-r, each c rows; r < W <= 2W-1-r):

    own block (s == r): q chunks (r, 2W-1-r) x k chunks (r, 2W-1-r)
        (r, r): triangle; (r, 2W-1-r): invisible; (2W-1-r, r): full; (2W-1-r, 2W-1-r): triangle.
        That is exactly the top-left causal mask over the 2c x 2c concatenation (local row i < c
        sees no local key j >= c, local row i >= c sees every j < c), so one causal block.
    lower rank (s < r): k chunks (s, 2W-1-s) with s < r and 2W-1-s > 2W-1-r > r:
        both query chunks see chunk s fully and neither sees chunk 2W-1-s:
        every local query x the block's first c keys, no mask.
    higher rank (s > r): chunk s > r and chunk 2W-1-s >= W > r hide from query chunk r, while
        query chunk 2W-1-r > 2W-1-s and >= W > s sees both:
        the local second c queries x every key of the block, no mask.

Every step besides the own one is then a c x 2c or 2c x c rectangle, half the pairs of a block,
on every rank: the work is balanced. tests/test_ring_attention.py checks these rules against the
mask of the global positions for W = 1..4.
"""
from __future__ import annotations

from dataclasses import dataclass

from gemmgen.distributed.layouts import check_layout


@dataclass(frozen=True)
class Block:
    """One attention call of a step: local query rows `q` against rows `k` of the key/value block
    in hand; `causal`: the top-left causal mask over this rectangle, else every pair is visible."""
    q: slice
    k: slice
    causal: bool


def source_rank(rank: int, step: int, world: int) -> int:
    """The rank whose key/value block rank `rank` holds at `step` (step 0: its own)."""
    return (rank - step) % world


def visible_blocks(rank: int, source: int, world: int, n_local: int, layout: str,
                   causal: bool) -> tuple[Block, ...]:
    """The calls rank `rank` makes against the block of rank `source` (empty: nothing visible).

    Each visible (query, key) pair is covered exactly once; n_local is the rows of every shard
    (even for zigzag)."""
    check_layout(layout)
    rows = slice(0, n_local)
    if not causal:
        return (Block(rows, rows, False),)
    if source == rank:
        return (Block(rows, rows, True),)
    if layout == "contiguous":
        return (Block(rows, rows, False),) if source < rank else ()
    half = n_local // 2
    if source < rank:
        return (Block(rows, slice(0, half), False),)
    return (Block(slice(half, n_local), rows, False),)
