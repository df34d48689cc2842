"""The ring schedule: W steps; at each, the block in hand is attended to while the next one is in
flight (sent to rank + 1, received from rank - 1).

    ring_forward    O and the global LSE of the local queries, merged block by block
    ring_backward   dQ accumulated locally; dK and dV partials travel around the ring with their
                    block and arrive, complete, at the rank that owns it

Both run on tensors that need no gradient and return accumulator-precision results (float32,
float64 for float64 inputs); gemmgen.distributed.function wraps them for autograd.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gemmgen.distributed.blocks import BlockAttention
from gemmgen.distributed.comm import Ring
from gemmgen.distributed.merge import accumulator_dtype, merge_partial
from gemmgen.distributed.visibility import Block, source_rank, visible_blocks

KV_TAG = 0   # the key/value blocks
DKV_TAG = 1  # their gradient partials, in flight at the same time in the backward


@dataclass(frozen=True)
class RingConfig:
    """What every step needs besides the tensors. scale: the float multiplying Q K^T."""
    ring: Ring
    blocks: BlockAttention
    layout: str
    causal: bool
    scale: float

    def blocks_at(self, step: int, n_local: int) -> tuple[Block, ...]:
        """The calls of this rank at `step`."""
        source = source_rank(self.ring.rank, step, self.ring.world)
        return visible_blocks(self.ring.rank, source, self.ring.world, n_local, self.layout, self.causal)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """The rows `rows` of dim 2 (the sequence) of a [B, H, N, ...] tensor, as a view."""
    return t[:, :, rows]


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one dense [2, B, Hkv, N, d] buffer: one transfer per step, whatever their strides."""
    return torch.stack((k, v))


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 config: RingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, H, N, d], LSE [B, H, N]) of this rank's queries over every rank's keys, in the
    accumulator dtype. q [B, H, N, d], k, v [B, Hkv, N, d]: this rank's shard; every rank of the
    ring calls this with the same shapes."""
    b, h, n, d = q.shape
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros((b, h, n, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    world = config.ring.world
    kv, packed = (k, v), None
    for step in range(world):
        transfer = None
        if step + 1 < world:  # start moving the block on before attending to it
            packed = _pack(k, v) if packed is None else packed
            transfer = config.ring.exchange(packed, KV_TAG)
        for blk in config.blocks_at(step, n):
            o_b, lse_b = config.blocks.forward(_rows(q, blk.q), _rows(kv[0], blk.k), _rows(kv[1], blk.k),
                                               blk.causal, config.scale)
            merge_partial(_rows(out, blk.q), _rows(lse, blk.q), o_b, lse_b)
        if transfer is not None:
            packed = transfer.wait()
            kv = (packed[0], packed[1])
    return out, lse


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor,
                  config: RingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of this rank's shard, in the accumulator dtype, given the forward's global
    `out` (in q's dtype) and `lse` of the local queries.

    At step s this rank holds the block of rank r - s, with the sum of the dK, dV partials of
    ranks r - s .. r - 1 arriving from rank r - 1; it adds its own and passes the sum on. After
    W steps (W transfers of partials, one more than of blocks) each block's sum is back at its
    owner."""
    b, h, n, d = q.shape
    acc = accumulator_dtype(q.dtype)
    world = config.ring.world
    dq = torch.zeros((b, h, n, d), dtype=acc, device=q.device)
    kv, packed = (k, v), None
    partial_transfer = None
    for step in range(world):
        kv_transfer = None
        if step + 1 < world:
            packed = _pack(k, v) if packed is None else packed
            kv_transfer = config.ring.exchange(packed, KV_TAG)
        mine = []
        for blk in config.blocks_at(step, n):
            dq_b, dk_b, dv_b = config.blocks.backward(
                _rows(grad_out, blk.q), _rows(q, blk.q), _rows(kv[0], blk.k), _rows(kv[1], blk.k),
                _rows(out, blk.q), _rows(lse, blk.q), blk.causal, config.scale)
            _rows(dq, blk.q).add_(dq_b)
            mine.append((blk.k, dk_b, dv_b))
        # The partials of the ranks before arrive while this rank computed its own.
        if partial_transfer is not None:
            dkv = partial_transfer.wait()
        else:
            dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        for rows, dk_b, dv_b in mine:
            _rows(dkv[0], rows).add_(dk_b)
            _rows(dkv[1], rows).add_(dv_b)
        partial_transfer = config.ring.exchange(dkv, DKV_TAG) if world > 1 else None
        if kv_transfer is not None:
            packed = kv_transfer.wait()
            kv = (packed[0], packed[1])
    if partial_transfer is not None:
        dkv = partial_transfer.wait()
    return dq, dkv[0], dkv[1]
