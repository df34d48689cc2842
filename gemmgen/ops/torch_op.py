"""The torch custom ops behind gemmgen.fused_attention, with fake implementations, so that
torch.compile traces them without a graph break and CUDA graphs capture them:

    torch.ops.gemmgen.fused_attention(q, k, v, causal, causal_alignment, scale, return_lse, instance,
                                      dropout_p, seed, offset, bias)
        -> (O in q's layout, LSE [B, H, Nq] float32, or an empty tensor without return_lse)
    torch.ops.gemmgen.fused_attention_out(q, k, v, out, causal, causal_alignment, scale, return_lse,
                                          instance, dropout_p, seed, offset, bias) -> LSE (O written into `out`)
    torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal, scale, return_lse, instance,
                                             dropout_p, seed, offset)
        -> (O [Tq, H, d], LSE [B, H, max_seqlen_q] float32 or an empty tensor)

bias is the additive mask as [B, H, Nq, Nk] by its strides (gemmgen.ops.attention broadcasts and pads it).
A seed of None draws one from torch's CUDA generator when the op runs (not when it is traced).

The CUDA kernels expect inputs that gemmgen.ops.attention validated. The hot path is one dictionary lookup
per call: the kernel chosen for a (device, dtype, sizes, layout, mask, instance) key is cached;
the first call of a key selects (gemmgen.select.selection), tunes the bucket first under
GEMMGEN_AUTOTUNE=1, and compiles a missing instance on demand (gemmgen.select.jit).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

from gemmgen.select import jit, registry, selection
from gemmgen.kernels import launch
from gemmgen.errors import InputError
from gemmgen.ops.grad import check_no_grad
from gemmgen.select.problem import ALIGN_BYTES, Problem

_LIB = torch.library.Library("gemmgen", "DEF")
_ARGS = "bool causal=False, str causal_alignment='top_left', float? scale=None, bool return_lse=False, str? instance=None"
_FEATURES = "float dropout_p=0.0, int? seed=None, int offset=0"
_LIB.define(f"fused_attention(Tensor q, Tensor k, Tensor v, {_ARGS}, {_FEATURES}, Tensor? bias=None) "
            f"-> (Tensor, Tensor)")
_LIB.define(f"fused_attention_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_ARGS}, {_FEATURES}, "
            f"Tensor? bias=None) -> Tensor")
_LIB.define("fused_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
            "int max_seqlen_q, int max_seqlen_k, bool causal=False, float? scale=None, bool return_lse=False, "
            f"str? instance=None, {_FEATURES}) -> (Tensor, Tensor)")

# No autograd kernel is registered: gemmgen has no backward pass, and each implementation refuses
# inputs that require grad while grad mode is on (check_no_grad), which torch leaves on when it
# passes an op without one through to the implementation. (An autograd kernel would put a Python
# layer in front of every call.)
_kernels: dict[tuple, Any] = {}
_MAX_CACHED = 4096


def autotune_enabled() -> bool:
    """GEMMGEN_AUTOTUNE=1: tune a bucket the first time a call falls in it."""
    return os.environ.get("GEMMGEN_AUTOTUNE", "0") not in ("", "0")


def _select(problem: Problem, q: torch.Tensor, k: torch.Tensor, causal: bool,
            instance: str | None) -> tuple[Any, bool]:
    """The kernel for this call and whether the choice may be cached."""
    cand = jit.select_or_build(problem, instance)
    cacheable = True
    # The tuner times plain calls: dropout, bias and variable lengths keep the registry's choice.
    plain = not (problem.dropout or problem.bias or problem.varlen)
    if instance is None and plain and autotune_enabled() and selection.needs_tuning(problem):
        if torch.cuda.is_current_stream_capturing():  # timing synchronizes: tune after the capture
            cacheable = False
        else:
            from gemmgen.select import tuner

            print(f"gemmgen: autotuning bucket {problem.bucket.key} of {problem.describe()}",
                  file=sys.stderr, flush=True)
            tuner.tune_call(q, k, causal)
            cand = selection.select(problem)
    return cand.kernel, cacheable


def _kernel_for(key: tuple, problem_of: Callable[[], Problem], q: torch.Tensor, k: torch.Tensor, causal: bool,
                instance: str | None) -> Any:
    kernel = _kernels.get(key)
    if kernel is None:
        kernel, cacheable = _select(problem_of(), q, k, causal, instance)
        if cacheable:
            if len(_kernels) >= _MAX_CACHED:
                _kernels.clear()
            _kernels[key] = kernel
    return kernel


def _dropout_seed(index: int, dropout_p: float, seed: int | None, offset: int, draws: int) -> tuple[int, int]:
    """The (seed, offset) pair of the launch: the caller's, or one drawn from torch's generator."""
    if dropout_p <= 0.0:
        return 0, 0
    if seed is None:
        seed, base = launch.draw_seed(index, draws)
        return seed, base + offset
    return seed, offset


def _nothing_to_launch(q, k, v, o, lse, empty: bool) -> bool:
    """True (with O zeroed and LSE -inf: no row sees a key) when `empty`; else checks the data
    pointers' alignment and returns False."""
    if empty:
        o.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return True
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) % ALIGN_BYTES:
        raise InputError(f"q, k, v and out must be {ALIGN_BYTES}-byte aligned")
    return False


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
         causal: bool, causal_alignment: str, scale: float | None, instance: str | None,
         dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, bias: torch.Tensor | None = None) -> None:
    if _nothing_to_launch(q, k, v, o, lse, o.numel() == 0 or k.shape[2] == 0):
        return
    if bias is not None and bias.data_ptr() % ALIGN_BYTES:
        raise InputError(f"the attention mask must be {ALIGN_BYTES}-byte aligned")
    index = q.get_device()
    qs, ks = q.stride(), k.stride()
    # Everything a family's problem_reason may look at: shapes, layout kind, mask and its alignment,
    # the scale's sign, offsets past int32, dropout, a bias.
    big = launch.max_offset(q, k, v, o, bias) >= 2**31
    key = (index, q.dtype, q.shape, k.shape, qs[2] <= qs[1], ks[2] <= ks[1], causal,
           causal_alignment if causal else None, _sign(scale), big, instance,
           dropout_p > 0.0, bias is not None, False)
    kernel = _kernel_for(key, lambda: launch.problem_for(
        q, k, causal, v=v, causal_alignment=causal_alignment, scale=scale, dropout=dropout_p > 0.0,
        bias=bias), q, k, causal, instance)
    seed, offset = _dropout_seed(index, dropout_p, seed, offset, q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
    launch.launch(kernel, launch.params(q, k, v, o, lse, causal=causal, causal_alignment=causal_alignment,
                                        scale=scale, dropout_p=dropout_p, seed=seed, offset=offset, bias=bias),
                  index)


def _sign(scale: float | None) -> int | None:
    """The scale as families see it: None (default), or its sign (-1, 0, 1)."""
    return None if scale is None else (scale > 0) - (scale < 0)


def _run_varlen(q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, instance, dropout_p, seed,
                offset) -> None:
    batch = cu_q.shape[0] - 1
    if _nothing_to_launch(q, k, v, o, lse, o.numel() == 0 or max_k == 0 or max_q == 0):
        return
    index = q.get_device()
    big = launch.max_offset(q, k, v, o) >= 2**31
    key = (index, q.dtype, q.shape, k.shape, batch, max_q, max_k, causal, _sign(scale),
           big, instance, dropout_p > 0.0, False, True)
    kernel = _kernel_for(key, lambda: launch.problem_for_varlen(
        q, k, v, batch, max_q, max_k, causal, scale=scale, dropout=dropout_p > 0.0), q, k, causal, instance)
    seed, offset = _dropout_seed(index, dropout_p, seed, offset, batch * q.shape[1] * max_q * max_k)
    launch.launch(kernel, launch.params_varlen(q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                               scale=scale, dropout_p=dropout_p, seed=seed, offset=offset),
                  index)


def _lse_like(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    shape = tuple(q.shape[:3]) if return_lse else (0,)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


_no_lse: dict[torch.device, torch.Tensor] = {}


def _no_lse_on(device: torch.device) -> torch.Tensor:
    """The empty LSE returned without return_lse: one per device (it has no elements to share)."""
    t = _no_lse.get(device)
    if t is None:
        t = _no_lse[device] = torch.empty((0,), dtype=torch.float32, device=device)
    return t


def _fused_attention(q, k, v, causal=False, causal_alignment="top_left", scale=None, return_lse=False,
                     instance=None, dropout_p=0.0, seed=None, offset=0, bias=None):
    check_no_grad("torch.ops.gemmgen.fused_attention", q=q, k=k, v=v, bias=bias)
    o = launch.empty_like_layout(q)
    features = (dropout_p, seed, offset, bias)
    if not return_lse:
        _run(q, k, v, o, None, causal, causal_alignment, scale, instance, *features)
        return o, _no_lse_on(q.device)
    lse = _lse_like(q, True)
    _run(q, k, v, o, lse, causal, causal_alignment, scale, instance, *features)
    return o, lse


def _fused_attention_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None,
                         return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0, bias=None):
    check_no_grad("torch.ops.gemmgen.fused_attention_out", q=q, k=k, v=v, bias=bias)
    lse = _lse_like(q, return_lse)
    _run(q, k, v, out, lse if return_lse else None, causal, causal_alignment, scale, instance, dropout_p, seed,
         offset, bias)
    return lse


def _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse):
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    shape = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q) if return_lse else (0,)
    return o, torch.empty(shape, dtype=torch.float32, device=q.device)


