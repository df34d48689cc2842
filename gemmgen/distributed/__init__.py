"""Context-parallel attention: the sequence is sharded over the ranks of a torch.distributed group
and each rank attends its queries to every rank's keys, the key/value blocks travelling around a
ring (docs/context_parallel.md).

    import gemmgen.distributed as cp
    q, k, v = (cp.shard(t, 2, layout="zigzag") for t in (q_full, k_full, v_full))   # [B, H, N, d]
    o = cp.ring_attention(q, k, v, causal=True, layout="zigzag")                    # differentiable
    o_full = cp.unshard(o, 2, layout="zigzag")

    ring_attention        the attention (autograd Function over the ring schedule)
    shard, unshard        cut a full sequence into this rank's shard, gather the shards back
    positions             the global positions of this rank's rows (shard_positions: any rank)
    take_shard, join_shards   the same cuts without a group
    ring_forward, ring_backward, RingConfig   the schedule itself, without autograd
    merge_partial         the LSE merge rule of partial results
    visible_blocks        which queries see which keys of a block, per layout and step
    BlockAttention, GemmgenBlocks, ReferenceBlocks   the block primitive and its two implementations
    Ring, ProcessGroupRing, LocalRing   where blocks travel: a process group, or in-process threads
"""
from __future__ import annotations

from gemmgen.distributed.attention import ring_attention
from gemmgen.distributed.blocks import BlockAttention, GemmgenBlocks, ReferenceBlocks, default_blocks
from gemmgen.distributed.comm import LocalRing, ProcessGroupRing, Ring, ring_for
from gemmgen.distributed.layouts import LAYOUTS, join_shards, shard_positions, take_shard
from gemmgen.distributed.merge import merge_partial
from gemmgen.distributed.schedule import RingConfig, ring_backward, ring_forward
from gemmgen.distributed.sharding import positions, shard, unshard
from gemmgen.distributed.visibility import Block, source_rank, visible_blocks

__all__ = ["ring_attention", "shard", "unshard", "positions", "shard_positions", "take_shard", "join_shards",
           "LAYOUTS", "merge_partial", "ring_forward", "ring_backward", "RingConfig", "visible_blocks", "Block",
           "source_rank", "BlockAttention", "GemmgenBlocks", "ReferenceBlocks", "default_blocks", "Ring",
           "ProcessGroupRing", "LocalRing", "ring_for"]
