"""shard and unshard: this rank's piece of a full sequence, and the full sequence back from every
rank's piece, for the ranks of a group (gemmgen.distributed.layouts holds the rules)."""
from __future__ import annotations

import torch

from gemmgen.distributed.comm import ring_for
from gemmgen.distributed.layouts import check_layout, join_shards, shard_positions, take_shard


def shard(x: torch.Tensor, dim: int, *, group: object = None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim` (a new tensor): what ring_attention
    takes from this rank. The length must cut into W (contiguous) or 2W (zigzag) equal chunks."""
    ring = ring_for(group)
    return take_shard(x, dim, ring.rank, ring.world, check_layout(layout))


def unshard(x: torch.Tensor, dim: int, *, group: object = None, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence along `dim` from every rank's shard `x` (a collective: every rank calls it
    with the same shape; not differentiable)."""
    ring = ring_for(group)
    with torch.no_grad():
        return join_shards(ring.all_gather(x.detach()), dim, check_layout(layout))


def positions(n_global: int, *, group: object = None, layout: str = "zigzag",
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64) of this rank's local rows, e.g. for rotary position ids."""
    ring = ring_for(group)
    return shard_positions(n_global, ring.rank, ring.world, check_layout(layout), device=device)