def _fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                            scale=None, return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0):
    check_no_grad("torch.ops.gemmgen.fused_attention_varlen", q=q, k=k, v=v)
    o, lse = _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse)
    # The kernel reads the offsets from data_ptr() as an int32 array: a strided view is copied.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    _run_varlen(q, k, v, o, lse if return_lse else None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal, scale, instance, dropout_p, seed, offset)
    return o, lse


def _fake(q, k, v, causal=False, causal_alignment="top_left", scale=None, return_lse=False, instance=None,
          dropout_p=0.0, seed=None, offset=0, bias=None):
    return launch.empty_like_layout(q), _lse_like(q, return_lse)


def _fake_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None, return_lse=False,
              instance=None, dropout_p=0.0, seed=None, offset=0, bias=None):
    return _lse_like(q, return_lse)


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                 return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0):
    return _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse)


_LIB.impl("fused_attention", _fused_attention, "CUDA")
_LIB.impl("fused_attention_out", _fused_attention_out, "CUDA")
_LIB.impl("fused_attention_varlen", _fused_attention_varlen, "CUDA")
torch.library.register_fake("gemmgen::fused_attention", _fake, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_out", _fake_out, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_varlen", _fake_varlen, lib=_LIB)




fused_attention_op = torch.ops.gemmgen.fused_attention.default
fused_attention_out_op = torch.ops.gemmgen.fused_attention_out.default
fused_attention_varlen_op = torch.ops.gemmgen.fused_attention_varlen.default


def clear_cache() -> None:
    """Forget the kernels chosen per call key (the registry's refresh() calls this)."""
    _kernels.clear()


registry.on_refresh(clear_cache)
