"""The one attention reference: float64 on the inputs' device. It lives with selection because the
tuner checks every candidate against it; gemmgen.ops.reference is its public home."""
from __future__ import annotations

import math

import torch

from gemmgen.kernels.launch import ALIGNMENTS, causal_offset  # noqa: F401 (the mask rule, with the reference)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        causal_alignment: str = "top_left",
                        scale: float | None = None, *,
                        bias: torch.Tensor | None = None,
                        window: tuple[int, int] | None = None,
                        softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * Q K^T + bias + mask) V in float64, and the natural-log LSE of each row.

    q: [B, H, Nq, d]; k, v: [B, Hkv, Nk, d] with Hkv dividing H (query head h reads kv head
    h // (H // Hkv)); bias: an additive mask broadcastable to [B, H, Nq, Nk] (any float dtype).
    window (left, right): key j visible to query i iff i + off - left <= j <= i + off + right, off the
    diagonal's offset of causal_alignment, a side of -1 unbounded (with causal, also j <= i + off).
    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) before the bias and masks.
    Returns (O [B, H, Nq, d] float64, LSE [B, H, Nq] float64). A row that sees no key gives O = 0
    and LSE = -inf, never NaN.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    group = q.shape[1] // k.shape[1]
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    scores = scale * (q64 @ k64.transpose(-2, -1))  # [B, H, Nq, Nk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:  # broadcastable to [B, H, Nq, Nk]; -inf entries remove a key
        scores = scores + bias.to(torch.float64)
    if causal or window is not None:
        nq, nk = q.shape[2], k.shape[2]
        offset = causal_offset(nq, nk, causal_alignment)
        rows = torch.arange(nq, device=q.device)[:, None]
        cols = torch.arange(nk, device=q.device)[None, :]
        hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
        if causal:
            hidden |= cols > rows + offset
        if window is not None:
            left, right = window
            if left >= 0:
                hidden |= cols < rows + offset - left
            if right >= 0:
                hidden |= cols > rows + offset + right
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees no key
    seen = torch.isfinite(lse)[..., None]
    probs = torch.where(seen, torch.exp(scores - torch.where(seen, lse[..., None], 0.0)), 0.0)
    return probs @ v64, lse
