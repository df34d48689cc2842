"""The selection problem of an attention call on tensors (forward, variable-length, backward): what
the torch ops and the tuner hand gemmgen.select.selection."""
from __future__ import annotations

import dataclasses

import torch

from gemmgen.kernels.launch import PROBLEM_DTYPES, max_offset
from gemmgen.select import device
from gemmgen.select.problem import ALIGN_BYTES, BwdProblem, Problem, layout_kind


def problem_for(q: torch.Tensor, k: torch.Tensor, causal: bool, *, v: torch.Tensor | None = None,
                causal_alignment: str = "top_left", scale: float | None = None, dropout: bool = False,
                bias: bool | torch.Tensor | None = False, varlen: bool = False,
                window: tuple[int, int] | None = None, softcap: bool = False) -> Problem:
    """The Problem of a validated call (q, k on one CUDA device). `bias` may be the bias tensor itself
    (its extent then counts in max_offset); `window` a normalized sliding window (ops.attention);
    `softcap` whether a logit softcap applies."""
    b, h, nq, d = q.shape
    bias_tensor = bias if isinstance(bias, torch.Tensor) else None
    return Problem(dtype=PROBLEM_DTYPES[q.dtype], head_dim=d, causal=bool(causal),
                   device=device.facts(q.get_device()), batch_heads=b * h, seqlen_q=nq,
                   seqlen_k=k.shape[2], gqa=h // k.shape[1],
                   layout=layout_kind(q.stride(), k.stride()), align=ALIGN_BYTES,
                   causal_alignment=causal_alignment, negative_scale=scale is not None and scale < 0,
                   zero_scale=scale == 0,
                   dropout=dropout, bias=bias is not None and bias is not False, varlen=varlen,
                   max_offset=max_offset(q, k, v, bias_tensor), window=window, softcap=bool(softcap))


def problem_for_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, max_seqlen_q: int,
                       max_seqlen_k: int, causal: bool, *, causal_alignment: str = "top_left",
                       scale: float | None = None, dropout: bool = False, window: tuple[int, int] | None = None,
                       softcap: bool = False, short_keys: bool = True) -> Problem:
    """The Problem of a validated variable-length call: packed q [Tq, H, d], k, v [Tk, Hkv, d]; the
    mask (causal or a normalized `window`) aligned within each sequence by `causal_alignment`;
    short_keys as Problem.short_keys (gemmgen.ops.offsets.short_keys)."""
    h, d = q.shape[1], q.shape[2]
    return Problem(dtype=PROBLEM_DTYPES[q.dtype], head_dim=d, causal=bool(causal),
                   device=device.facts(q.get_device()), batch_heads=batch * h, seqlen_q=max_seqlen_q,
                   seqlen_k=max_seqlen_k, gqa=h // k.shape[1], layout="bnhd", align=ALIGN_BYTES,
                   causal_alignment=causal_alignment, negative_scale=scale is not None and scale < 0,
                   zero_scale=scale == 0, dropout=dropout, varlen=True, short_keys=short_keys,
                   max_offset=max_offset(q, k, v), window=window, softcap=bool(softcap))


def problem_for_bwd(q: torch.Tensor, k: torch.Tensor, causal: bool, *, causal_alignment: str = "top_left",
                    scale: float | None = None, dropout: bool = False, bias: torch.Tensor | None = None,
                    bias_grad: bool = False, deterministic: bool = False,
                    tensors: tuple[torch.Tensor | None, ...] = (),
                    window: tuple[int, int] | None = None, softcap: bool = False) -> BwdProblem:
    """The BwdProblem of a backward call on validated tensors: q and k as the kernel reads them (K
    with as many heads as Q), `tensors` the others whose extent counts in max_offset."""
    fwd = problem_for(q, k, causal, causal_alignment=causal_alignment, scale=scale, dropout=dropout, bias=bias,
                      window=window, softcap=softcap)
    return _backward_of(fwd, tensors, bias_grad=bias_grad, deterministic=deterministic)


def problem_for_bwd_varlen(q: torch.Tensor, k: torch.Tensor, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool, *, causal_alignment: str = "top_left", scale: float | None = None,
                           dropout: bool = False, tensors: tuple[torch.Tensor | None, ...] = (),
                           window: tuple[int, int] | None = None, softcap: bool = False,
                           deterministic: bool = False) -> BwdProblem:
    """The BwdProblem of a variable-length backward call: packed q [Tq, H, d] and k [Tk, H, d] as the
    selection sees them (K with Q's heads), the forward's mask and alignment, `tensors` the others
    whose extent counts in max_offset. Its `varlen` flag keeps out the families that cannot run it
    (their reasons say so)."""
    fwd = problem_for_varlen(q, k, k, batch, max_seqlen_q, max_seqlen_k, causal, causal_alignment=causal_alignment,
                             scale=scale, dropout=dropout, window=window, softcap=softcap)
    return _backward_of(fwd, tensors, deterministic=deterministic)


def _backward_of(fwd: Problem, tensors: tuple[torch.Tensor | None, ...], *, bias_grad: bool = False,
                 deterministic: bool = False) -> BwdProblem:
    """The forward problem as a backward one, max_offset covering `tensors` too."""
    fields = {f.name: getattr(fwd, f.name) for f in dataclasses.fields(Problem)}
    fields["max_offset"] = max(fwd.max_offset, max_offset(*tensors))
    return BwdProblem(**fields, bias_grad=bias_grad, deterministic=deterministic)


def problem_for_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, capacity: int, causal: bool,
                        *, scale: float | None = None, window: tuple[int, int] | None = None,
                        paged: bool = False) -> Problem:
    """The Problem of a validated key-value-cache call: q [B, Nq, H, d], caches [B or pages, rows, Hkv, d]
    (paged: read through a block table) holding up to `capacity` keys per sequence (the sizes the
    selection sees: lengths live on the GPU)."""
    b, nq, h, d = q.shape
    return Problem(dtype=PROBLEM_DTYPES[q.dtype], head_dim=d, causal=bool(causal),
                   device=device.facts(q.get_device()), batch_heads=b * h, seqlen_q=nq, seqlen_k=capacity,
                   gqa=h // k_cache.shape[2], layout="bnhd", align=ALIGN_BYTES, causal_alignment="bottom_right",
                   negative_scale=scale is not None and scale < 0, zero_scale=scale == 0, kv_cache=True,
                   max_offset=max_offset(q, k_cache, v_cache), window=window, paged=paged)
