"""The block primitive of the ring: attention of some query rows against one key/value block,
forward with its LSE and backward from a given (global) O and LSE.

    BlockAttention      the protocol
    GemmgenBlocks       gemmgen's CUDA kernels: gemmgen.fused_attention and
                        torch.ops.gemmgen.fused_attention_backward
    ReferenceBlocks     float64 torch on any device (CPU tests, references)
    default_blocks      GemmgenBlocks for CUDA tensors, ReferenceBlocks otherwise
"""
from __future__ import annotations

import importlib
import math
from typing import Protocol

import torch

from gemmgen.ops.reference import attention_reference

ALIGNMENT = "top_left"  # a causal block is always square here, where the alignments agree


class BlockAttention(Protocol):
    """Attention of one block. q [B, H, Nq, d]; k, v [B, Hkv, Nk, d] with Hkv dividing H (GQA:
    query head h reads key/value head h // (H // Hkv)); causal: top-left (key j visible to query
    i when j <= i); scale: the float multiplying Q K^T. `dtypes`: the input dtypes it runs."""
    dtypes: tuple[torch.dtype, ...]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(O [B, H, Nq, d], LSE [B, H, Nq] natural log, float32 or float64); a row that sees
        no key gives O = 0 and LSE = -inf."""
        ...

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dQ, dK, dV) of this block, with P = exp(scale * Q K^T - lse) and D = rowsum(dO * out):
        given the O and LSE of the queries over ALL keys, P is the true probability of these keys
        and the result is this block's exact share of the gradients. dK, dV have Hkv heads
        (summed over each group)."""
        ...


class GemmgenBlocks:
    """gemmgen's kernels (CUDA, fp16 and bf16): the forward through gemmgen.fused_attention, the
    backward through the torch op gemmgen::fused_attention_backward."""
    dtypes = (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale):
        from gemmgen.ops.attention import fused_attention  # the CUDA ops load on first use

        with torch.no_grad():
            return fused_attention(q, k, v, causal=causal, scale=scale, return_lse=True)

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        importlib.import_module("gemmgen.ops.torch_op")  # registers torch.ops.gemmgen on first use
        with torch.no_grad():
            # No dropout (p 0, seed 0, offset 0), no bias and no bias gradient, not deterministic.
            dq, dk, dv, _ = torch.ops.gemmgen.fused_attention_backward(
                grad_out, q, k, v, out, lse, causal, ALIGNMENT, scale, 0.0, 0, 0, None, False, False)
        return dq, dk, dv


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    """K or V in float64 with Q's heads (GQA)."""
    return t.to(torch.float64).repeat_interleave(group, dim=1)


def _sum_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """Per-query-head gradients summed over the query heads of each key/value head."""
    return t if group == 1 else t.unflatten(1, (t.shape[1] // group, group)).sum(2)


class ReferenceBlocks:
    """float64 torch, on the inputs' device: the forward is gemmgen.ops.reference's, the backward
    the textbook formulas (dV = P^T dO, dS = P * (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def forward(self, q, k, v, causal, scale):
        with torch.no_grad():
            return attention_reference(q, k, v, causal, ALIGNMENT, scale)

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        with torch.no_grad():
            group = q.shape[1] // k.shape[1]
            q64, do64, o64 = (t.to(torch.float64) for t in (q, grad_out, out))
            k64, v64 = _expand(k, group), _expand(v, group)
            scores = scale * (q64 @ k64.transpose(-2, -1))
            if causal:
                nq, nk = scores.shape[-2:]
                hidden = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            lse64 = lse.to(torch.float64).unsqueeze(-1)
            seen = torch.isfinite(lse64)
            probs = torch.where(seen, torch.exp(scores - torch.where(seen, lse64, 0.0)), 0.0)
            dv = probs.transpose(-2, -1) @ do64
            delta = (do64 * o64).sum(-1, keepdim=True)
            ds = probs * (do64 @ v64.transpose(-2, -1) - delta)
            dq = scale * (ds @ k64)
            dk = scale * (ds.transpose(-2, -1) @ q64)
            return dq, _sum_groups(dk, group), _sum_groups(dv, group)


def default_blocks(device: torch.device) -> BlockAttention:
    """gemmgen's kernels for CUDA tensors, the float64 reference elsewhere."""
    return GemmgenBlocks() if device.type == "cuda" else ReferenceBlocks()


def default_scale(head_dim: int) -> float:
    """1 / sqrt(d), as gemmgen.fused_attention's."""
    return 1.0 / math.sqrt(head_dim)
