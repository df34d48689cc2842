"""How a global sequence is cut over the ranks of a ring (the layouts), and the helpers that cut a
full tensor into one rank's shard and join the shards back.

With W ranks the sequence is cut into equal chunks:

    contiguous   W chunks; rank r holds chunk r.
    zigzag       2W chunks; rank r holds chunks r and 2W-1-r, concatenated in that order. Under a
                 causal mask every rank then does the same work (an early chunk, which sees few
                 keys, paired with a late one, which sees many).

The local rows of a shard are its chunks' rows in global order within each chunk.
"""
from __future__ import annotations

from typing import Sequence

import torch

from gemmgen.errors import InputError

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: object) -> str:
    """`layout` if it is one of LAYOUTS, else InputError."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}; got {layout!r}")
    return layout


def chunk_count(world: int, layout: str) -> int:
    """How many equal chunks the global sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def rank_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order of its local rows."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def chunk_length(n_global: int, world: int, layout: str) -> int:
    """The rows of one chunk; InputError when the sequence does not cut into equal chunks."""
    chunks = chunk_count(world, layout)
    if n_global < chunks or n_global % chunks:
        raise InputError(f"layout={layout!r} over {world} rank(s) cuts the sequence into {chunks} equal chunks "
                         f"of at least one row; a length of {n_global} does not divide (pad it to a multiple "
                         f"of {chunks})")
    return n_global // chunks


def check_local_length(n_local: int, world: int, layout: str) -> None:
    """InputError unless a shard of `n_local` rows can come from `layout`: at least one row, and
    for zigzag an even count (two chunks of equal length)."""
    if n_local < 1:
        raise InputError(f"each rank's shard needs at least one row of the sequence; got {n_local}")
    if layout == "zigzag" and n_local % 2:
        raise InputError(f"layout='zigzag' cuts the global sequence into 2W = {2 * world} equal chunks and gives "
                         f"each rank two of them, so the local length must be even; got {n_local} (global "
                         f"{n_local * world}). Pad the sequence to a multiple of {2 * world}, or use "
                         f"layout='contiguous'")


def shard_positions(n_global: int, rank: int, world: int, layout: str = "zigzag",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64) of rank `rank`'s local rows, e.g. for rotary position ids."""
    check_layout(layout)
    c = chunk_length(n_global, world, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(rank, world, layout)])


def take_shard(x: torch.Tensor, dim: int, rank: int, world: int, layout: str = "zigzag") -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` along `dim` (a new tensor)."""
    check_layout(layout)
    c = chunk_length(x.shape[dim], world, layout)
    return torch.cat([x.narrow(dim, i * c, c) for i in rank_chunks(rank, world, layout)], dim=dim)


def join_shards(shards: Sequence[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (`shards[r]` from rank r), along `dim`."""
    check_layout(layout)
    world = len(shards)
    n_local = shards[0].shape[dim]
    check_local_length(n_local, world, layout)
    c = n_local // len(rank_chunks(0, world, layout))
    pieces: dict[int, torch.Tensor] = {}
    for rank, x in enumerate(shards):
        if x.shape != shards[0].shape:
            raise InputError(f"every shard must have one shape; rank {rank}'s is {tuple(x.shape)}, "
                             f"rank 0's {tuple(shards[0].shape)}")
        for j, chunk in enumerate(rank_chunks(rank, world, layout)):
            pieces[chunk] = x.narrow(dim, j * c, c)
    return torch.cat([pieces[i] for i in range(chunk_count(world, layout))], dim=dim)
