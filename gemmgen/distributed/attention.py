"""ring_attention: context-parallel attention over the ranks of a ring, after checking its inputs."""
from __future__ import annotations

import torch

from gemmgen.distributed.blocks import BlockAttention, default_blocks, default_scale
from gemmgen.distributed.comm import LocalRing, ring_for
from gemmgen.distributed.function import RingAttention
from gemmgen.distributed.layouts import check_layout, check_local_length
from gemmgen.distributed.schedule import RingConfig
from gemmgen.errors import InputError
from gemmgen.ops.checks import check_4d, check_bool, check_finite


def _check_tensors(q: object, k: object, v: object) -> None:
    """Shapes, dtypes and devices that one shard of attention needs."""
    check_4d("batch, heads, local seqlen, head_dim", q=q, k=k, v=v)
    if not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    (b, h, n, d), (bk, hk, nk, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise InputError(f"k and v must have one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if bk != b or dk != d:
        raise InputError(f"batch and head_dim must be equal across q, k, v; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if hk == 0 or h % hk:
        raise InputError(f"k's and v's heads must divide q's {h} (GQA/MQA); got {hk}")
    if nk != n:
        raise InputError(f"q, k, v must be the same rows of the sequence (this rank's shard); got "
                         f"{n} query rows and {nk} key rows")


def _check_blocks(blocks: BlockAttention, q: torch.Tensor) -> None:
    if q.dtype not in blocks.dtypes:
        names = ", ".join(str(t) for t in blocks.dtypes)
        raise InputError(f"{type(blocks).__name__} runs {names}; got {q.dtype}"
                         + (" (gemmgen's kernels take fp16 or bf16 on the GPU)" if q.is_cuda else ""))


def _check_dropout(dropout_p: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise InputError(f"ring_attention does not support dropout (dropout_p={dropout_p!r}): the ranks would "
                         "have to draw the mask of each block from one global seed and offset, which the ring "
                         "does not do; use dropout_p=0.0")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: object = None,
                   causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                   return_lse: bool = False, dropout_p: float = 0.0,
                   blocks: BlockAttention | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, whose shards the ranks of `group` hold.

    q [B, H, N, d], k, v [B, Hkv, N, d] (Hkv dividing H): this rank's shard of the sequence, the
    rows `layout` gives it (gemmgen.distributed.shard cuts one; shard_positions names its global
    positions). Any strides the block primitive takes ([B, N, H, d] storage as x.transpose(1, 2)
    with gemmgen's kernels). Every rank calls with the same shapes and arguments. group: a
    torch.distributed ProcessGroup (None: the default group; NCCL for CUDA tensors, gloo for
    CPU ones) or a gemmgen.distributed.LocalRing endpoint. causal: each query sees the keys at
    or before its global position. scale defaults to 1/sqrt(d).

    Key/value blocks travel around the ring (rank r sends to r + 1), the next one in flight while
    the one in hand is attended to; partial results merge through their LSE in float32 (float64
    for float64 inputs). blocks: the block primitive (default: gemmgen's kernels for CUDA tensors,
    float64 torch otherwise).

    Returns O in q's dtype and layout, and with return_lse the global LSE of the local queries
    [B, H, N] (float32; float64 for float64 inputs; no gradient). Differentiable in q, k, v: the
    backward runs the ring again (every rank must take part). Dropout is not supported.
    """
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_layout(layout)
    _check_dropout(dropout_p)
    _check_tensors(q, k, v)
    scale = default_scale(q.shape[-1]) if scale is None else check_finite("scale", scale)
    ring = ring_for(group)
    check_local_length(q.shape[2], ring.world, layout)
    blocks = default_blocks(q.device) if blocks is None else blocks
    _check_blocks(blocks, q)
    ring.check_device(q.device)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if training and q.is_cuda and isinstance(ring, LocalRing):
        raise InputError("a LocalRing cannot train CUDA tensors through autograd: autograd runs every backward "
                         "of one GPU on a single worker thread, where the in-process ranks would wait on each "
                         "other; run it under torch.no_grad(), drive gemmgen.distributed.ring_backward from the "
                         "ranks' threads, or use one process per rank")
    config = RingConfig(ring=ring, blocks=blocks, layout=layout, causal=causal, scale=scale)
    out, lse = RingAttention.apply(q, k, v, config)
    return (out, lse) if return_lse else out
