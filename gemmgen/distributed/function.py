"""The autograd Function of ring attention: the forward runs the ring and saves the global O and
LSE; the backward runs the ring again from them (gemmgen.distributed.schedule)."""
from __future__ import annotations

import torch

from gemmgen.distributed.schedule import RingConfig, ring_backward, ring_forward
from gemmgen.kernels.launch import empty_like_layout


def _like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in t's dtype and dim order (a [B, N, H, d]-storage view gets one back)."""
    return empty_like_layout(t).copy_(value)


class RingAttention(torch.autograd.Function):
    """apply(q, k, v, config) -> (O in q's dtype and layout, LSE in the accumulator dtype, without
    a gradient). Every rank of the ring must call backward through O (or none), since the
    backward exchanges blocks like the forward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: RingConfig):
        out_acc, lse = ring_forward(q, k, v, config)
        out = _like(q, out_acc)
        del out_acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        # The block backward reads dO like O; a broadcast gradient (e.g. of a sum) is made dense once.
        if grad_out.stride() != out.stride():
            grad_out = _like(out, grad_out)
        dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, ctx.config)
        return _like(q, dq), _like(k, dk), _like(v, dv), None
