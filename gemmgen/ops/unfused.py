"""The unfused attention baseline: S = scale * Q K^T (strided batched GEMM, fp32 out), a row
softmax kernel with the fused kernels' masks (P in the input dtype), O = P V. It materializes S
and P ([B, H, Nq, Nk] each), so it is memory-bound where the fused kernels are not: a baseline
to measure against, never chosen by fused_attention.
"""
from __future__ import annotations

import math

import torch

from gemmgen.kernels import abi
from gemmgen.select import device, selection, softmax_select
from gemmgen.ops import gemm
from gemmgen.errors import InputError
from gemmgen.kernels.launch import _raw_stream
from gemmgen.ops.reference import ALIGNMENTS, causal_offset


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """q [B, H, Nq, d] as [B, Hkv, groups * Nq, d]: the query heads sharing a key head stacked
    into one matrix (a view when q's heads are rows apart, else a copy)."""
    b, h, nq, d = q.shape
    if groups == 1:
        return q
    if q.stride(1) != nq * q.stride(2):
        q = q.contiguous()
    return q.view(b, h // groups, groups * nq, d) if q.is_contiguous() else \
        q.as_strided((b, h // groups, groups * nq, d), (q.stride(0), groups * q.stride(1), q.stride(2), 1))


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      causal_alignment: str = "top_left", scale: float | None = None) -> torch.Tensor:
    """O = softmax(scale * Q K^T + mask) V through three kernels (GEMM, softmax, GEMM).

    q [B, H, Nq, d], k and v [B, Hkv, Nk, d] (Hkv dividing H), fp16 or bf16, last dim contiguous.
    Masks as fused_attention: none, causal top_left (key j <= i) or bottom_right (j <= i + Nk - Nq);
    a row that sees no key gives 0. scale defaults to 1/sqrt(d). Returns a contiguous [B, H, Nq, d].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        gemm._check_tensor(name, t, 4)
    if q.dtype not in gemm.DTYPES or not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k, v must share one dtype among torch.float16, torch.bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, nq, d), (bk, hk, nk, dk) = q.shape, k.shape
    if tuple(v.shape) != tuple(k.shape) or bk != b or dk != d or hk == 0 or h % hk:
        raise InputError(f"k and v must be [B, Hkv, Nk, d] with q's B and d and Hkv dividing H; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if causal_alignment not in ALIGNMENTS:
        raise InputError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise InputError(f"scale must be a finite float or None, got {scale!r}")
    gemm._check_devices("q, k, v", (q, k, v))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    groups = h // hk
    out = torch.empty(b, h, nq, d, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if nk == 0:
        return out.zero_()
    s = torch.empty(b, h, nq, nk, dtype=torch.float32, device=q.device)
    p = torch.empty(b, h, nq, nk, dtype=q.dtype, device=q.device)
    # S = scale * Q K^T, with the query heads of one key head as one taller matrix.
    gemm.batched_gemm(_grouped(q, groups), k, b_transposed=True, alpha=scale,
                      out=s.view(b, hk, groups * nq, nk))
    args = abi.SoftmaxArgs(s.data_ptr(), p.data_ptr(), nq, nk, b * h, nq * nk, nk, nq * nk, nk, int(bool(causal)),
                           causal_offset(nq, nk, causal_alignment) if causal else 0)
    cand = selection.select(softmax_select.SoftmaxProblem(gemm.DTYPES[q.dtype], device.facts(q.get_device())))
    with torch.cuda.device(q.device):
        abi.bind_softmax(cand.library, cand.entry.symbol).run(args, _raw_stream(q.get_device()))
    gemm.batched_gemm(p.view(b, hk, groups * nq, nk), v, out=out.view(b, hk, groups * nq, d))
    return out
