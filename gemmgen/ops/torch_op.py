"""The torch custom ops behind gemmgen.fused_attention, with fake implementations, so that
torch.compile traces them without a graph break and CUDA graphs capture them:

    torch.ops.gemmgen.fused_attention(q, k, v, causal, causal_alignment, scale, return_lse, instance,
                                      dropout_p, seed, offset, bias, deterministic, window, softcap)
        -> (O in q's layout, LSE [B, H, Nq] float32, or an empty tensor without return_lse)
    torch.ops.gemmgen.fused_attention_backward(grad_out, q, k, v, out, lse, causal, causal_alignment,
                                               scale, dropout_p, seed, offset, bias, bias_grad,
                                               deterministic, window, softcap)
        -> (dQ like q, dK like k, dV like v, dBias [B, H, Nq, Nk], or an empty tensor without bias_grad)
    torch.ops.gemmgen.fused_attention_out(q, k, v, out, causal, causal_alignment, scale, return_lse,
                                          instance, dropout_p, seed, offset, bias, window, softcap)
        -> LSE (O written into `out`)
    torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, causal, scale, return_lse, instance,
                                             dropout_p, seed, offset, causal_alignment, window, softcap,
                                             deterministic)
        -> (O [Tq, H, d], LSE [B, H, max_seqlen_q] float32 or an empty tensor)
    torch.ops.gemmgen.fused_attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                      max_seqlen_q, max_seqlen_k, causal, scale, dropout_p,
                                                      seed, offset, causal_alignment, window, softcap,
                                                      deterministic)
        -> (dQ like q, dK like k, dV like v), all packed [T, heads, d]
    torch.ops.gemmgen.fused_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                                                   causal, scale, return_lse, instance, window)
        -> (O [B, Nq, H, d], LSE [B, H, Nq] float32 or an empty tensor); k, v appended into the caches
    torch.ops.gemmgen.fused_attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal,
                                          causal_alignment, scale, return_lse, instance)
        -> (O in bfloat16 in q's layout, LSE or an empty tensor); q, k, v float8_e4m3fn, each
           descale None or float32 [B, Hkv] contiguous (gemmgen.ops.fp8 prepares them); no backward

fused_attention and fused_attention_backward are joined by torch.library.register_autograd, and so
are fused_attention_varlen and fused_attention_varlen_backward (plain eager training calls of
gemmgen.fused_attention and gemmgen.fused_attention_varlen run the same pieces in a
torch.autograd.Function, _eager_training): a forward whose inputs require grad saves q, k, v, O,
LSE and the mask (varlen: the cu_seqlens), and the backward op computes the gradients from them
(LSE is saved, not recomputed; it is returned without a gradient of its own). Such a forward needs
return_lse=True (the gemmgen functions pass it) and, with dropout, an explicit seed (the gemmgen
functions draw one), and it checks at once that a backward instance can run the call.
fused_attention_out has no backward: it refuses inputs that require grad (check_no_grad). Double
backward raises.

bias is the additive mask as [B, H, Nq, Nk] by its strides (gemmgen.ops.attention broadcasts and pads it).
window is a sliding window [left, right] around the diagonal of causal_alignment (causal False; a
side of -1 unbounded; gemmgen.ops.attention normalizes it), or None. softcap > 0 is a logit
softcap (scaled scores s become softcap * tanh(s / softcap)), 0 none.
A seed of None draws one from torch's CUDA generator when the op runs (not when it is traced).

The CUDA kernels expect inputs that gemmgen.ops.attention validated. The hot path is one dictionary lookup
per call: the kernel chosen for a (device, dtype, sizes, layout, mask, instance) key is cached;
the first call of a key selects (gemmgen.select.selection), tunes the bucket first under
GEMMGEN_AUTOTUNE=1, and compiles a missing instance on demand (gemmgen.select.jit).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gemmgen.select import calls, jit, registry, selection
from gemmgen.kernels import launch
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.ops import fp8, offsets, padding
from gemmgen.ops.checks import check_softcap, check_window
from gemmgen.ops.grad import check_no_grad
from gemmgen.select.problem import ALIGN_BYTES, Problem

_LIB = torch.library.Library("gemmgen", "DEF")
_ARGS = "bool causal=False, str causal_alignment='top_left', float? scale=None, bool return_lse=False, str? instance=None"
_FEATURES = "float dropout_p=0.0, int? seed=None, int offset=0"
_LIB.define(f"fused_attention(Tensor q, Tensor k, Tensor v, {_ARGS}, {_FEATURES}, Tensor? bias=None, "
            f"bool deterministic=False, int[]? window=None, float softcap=0.0) -> (Tensor, Tensor)")
_LIB.define("fused_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "bool causal, str causal_alignment, float? scale, float dropout_p, int seed, int offset, "
            "Tensor? bias, bool bias_grad, bool deterministic, int[]? window=None, float softcap=0.0) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(f"fused_attention_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_ARGS}, {_FEATURES}, "
            f"Tensor? bias=None, int[]? window=None, float softcap=0.0) -> Tensor")
_LIB.define("fused_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
            "int max_seqlen_q, int max_seqlen_k, bool causal=False, float? scale=None, bool return_lse=False, "
            f"str? instance=None, {_FEATURES}, str causal_alignment='top_left', int[]? window=None, "
            "float softcap=0.0, bool deterministic=False) -> (Tensor, Tensor)")
_LIB.define("fused_attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
            "float? scale, float dropout_p, int seed, int offset, str causal_alignment='top_left', "
            "int[]? window=None, float softcap=0.0, bool deterministic=False) -> (Tensor, Tensor, Tensor)")

_LIB.define("fused_attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
            "Tensor? block_table=None, Tensor? k=None, Tensor? v=None, bool causal=True, float? scale=None, "
            "bool return_lse=False, str? instance=None, int[]? window=None) -> (Tensor, Tensor)")

_LIB.define("fused_attention_fp8(Tensor q, Tensor k, Tensor v, Tensor? q_descale=None, Tensor? k_descale=None, "
            f"Tensor? v_descale=None, {_ARGS}) -> (Tensor, Tensor)")

_kernels: dict[tuple, Any] = {}
_MAX_CACHED = 4096


def autotune_enabled() -> bool:
    """GEMMGEN_AUTOTUNE=1: tune a bucket the first time a call falls in it."""
    return os.environ.get("GEMMGEN_AUTOTUNE", "0") not in ("", "0")


class _Plan:
    """What a call key launches: the kernel, its num_splits (None for a backward) and, built at the
    first launch, the C ABI params of the key with every field but the per-call ones (data
    pointers, dropout seed and offset) set, and the workspace they need. A call key holds
    everything those fields depend on."""

    __slots__ = ("kernel", "splits", "proto", "workspace")

    def __init__(self, kernel: Any, splits: int) -> None:
        self.kernel, self.splits, self.proto, self.workspace = kernel, splits, None, 0

    def params(self, build: Callable[[], Any]) -> Any:
        """A fresh copy of the key's params (build() makes them at the first call; a backward plan,
        splits None, has no num_splits)."""
        if self.proto is None:
            p = build()
            if self.splits is not None:
                p.num_splits = self.splits
            self.workspace = self.kernel.workspace_bytes(p)
            self.proto = p
        return type(self.proto).from_buffer_copy(self.proto)


def _select(problem: Problem, q: torch.Tensor, k: torch.Tensor, causal: bool,
            instance: str | None) -> tuple[_Plan, bool]:
    """The plan (kernel, num_splits) of this call, and whether it may be cached."""
    cand = jit.select_or_build(problem, instance)
    cacheable = True
    # The tuner times plain 16-bit calls: dropout, bias, variable lengths, windows and fp8 keep the
    # registry's choice.
    plain = not (problem.dropout or problem.bias or problem.varlen or problem.kv_cache or problem.window is not None
                 or problem.dtype == "fp8")
    if instance is None and plain and autotune_enabled() and selection.needs_tuning(problem):
        if torch.cuda.is_current_stream_capturing():  # timing synchronizes: tune after the capture
            cacheable = False
        else:
            from gemmgen.select import tuner

            print(f"gemmgen: autotuning bucket {problem.bucket.key} of {problem.describe()}",
                  file=sys.stderr, flush=True)
            tuner.tune_call(q, k, causal)
            cand = selection.select(problem)
    return _Plan(cand.kernel, selection.splits(cand, problem)), cacheable


def _kernel_for(key: tuple, problem_of: Callable[[], Problem], q: torch.Tensor, k: torch.Tensor, causal: bool,
                instance: str | None) -> _Plan:
    """The plan of a call, cached under `key` (everything the selection and the params look at
    but the data pointers)."""
    plan = _kernels.get(key)
    if plan is None:
        plan, cacheable = _select(problem_of(), q, k, causal, instance)
        if cacheable:
            if len(_kernels) >= _MAX_CACHED:
                _kernels.clear()
            _kernels[key] = plan
    return plan


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


def _mask_args(causal: bool, window) -> tuple[bool, tuple[int, int] | None]:
    """The ops' causal and window arguments (a window is a list through the dispatcher) normalized as
    gemmgen.fused_attention normalizes them (gemmgen.ops.checks.check_window), so that an op called
    directly runs the same mask; the window as the tuple problems and params take."""
    return check_window(None if window is None else tuple(window), causal)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
         causal: bool, causal_alignment: str, scale: float | None, instance: str | None,
         dropout_p: float = 0.0, seed: int | None = None, offset: int = 0, bias: torch.Tensor | None = None,
         window=None, softcap: float = 0.0) -> None:
    if _nothing_to_launch(q, k, v, o, lse, o.numel() == 0 or k.shape[2] == 0):
        return
    if bias is not None and bias.data_ptr() % ALIGN_BYTES:
        raise InputError(f"the attention mask must be {ALIGN_BYTES}-byte aligned")
    index = q.get_device()
    causal, window = _mask_args(causal, window)
    if softcap:  # an op called directly gets fused_attention's check
        softcap = check_softcap(softcap)
    # Everything a family's problem_reason and the params look at but the data pointers: shapes and
    # strides (layout kind, offsets past int32), mask and its alignment, scale, dropout, a bias, a softcap.
    key = (index, q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(), causal,
           causal_alignment if causal or window else None, scale, instance, dropout_p,
           None if bias is None else bias.stride(), False, window, softcap)
    plan = _kernel_for(key, lambda: calls.problem_for(
        q, k, causal, v=v, causal_alignment=causal_alignment, scale=scale, dropout=dropout_p > 0.0,
        bias=bias, window=window, softcap=softcap > 0), q, k, causal, instance)
    p = plan.params(lambda: launch.params(q, k, v, o, None, causal=causal, causal_alignment=causal_alignment,
                                          scale=scale, dropout_p=dropout_p, bias=bias, window=window,
                                          softcap=softcap))
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    if bias is not None:
        p.bias = bias.data_ptr()
    if dropout_p > 0.0:
        p.dropout_seed, p.dropout_offset = _dropout_seed(index, dropout_p, seed, offset,
                                                         q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
    launch.launch(plan.kernel, p, index, plan.workspace, owned=True)


def _sign(scale: float | None) -> int | None:
    """The scale as families see it: None (default), or its sign (-1, 0, 1)."""
    return None if scale is None else (scale > 0) - (scale < 0)


def _run_varlen(q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, instance, dropout_p, seed,
                offset, causal_alignment="top_left", window=None, softcap=0.0) -> None:
    batch = cu_q.shape[0] - 1
    if _nothing_to_launch(q, k, v, o, lse, o.numel() == 0 or max_k == 0 or max_q == 0):
        return
    index = q.get_device()
    causal, alignment, window, softcap = _varlen_mask(causal, causal_alignment, window, softcap)
    short = offsets.short_keys(cu_q, cu_k, causal or window is not None)
    # Everything the selection and the params look at but the data pointers, as _run's key.
    key = (index, q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(), batch, max_q, max_k,
           causal, scale, instance, dropout_p, False, True, alignment, window, softcap, short)
    plan = _kernel_for(key, lambda: calls.problem_for_varlen(
        q, k, v, batch, max_q, max_k, causal, causal_alignment=alignment, scale=scale, dropout=dropout_p > 0.0,
        window=window, softcap=softcap > 0, short_keys=short), q, k, causal, instance)
    p = plan.params(lambda: launch.params_varlen(q, k, v, o, None, cu_q, cu_k, max_q, max_k, causal=causal,
                                                 causal_alignment=alignment, scale=scale, dropout_p=dropout_p,
                                                 window=window, softcap=softcap))
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    p.cu_seqlens_q, p.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    if dropout_p > 0.0:
        p.dropout_seed, p.dropout_offset = _dropout_seed(index, dropout_p, seed, offset,
                                                         batch * q.shape[1] * max_q * max_k)
    launch.launch(plan.kernel, p, index, plan.workspace, owned=True)


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
                     instance=None, dropout_p=0.0, seed=None, offset=0, bias=None, deterministic=False, window=None,
                     softcap=0.0):
    o = launch.empty_like_layout(q)
    features = (dropout_p, seed, offset, bias, window, softcap)
    if not return_lse:
        _run(q, k, v, o, None, causal, causal_alignment, scale, instance, *features)
        return o, _no_lse_on(q.device)
    lse = _lse_like(q, True)
    _run(q, k, v, o, lse, causal, causal_alignment, scale, instance, *features)
    return o, lse


def _fused_attention_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None,
                         return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0, bias=None, window=None,
                         softcap=0.0):
    check_no_grad("torch.ops.gemmgen.fused_attention_out", q=q, k=k, v=v, bias=bias)
    lse = _lse_like(q, return_lse)
    _run(q, k, v, out, lse if return_lse else None, causal, causal_alignment, scale, instance, dropout_p, seed,
         offset, bias, window, softcap)
    return lse


def _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse):
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not return_lse:
        return o, _no_lse_on(q.device)
    return o, torch.empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q), dtype=torch.float32,
                          device=q.device)


def _fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                            scale=None, return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0,
                            causal_alignment="top_left", window=None, softcap=0.0, deterministic=False):
    o, lse = _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse)
    # The kernel reads the offsets from data_ptr() as an int32 array: a strided view is copied.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    _run_varlen(q, k, v, o, lse if return_lse else None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal, scale, instance, dropout_p, seed, offset, causal_alignment, window, softcap)
    return o, lse


def _fake(q, k, v, causal=False, causal_alignment="top_left", scale=None, return_lse=False, instance=None,
          dropout_p=0.0, seed=None, offset=0, bias=None, deterministic=False, window=None, softcap=0.0):
    return launch.empty_like_layout(q), _lse_like(q, return_lse)


def _fake_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None, return_lse=False,
              instance=None, dropout_p=0.0, seed=None, offset=0, bias=None, window=None, softcap=0.0):
    return _lse_like(q, return_lse)


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                 return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0, causal_alignment="top_left",
                 window=None, softcap=0.0, deterministic=False):
    return _varlen_outputs(q, cu_seqlens_q, max_seqlen_q, return_lse)


# ---- backward ------------------------------------------------------------------------------------

def _kernel_ready(t: torch.Tensor) -> bool:
    """Whether a backward kernel can read `t` as it is: last dim contiguous, other strides non-zero
    multiples of 8 elements where the dim is stepped over, 16-byte aligned data."""
    (n0, n1, n2, n3), (s0, s1, s2, s3) = t.shape, t.stride()
    if n3 > 1 and s3 != 1:
        return False
    for n, st in ((n0, s0), (n1, s1), (n2, s2)):
        if n > 1 and (st == 0 or st % 8):
            return False
    return t.data_ptr() % ALIGN_BYTES == 0


def _bwd_problem(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic, tensors=(),
                 window=None, softcap=False):
    return calls.problem_for_bwd(q, k, causal, causal_alignment=causal_alignment, scale=scale,
                                  dropout=dropout_p > 0.0, bias=bias, bias_grad=bias_grad,
                                  deterministic=deterministic, tensors=tensors, window=window, softcap=softcap)


def _bwd_kernel(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                tensors=(), window=None, softcap=False) -> Any:
    """The backward kernel for a call (K with Q's heads), selected once per key and cached; a
    missing instance is compiled on demand as for the forward."""
    qs, ks = q.stride(), k.stride()
    big = launch.max_offset(q, k, bias, *tensors) >= 2**31
    key = ("bwd", q.get_device(), q.dtype, q.shape, k.shape, qs[2] <= qs[1], ks[2] <= ks[1], causal,
           causal_alignment if causal or window else None, _sign(scale), big, dropout_p > 0.0, bias is not None,
           bias_grad, deterministic, window, softcap)
    return _cached_bwd_kernel(key, lambda: _bwd_problem(q, k, causal, causal_alignment, scale, dropout_p, bias,
                                                        bias_grad, deterministic, tensors, window, softcap))


def _cached_bwd_kernel(key: tuple, problem_of: Callable[[], Problem]) -> Any:
    """The backward kernel cached under `key`, else the one selected (or compiled on demand) for
    problem_of()."""
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = jit.select_or_build(problem_of()).kernel
        if len(_kernels) >= _MAX_CACHED:
            _kernels.clear()
        _kernels[key] = kernel
    return kernel


def _bwd_plan(key: tuple, kernel_of: Callable[[], Any]) -> _Plan:
    """The backward plan cached under `key`: the kernel (kernel_of() at the first call) and, once
    launched, its params and workspace size (_Plan)."""
    plan = _kernels.get(key)
    if plan is None:
        plan = _Plan(kernel_of(), None)
        if len(_kernels) >= _MAX_CACHED:
            _kernels.clear()
        _kernels[key] = plan
    return plan


def _check_backward_exists(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                           window, softcap=False) -> None:
    """At a forward whose inputs require grad: raise NoInstanceError (every instance's reason) unless
    a backward runs the call, at its head dim or padded to a larger one (_bwd_head_dim)."""
    if _bwd_head_dim(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                     window, softcap) == q.shape[-1]:
        kk = launch.expanded_layout(k, q.shape[1] // k.shape[1], "meta")
        _bwd_kernel(q, kk, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic, window=window,
                    softcap=softcap)


def _bwd_reads_gqa(q, k, v, out, d_o, dq, dkk, dvv, causal, causal_alignment, scale, dropout_p, bias, bias_grad,
                   deterministic, window, capped) -> bool:
    """Whether the backward kernel of a GQA call (selected for K and V expanded to Q's heads) reads
    them at their own heads (abi.INFO_READS_GQA), decided once per call key: the selection's key
    from the tensors as the caller passes them."""
    key = ("bwd reads gqa", q.get_device(), q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(),
           out.stride(), d_o.stride(), causal, causal_alignment if causal or window else None, _sign(scale),
           dropout_p > 0.0, None if bias is None else bias.stride(), bias_grad, deterministic, window, capped)
    found = _kernels.get(key)
    if found is None:
        kernel = _bwd_kernel(q, launch.expanded_layout(k, q.shape[1] // k.shape[1], "meta"), causal,
                             causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                             (out, d_o, dq, dkk, dvv), window, capped)
        if len(_kernels) >= _MAX_CACHED:
            _kernels.clear()
        found = _kernels[key] = bool(kernel.reads_gqa)
    return found


def _refuse_double_backward(op: str, tensors: tuple[torch.Tensor, ...]) -> None:
    """The backward ops have no backward of their own: building a graph through them raises."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise InputError(f"double backward through gemmgen.{op} is not supported: its backward "
                         f"(torch.ops.gemmgen.{op}_backward) has no backward of its own; "
                         "call backward without create_graph=True")


def _sum_groups(dst: torch.Tensor, grads: torch.Tensor, heads_kv: int, group: int) -> None:
    """GQA/MQA: dst (dK or dV of heads_kv heads, dim 1) = grads (one per query head) summed over the
    query heads of each key/value head, in float32."""
    dst.copy_(grads.unflatten(1, (heads_kv, group)).sum(2, dtype=torch.float32))


def _bwd_head_dim(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                  window=None, softcap=False) -> int:
    """The head dim a backward runs at (selection.padded_backward_head_dim), decided once per call key."""
    qs, ks = q.stride(), k.stride()
    key = ("bwd head dim", q.get_device(), q.dtype, q.shape, k.shape, qs[2] <= qs[1], ks[2] <= ks[1], causal,
           causal_alignment if causal or window else None, _sign(scale), dropout_p > 0.0, bias is not None, bias_grad,
           deterministic, window, softcap)
    found = _kernels.get(key)
    if found is None:
        kk = launch.expanded_layout(k, q.shape[1] // k.shape[1], "meta")  # as the kernels read K: Q's heads
        found = selection.padded_backward_head_dim(
            _bwd_problem(q, kk, causal, causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                         window=window, softcap=softcap))
        if len(_kernels) >= _MAX_CACHED:
            _kernels.clear()
        _kernels[key] = found
    return found


def _fused_attention_backward(grad_out, q, k, v, out, lse, causal, causal_alignment, scale, dropout_p, seed,
                              offset, bias, bias_grad, deterministic, window=None, softcap=0.0):
    _refuse_double_backward("fused_attention", (grad_out, q, k, v, out))
    causal, window = _mask_args(causal, window)
    if softcap:
        softcap = check_softcap(softcap)
    capped = softcap > 0
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if q.numel() and nk and (dp := _bwd_head_dim(q, k, causal, causal_alignment, scale, dropout_p, bias, bias_grad,
                                                  deterministic, window, capped)) != d:
        grads = _fused_attention_backward(*(padding.pad(t, dp) for t in (grad_out, q, k, v, out)), lse, causal,
                                          causal_alignment, padding.default_scale(scale, d), dropout_p, seed,
                                          offset, bias, bias_grad, deterministic, window, softcap)
        return (*(padding.cut(g, t) for g, t in zip(grads[:3], (q, k, v))), grads[3])
    dq, dk, dv = launch.empty_like_layout(q), launch.empty_like_layout(k), launch.empty_like_layout(v)
    dbias = torch.empty((b, h, nq, nk) if bias_grad else (0,), dtype=q.dtype, device=q.device)
    if q.numel() == 0 or nk == 0:  # no score: every gradient is zero
        for t in (dq, dk, dv, dbias):
            t.zero_()
        return dq, dk, dv, dbias
    if lse.shape != (b, h, nq):
        raise InputError(f"the backward needs the forward's LSE [B, H, Nq] = {[b, h, nq]}; got {tuple(lse.shape)} "
                         f"(call the forward with return_lse=True)")
    group = h // hkv
    # The forward reads broadcast (stride 0) dims; the backward kernels take dense ones.
    ready = lambda t: t if _kernel_ready(t) else launch.empty_like_layout(t).copy_(t)  # noqa: E731
    q, out = ready(q), ready(out)
    d_o = grad_out if _kernel_ready(grad_out) else launch.empty_like_layout(out).copy_(grad_out)
    lse = lse.contiguous()
    index = q.get_device()
    dbias_arg = dbias if bias_grad else None
    if group == 1:
        kk, vv, dkk, dvv = ready(k), ready(v), dk, dv
    else:
        # The kernel is selected for K and V expanded to the query heads; one that reads them at their
        # own heads (abi.INFO_READS_GQA) gets them as they are, the others expanded. dK and dV come
        # back per query head either way, summed over each group below.
        dkk, dvv = launch.expanded_layout(k, group), launch.expanded_layout(v, group)
        if _bwd_reads_gqa(q, k, v, out, d_o, dq, dkk, dvv, causal, causal_alignment, scale, dropout_p, bias,
                          bias_grad, deterministic, window, capped):
            kk, vv = ready(k), ready(v)
        else:
            kk, vv = launch.expand_heads(k, group), launch.expand_heads(v, group)
    # Everything the kernel's selection and the params look at but the data pointers and dropout's
    # seed and offset (the strides also fix max_offset; every tensor here is 16-byte aligned).
    key = ("bwd plan", index, q.dtype, q.shape, kk.shape,
           *(t.stride() for t in (q, kk, vv, out, d_o, dq, dkk, dvv)), causal,
           causal_alignment if causal or window else None, scale, dropout_p,
           None if bias is None else bias.stride(), bias_grad, deterministic, window, softcap)
    plan = _bwd_plan(key, lambda: _bwd_kernel(q, launch.expanded_layout(kk, h // kk.shape[1], "meta"), causal,
                                              causal_alignment, scale, dropout_p, bias, bias_grad, deterministic,
                                              (vv, out, d_o, dq, dkk, dvv), window, capped))
    p = plan.params(lambda: launch.params_bwd(q, kk, vv, out, d_o, lse, dq, dkk, dvv, causal=causal,
                                              causal_alignment=causal_alignment, scale=scale, dropout_p=dropout_p,
                                              seed=seed, offset=offset, bias=bias, dbias=dbias_arg,
                                              deterministic=deterministic, window=window, softcap=softcap))
    launch.set_bwd_pointers(p, q, kk, vv, out, d_o, lse, dq, dkk, dvv, bias, dbias_arg)
    if dropout_p > 0.0:
        p.dropout_seed, p.dropout_offset = seed, offset
    launch.run_bwd(plan.kernel, p, index, plan.workspace)
    if group > 1:  # GQA/MQA: dK and dV summed over the query heads of each key/value head
        _sum_groups(dk, dkk, hkv, group)
        _sum_groups(dv, dvv, hkv, group)
    return dq, dk, dv, dbias


def _fake_backward(grad_out, q, k, v, out, lse, causal, causal_alignment, scale, dropout_p, seed, offset, bias,
                   bias_grad, deterministic, window=None, softcap=0.0):
    b, h, nq, _ = q.shape
    dbias = q.new_empty((b, h, nq, k.shape[2]) if bias_grad else (0,))
    return launch.empty_like_layout(q), launch.empty_like_layout(k), launch.empty_like_layout(v), dbias


# The positions of fused_attention's arguments (its schema) that the backward reads.
(_Q, _K, _V, _CAUSAL, _ALIGNMENT, _SCALE, _RETURN_LSE, _INSTANCE, _DROPOUT, _SEED, _OFFSET, _BIAS, _DET, _WINDOW,
 _SOFTCAP) = range(15)


def _setup_context(ctx, inputs, output) -> None:
    """Save what the backward needs, and refuse at the forward what it could not differentiate."""
    q, k, v = inputs[_Q], inputs[_K], inputs[_V]
    causal, alignment, scale = inputs[_CAUSAL], inputs[_ALIGNMENT], inputs[_SCALE]
    dropout_p, seed, offset, bias, deterministic = (inputs[_DROPOUT], inputs[_SEED], inputs[_OFFSET], inputs[_BIAS],
                                                    inputs[_DET])
    causal, window = _mask_args(causal, inputs[_WINDOW] if len(inputs) > _WINDOW else None)
    o, lse = output
    _check_saves("fused_attention", inputs[_RETURN_LSE], dropout_p, seed)
    bias_grad = bias is not None and bias.requires_grad
    softcap = float(inputs[_SOFTCAP]) if len(inputs) > _SOFTCAP else 0.0
    if not isinstance(q, FakeTensor) and not torch.compiler.is_compiling() and q.numel() and k.shape[2]:
        _check_backward_exists(q, k, causal, alignment, scale, dropout_p, bias, bias_grad, deterministic, window,
                               softcap > 0)
    ctx.save_for_backward(q, k, v, o, lse, bias)
    ctx.args = (causal, alignment, scale, dropout_p, 0 if seed is None else seed, offset, bias_grad, deterministic,
                window, softcap)
    ctx.mark_non_differentiable(lse)


def _check_saves(op: str, return_lse: bool, dropout_p: float, seed: int | None) -> None:
    """What a forward of torch.ops.gemmgen.<op> whose inputs require grad must hand its backward:
    the LSE, and with dropout the seed that regenerates the mask."""
    if not return_lse:
        raise InputError(f"torch.ops.gemmgen.{op} needs return_lse=True when its inputs require grad: "
                         f"the backward reads the forward's LSE (gemmgen.{op} passes it)")
    if dropout_p > 0.0 and seed is None:
        raise InputError(f"torch.ops.gemmgen.{op} with dropout needs an explicit seed when its inputs "
                         f"require grad: the backward regenerates the forward's mask (gemmgen.{op} "
                         "draws one)")


def _autograd_backward(ctx, grad_o, grad_lse):
    return _gradients(ctx, grad_o, fused_attention_backward_op)


def _gradients(ctx, grad_o, backward: Callable) -> tuple:
    """The gradients of fused_attention's 15 inputs from what _setup_context saved, computed by
    `backward` (the backward op, or its implementation in eager calls)."""
    q, k, v, o, lse, bias = ctx.saved_tensors
    causal, alignment, scale, dropout_p, seed, offset, bias_grad, deterministic, window, softcap = ctx.args
    dq, dk, dv, dbias = backward(grad_o, q, k, v, o, lse, causal, alignment, scale, dropout_p, seed, offset, bias,
                                 bias_grad, deterministic, None if window is None else list(window), softcap)
    return dq, dk, dv, None, None, None, None, None, None, None, None, dbias if bias_grad else None, None, None, None


def _eager_training(name: str, forward: Callable, setup_context: Callable, gradients: Callable) -> type:
    """A torch.autograd.Function named `name` made of an op's pieces, for eager calls that record a
    graph (gemmgen.ops.eager.runs_eagerly): the op's forward implementation, its setup_context (the
    checks and saves of its registered autograd) and gradients(ctx, grad_o, implementation of the
    backward op). The same results as the op, without torch.library's autograd wrapper and the
    dispatcher, which cost a small call about 100 us of host time per forward (bench/NOTES.md
    experiment 66). Traced, compiled and transformed calls go through the op."""

    def run_forward(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(run_forward),
        "backward": staticmethod(lambda ctx, grad_o, grad_lse: gradients(ctx, grad_o)),
    })


# ---- variable-length backward: packed q [Tq, H, d], k, v [Tk, Hkv, d] -----------------------------

def _bhnd(t: torch.Tensor) -> torch.Tensor:
    """A packed [T, H, d] tensor as the [1, H, T, d] view the 4-D helpers take."""
    return t.unsqueeze(0).transpose(1, 2)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """The packed [T, H, d] view of a [1, H, T, d] tensor (the inverse of _bhnd)."""
    return t.transpose(1, 2).squeeze(0)


def _packed_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized packed tensor in t's dim order, made dense (as empty_like_layout does for
    the fixed-length ops): the real op and its fake implementation agree on the strides."""
    return _packed(launch.empty_like_layout(_bhnd(t)))


def _readable(t: torch.Tensor) -> torch.Tensor:
    """t, or a dense copy of it where a backward kernel cannot read it as it is (_kernel_ready)."""
    return t if _kernel_ready(_bhnd(t)) else _packed_like(t).copy_(t)


def _varlen_bwd_kernel(q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, tensors=(),
                       causal_alignment="top_left", window=None, softcap=0.0, deterministic=False) -> Any:
    """The backward kernel of a variable-length call (packed q, K with Q's heads; `causal` and
    `window` normalized, `causal_alignment` "top_left" without a mask), selected once per key and
    cached, compiled on demand if missing. The key leaves out the total rows, which change from batch
    to batch: the selection sees the lengths only through the maxima, and the totals only through
    whether element offsets pass int32."""
    big = launch.max_offset(q, k, *tensors) >= 2**31
    key = ("bwd_varlen", q.get_device(), q.dtype, tuple(q.shape[1:]), tuple(k.shape[1:]), batch, max_seqlen_q,
           max_seqlen_k, causal, _sign(scale), big, dropout_p > 0.0, causal_alignment, window, softcap > 0,
           bool(deterministic))
    return _cached_bwd_kernel(key, lambda: calls.problem_for_bwd_varlen(
        q, k, batch, max_seqlen_q, max_seqlen_k, causal, causal_alignment=causal_alignment, scale=scale,
        dropout=dropout_p > 0.0, tensors=tensors, window=window, softcap=softcap > 0,
        deterministic=bool(deterministic)))


def _varlen_mask(causal: bool, causal_alignment: str, window, softcap: float):
    """The varlen ops' mask arguments normalized (_mask_args), the alignment "top_left" where no mask
    reads it (one cache key per mask), and the softcap checked (an op called directly gets
    fused_attention_varlen's checks)."""
    causal, window = _mask_args(causal, window)
    alignment = causal_alignment if causal or window is not None else "top_left"
    return causal, alignment, window, check_softcap(softcap) if softcap else 0.0


def _nothing_to_differentiate(q, k, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """True when no query row sees a key: no rows, no heads or a zero maximum length."""
    return q.numel() == 0 or k.numel() == 0 or max_seqlen_q == 0 or max_seqlen_k == 0


def _fused_attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, scale, dropout_p, seed, offset, causal_alignment="top_left",
                                     window=None, softcap=0.0, deterministic=False):
    _refuse_double_backward("fused_attention_varlen", (grad_out, q, k, v, out))
    dq, dk, dv = _packed_like(q), _packed_like(k), _packed_like(v)
    if _nothing_to_differentiate(q, k, max_seqlen_q, max_seqlen_k):  # no score: every gradient is zero
        for t in (dq, dk, dv):
            t.zero_()
        return dq, dk, dv
    batch, h, hkv = cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1]
    if lse.shape != (batch, h, max_seqlen_q):
        raise InputError(f"the backward needs the forward's LSE [B, H, max_seqlen_q] = {[batch, h, max_seqlen_q]}; "
                         f"got {tuple(lse.shape)} (call the forward with return_lse=True)")
    causal, causal_alignment, window, softcap = _varlen_mask(causal, causal_alignment, window, softcap)
    group = h // hkv
    # dK and dV per query head (summed over each group below); the kernel is selected for K and V
    # with Q's heads, and one that reads them at their own heads (abi.INFO_READS_GQA) gets them as
    # they are, the others expanded.
    dkk, dvv = (dk, dv) if group == 1 else (_packed_like(_packed(launch.expanded_layout(_bhnd(t), group)))
                                            for t in (k, v))
    q, out = _readable(q), _readable(out)
    d_o = grad_out if _kernel_ready(_bhnd(grad_out)) else _packed_like(out).copy_(grad_out)
    # The kernel reads the offsets and the LSE as plain arrays.
    cu_q, cu_k, lse = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), lse.contiguous()
    kernel = _varlen_bwd_kernel(q, dkk, batch, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p,
                                (k, v, out, d_o, dq, dkk, dvv), causal_alignment, window, softcap, deterministic)
    if group == 1 or kernel.reads_gqa:
        kk, vv = _readable(k), _readable(v)
    else:
        kk, vv = (_readable(_packed(launch.expand_heads(_bhnd(t), group))) for t in (k, v))
    p = launch.params_bwd_varlen(q, kk, vv, out, d_o, lse, dq, dkk, dvv, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                 causal=causal, scale=scale, dropout_p=dropout_p, seed=seed, offset=offset,
                                 causal_alignment=causal_alignment, window=window, softcap=softcap,
                                 deterministic=deterministic)
    launch.run_bwd(kernel, p, q.get_device())
    if group > 1:
        _sum_groups(dk, dkk, hkv, group)
        _sum_groups(dv, dvv, hkv, group)
    return dq, dk, dv


def _fake_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal, scale, dropout_p, seed, offset, causal_alignment="top_left", window=None,
                          softcap=0.0, deterministic=False):
    return _packed_like(q), _packed_like(k), _packed_like(v)


def _setup_context_varlen(ctx, inputs, output) -> None:
    """Save what the varlen backward needs, and refuse at the forward what it could not differentiate
    (no LSE, dropout without a seed, no backward instance for the call)."""
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, _instance, dropout_p, seed, offset,
     causal_alignment, window, softcap, deterministic) = inputs
    o, lse = output
    _check_saves("fused_attention_varlen", return_lse, dropout_p, seed)
    if not isinstance(q, FakeTensor) and not torch.compiler.is_compiling() and \
            not _nothing_to_differentiate(q, k, max_q, max_k):
        kk = launch.expanded_layout(_bhnd(k), q.shape[1] // k.shape[1], "meta")
        masked, alignment, window_, softcap_ = _varlen_mask(causal, causal_alignment, window, softcap)
        _varlen_bwd_kernel(q, _packed(kk), cu_q.shape[0] - 1, max_q, max_k, masked, scale, dropout_p, (), alignment,
                           window_, softcap_, deterministic)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, dropout_p, 0 if seed is None else seed, offset, causal_alignment,
                window, softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _autograd_backward_varlen(ctx, grad_o, grad_lse):
    return _gradients_varlen(ctx, grad_o, fused_attention_varlen_backward_op)


def _gradients_varlen(ctx, grad_o, backward: Callable) -> tuple:
    """The gradients of fused_attention_varlen's 18 inputs from what _setup_context_varlen saved,
    computed by `backward` (the backward op, or its implementation in eager calls)."""
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = backward(grad_o, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 15  # the offsets, sizes and flags have no gradient


def _kvcache_outputs(q, return_lse):
    b, nq, h, d = q.shape
    o = torch.empty((b, nq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device) if return_lse else _no_lse_on(q.device)
    return o, lse


def _no_kv_to_read(o, lse, cache_seqlens, new: int, capacity: int):
    """O = 0 and LSE = -inf, with a cache that holds no key: a sequence that claims keys (new ones
    included) lies outside the cache and gets NaN rows, as the kernels do for it."""
    o.zero_()
    lse.fill_(float("-inf"))
    if o.numel() and capacity == 0:
        bad = (cache_seqlens.to(torch.int64) + new) != 0
        o.masked_fill_(bad.view(-1, 1, 1, 1), float("nan"))
        if lse.numel():
            lse.masked_fill_(bad.view(-1, 1, 1), float("nan"))
    return o, lse


def _fused_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, k=None, v=None, causal=True,
                                  scale=None, return_lse=False, instance=None, window=None):
    causal, window = _mask_args(causal, window)
    o, lse = _kvcache_outputs(q, return_lse)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    new = k.shape[1] if k is not None and k.shape[0] > 0 else 0
    if (o.numel() == 0 and not new) or capacity == 0:
        return _no_kv_to_read(o, lse, cache_seqlens, new, capacity)
    # New tokens are appended even when there is no query row: selection then sees one.
    b, nq, h, d = q.shape
    probe = q if q.numel() else q.new_empty((max(b, 1), 1, max(h, k_cache.shape[2]), d))
    index = q.get_device()
    # Everything the selection and the params look at but the data pointers (O is dense in q's shape).
    key = ("kv_cache", index, q.dtype, probe.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
           capacity, None if block_table is None else block_table.stride(), causal, scale, instance,
           None if k is None else (k.shape, k.stride(), v.stride()), window)
    # A long chunk runs on a prefill family as packed sequences where one runs it, else (outside graph
    # capture) as dense calls; the decode instance is then needed only for its append entry point.
    chunk = o.numel() > 0 and instance is None and nq >= DENSE_CHUNK_ROWS
    packed = _packed_chunk(key, q, k_cache, v_cache, block_table, causal, scale, window) if chunk else None
    dense = chunk and packed is None and not torch.cuda.is_current_stream_capturing()
    plan = None if (dense or packed is not None) and not new else _kernel_for(
        key, lambda: calls.problem_for_kvcache(probe, k_cache, v_cache, capacity, causal, scale=scale, window=window,
                                               paged=block_table is not None),
        probe, k_cache, causal, instance)
    seqlens = cache_seqlens
    if new:
        with torch.cuda.device(index):
            plan.kernel.append(launch.kv_append_args(k_cache, v_cache, cache_seqlens, block_table, k, v, capacity),
                               launch.raw_stream(index))
        # The kernel attends to the new tokens too; a negative length stays negative (NaN rows).
        seqlens = torch.where(cache_seqlens < 0, cache_seqlens, cache_seqlens + new)
    if o.numel() == 0:
        return o, lse
    if packed is not None:
        _chunk_as_packed(packed, q, k_cache, v_cache, seqlens, o, lse if return_lse else None, causal, scale, index)
        return o, lse
    if dense:
        _chunk_as_dense(q, k_cache, v_cache, seqlens, block_table, o, lse if return_lse else None, causal, scale,
                        capacity, window)
        return o, lse
    p = plan.params(lambda: launch.params_kvcache(q, k_cache, v_cache, seqlens, block_table, o, None, causal=causal,
                                                  scale=scale, capacity=capacity, window=window))
    p.q, p.k, p.v, p.o, p.seqlens_k = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(), \
        seqlens.data_ptr()
    if return_lse:
        p.lse = lse.data_ptr()
    if block_table is not None:
        p.block_table = block_table.data_ptr()
    launch.launch(plan.kernel, p, index, plan.workspace, owned=True)
    return o, lse


# A chunk of at least this many query rows against a key-value cache (chunked prefill) runs on a
# prefill family (fmha_sm90 on Hopper: about 4x the decode family's rate at 1024 rows against 8192
# keys, bench/NOTES.md, experiment 62): as packed sequences whose key counts stay on the GPU where an
# instance runs that (_packed_chunk: a contiguous cache, no window), else sequence by sequence as
# dense bottom-right calls, which read the lengths (and the pages used) back to the host first, one
# copy per call, and so run outside CUDA-graph capture only (under capture the decode family runs
# the chunk).
DENSE_CHUNK_ROWS = 128

_NO_PACKED = object()  # a call key whose chunks no instance runs as packed sequences


def _packed_chunk(key: tuple, q, k_cache, v_cache, block_table, causal: bool, scale: float | None,
                  window) -> _Plan | None:
    """The plan of a chunk against a contiguous cache run as packed sequences: sequence b's queries
    are rows b * Nq.. of q, its keys the first cache_seqlens[b] rows from row b * Nmax of the cache
    (read on the GPU, no host sync, so graph capture runs it too). None where no built instance runs
    it (fmha_sm90's persistent 16-bit instances do, marked kv_cache; no window, a scale >= 0), the
    cache is paged or its sequences are not evenly spaced rows ([B, Nmax, Hkv, d] storage order). No
    instance is compiled on demand for it: the dense route's selection does that."""
    cached = _kernels.get(("kv_packed",) + key)
    if cached is not None:
        return None if cached is _NO_PACKED else cached
    plan: _Plan | None = None
    b, nq, h, d = q.shape
    nmax = k_cache.shape[1]
    even = all(b == 1 or t.stride(0) == nmax * t.stride(1) for t in (k_cache, v_cache))
    if block_table is None and window is None and even:
        qp, kp, vp = _packed_views(q, k_cache, v_cache)
        problem = dataclasses.replace(
            calls.problem_for_varlen(qp, kp, vp, b, nq, nmax, causal, causal_alignment="bottom_right", scale=scale,
                                     short_keys=False), kv_cache=True)
        try:
            cand = selection.select(problem)
        except NoInstanceError:
            pass
        else:
            plan = _Plan(cand.kernel, selection.splits(cand, problem))
    if len(_kernels) >= _MAX_CACHED:
        _kernels.clear()
    _kernels[("kv_packed",) + key] = _NO_PACKED if plan is None else plan
    return plan


def _packed_views(q, k_cache, v_cache):
    """q as [B * Nq, H, d] rows (a copy where its batch entries are not evenly spaced rows), the
    caches as [B * Nmax, Hkv, d] views."""
    b, nq, h, d = q.shape
    nmax, hkv = k_cache.shape[1], k_cache.shape[2]
    return (q.reshape(b * nq, h, d), k_cache.reshape(b * nmax, hkv, d), v_cache.reshape(b * nmax, hkv, d))


_slots: dict[tuple, torch.Tensor] = {}


def _slot_offsets(device: torch.device, b: int, step: int) -> torch.Tensor:
    """[0, step, 2 step, .., b step] int32 on `device` (the cu_seqlens of evenly spaced sequences),
    kept per (device, b, step) outside graph capture."""
    at = (device, b, step)
    t = _slots.get(at)
    if t is None:
        t = torch.arange(0, (b + 1) * step, step, dtype=torch.int32, device=device)
        if not torch.cuda.is_current_stream_capturing():
            if len(_slots) >= _MAX_CACHED:
                _slots.clear()
            _slots[at] = t
    return t


def _chunk_as_packed(plan: _Plan, q, k_cache, v_cache, seqlens, o, lse, causal: bool, scale: float | None,
                     index: int) -> None:
    """O (and LSE) of a key-value-cache chunk as packed sequences (_packed_chunk's plan): the kernel
    reads seqlens on the GPU and gives the rows that see no key O = 0 and LSE = -inf, and a sequence
    whose length lies outside [0, Nmax] NaN rows."""
    b, nq, h, d = q.shape
    nmax = k_cache.shape[1]
    qp, kp, vp = _packed_views(q, k_cache, v_cache)
    op = o.view(b * nq, h, d)
    cu_q, cu_k = _slot_offsets(q.device, b, nq), _slot_offsets(q.device, b, nmax)

    def build():
        p = launch.params_varlen(qp, kp, vp, op, None, cu_q, cu_k, nq, nmax, causal=causal,
                                 causal_alignment="bottom_right", scale=scale)
        p.seqlens_k = seqlens.data_ptr()  # (its workspace holds the CTAs' TMA slots)
        return p

    p = plan.params(build)
    p.q, p.k, p.v, p.o = qp.data_ptr(), kp.data_ptr(), vp.data_ptr(), op.data_ptr()
    p.cu_seqlens_q, p.cu_seqlens_k, p.seqlens_k = cu_q.data_ptr(), cu_k.data_ptr(), seqlens.data_ptr()
    if lse is not None:
        p.lse = lse.data_ptr()
    launch.launch(plan.kernel, p, index, plan.workspace, owned=True)


def _chunk_as_dense(q, k_cache, v_cache, seqlens, block_table, o, lse, causal, scale, capacity, window=None) -> None:
    """O (and LSE) of a key-value-cache call, one dense call per sequence on its first L_b keys
    (gathered from their pages for a paged cache), with the kernels' answers for the rest: O = 0
    and LSE = -inf for a sequence without keys, NaN rows for a length outside [0, capacity] or a
    block-table entry that names no page of the cache."""
    lengths = seqlens.tolist()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    pages_of = None
    if block_table is not None:
        page = k_cache.shape[1]
        need = max(-(-min(max(n, 0), capacity) // page) for n in lengths)
        pages_of = block_table[:, :need].tolist()
    for b, n in enumerate(lengths):
        ob = o[b:b + 1].transpose(1, 2)  # [1, H, Nq, d] view of O [B, Nq, H, d]
        lb = lse[b:b + 1] if lse is not None else None
        if pages_of is not None and 0 <= n <= capacity:
            pages = pages_of[b][:-(-n // page)] if n else []
            if any(not 0 <= pg < k_cache.shape[0] for pg in pages):
                n = -1  # a page the cache does not have: NaN rows, as the kernels give
        if n < 0 or n > capacity:
            ob.fill_(float("nan"))
            if lb is not None:
                lb.fill_(float("nan"))
            continue
        if n == 0:
            ob.zero_()
            if lb is not None:
                lb.fill_(float("-inf"))
            continue
        if pages_of is None:
            kb, vb = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        else:  # the pages were checked on the host; the table's own row indexes them (no host copy)
            index = block_table[b, :len(pages)].long()
            kb, vb = (t.index_select(0, index).view(1, -1, hkv, d)[:, :n] for t in (k_cache, v_cache))
        _run(q[b:b + 1].transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), ob, lb, causal, "bottom_right",
             scale, None, window=window)


# The implementations the operations call directly on the eager fast path (gemmgen.ops.eager).
run_fused_attention = _fused_attention
run_fused_attention_out = _fused_attention_out
run_fused_attention_varlen = _fused_attention_varlen
run_fused_attention_with_kvcache = _fused_attention_with_kvcache


def _fused_attention_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None, causal=False,
                        causal_alignment="top_left", scale=None, return_lse=False, instance=None):
    if not q.dtype == k.dtype == v.dtype == fp8.DTYPE:  # O is bf16 whatever the inputs: never a 16-bit kernel
        raise InputError(f"fused_attention_fp8 takes q, k, v in {fp8.DTYPE}; got {q.dtype}, {k.dtype}, {v.dtype}")
    o = launch.empty_like_layout(q, dtype=fp8.OUT_DTYPE)
    lse = _lse_like(q, True) if return_lse else _no_lse_on(q.device)
    if o.numel() == 0 or k.shape[2] == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (q.shape[0], k.shape[1]) or not t.is_contiguous()
                              or t.device != q.device):
            raise InputError(f"{name} must be a contiguous float32 [B, Hkv] tensor on q's device (gemmgen.ops.fp8 "
                             f"prepares it); got {t.dtype} {tuple(t.shape)} on {t.device}")
    index = q.get_device()
    causal = bool(causal)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES:
        raise InputError(f"q, k and v must be {ALIGN_BYTES}-byte aligned")
    # Everything the selection and the params look at but the data pointers. The instance copies V
    # transposed into the call's workspace (plan.workspace bytes) before its attention kernel.
    key = (index, q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(), causal,
           causal_alignment if causal else None, scale, instance, "fp8")
    plan = _kernel_for(key, lambda: calls.problem_for(q, k, causal, v=v, causal_alignment=causal_alignment,
                                                      scale=scale), q, k, causal, instance)
    p = plan.params(lambda: launch.params(q, k, v, o, None, causal=causal, causal_alignment=causal_alignment,
                                          scale=scale))
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    if return_lse:
        p.lse = lse.data_ptr()
    p.descale_q, p.descale_k, p.descale_v = (None if t is None else t.data_ptr() for t in (q_descale, k_descale,
                                                                                          v_descale))
    launch.launch(plan.kernel, p, index, plan.workspace, owned=True)
    return o, lse


def _fake_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None, causal=False, causal_alignment="top_left",
              scale=None, return_lse=False, instance=None):
    return launch.empty_like_layout(q, dtype=fp8.OUT_DTYPE), _lse_like(q, return_lse)


def _fake_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, k=None, v=None, causal=True, scale=None,
                  return_lse=False, instance=None, window=None):
    return _kvcache_outputs(q, return_lse)


_LIB.impl("fused_attention", _fused_attention, "CUDA")
_LIB.impl("fused_attention_fp8", _fused_attention_fp8, "CUDA")
torch.library.register_fake("gemmgen::fused_attention_fp8", _fake_fp8, lib=_LIB)
_LIB.impl("fused_attention_with_kvcache", _fused_attention_with_kvcache, "CUDA")
torch.library.register_fake("gemmgen::fused_attention_with_kvcache", _fake_kvcache, lib=_LIB)
_LIB.impl("fused_attention_out", _fused_attention_out, "CUDA")
_LIB.impl("fused_attention_varlen", _fused_attention_varlen, "CUDA")
_LIB.impl("fused_attention_backward", _fused_attention_backward, "CUDA")
_LIB.impl("fused_attention_varlen_backward", _fused_attention_varlen_backward, "CUDA")
torch.library.register_fake("gemmgen::fused_attention", _fake, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_out", _fake_out, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_varlen", _fake_varlen, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_backward", _fake_backward, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_varlen_backward", _fake_varlen_backward, lib=_LIB)
torch.library.register_autograd("gemmgen::fused_attention", _autograd_backward, setup_context=_setup_context,
                                lib=_LIB)
torch.library.register_autograd("gemmgen::fused_attention_varlen", _autograd_backward_varlen,
                                setup_context=_setup_context_varlen, lib=_LIB)


# The pieces are looked up when called (tests replace the implementations).
_EagerTraining = _eager_training(
    "_EagerTraining", lambda *inputs: _fused_attention(*inputs), lambda *a: _setup_context(*a),
    lambda ctx, grad_o: _gradients(ctx, grad_o, _fused_attention_backward))
_EagerTrainingVarlen = _eager_training(
    "_EagerTrainingVarlen", lambda *inputs: _fused_attention_varlen(*inputs), lambda *a: _setup_context_varlen(*a),
    lambda ctx, grad_o: _gradients_varlen(ctx, grad_o, _fused_attention_varlen_backward))


def run_fused_attention_training(*inputs):
    """fused_attention_op's result for a plain eager call whose inputs require grad."""
    return _EagerTraining.apply(*inputs)


def run_fused_attention_varlen_training(*inputs):
    """fused_attention_varlen_op's result for a plain eager call whose inputs require grad."""
    return _EagerTrainingVarlen.apply(*inputs)


fused_attention_op = torch.ops.gemmgen.fused_attention.default
fused_attention_out_op = torch.ops.gemmgen.fused_attention_out.default
fused_attention_varlen_op = torch.ops.gemmgen.fused_attention_varlen.default
fused_attention_backward_op = torch.ops.gemmgen.fused_attention_backward.default
fused_attention_varlen_backward_op = torch.ops.gemmgen.fused_attention_varlen_backward.default
fused_attention_with_kvcache_op = torch.ops.gemmgen.fused_attention_with_kvcache.default
fused_attention_fp8_op = torch.ops.gemmgen.fused_attention_fp8.default


def clear_cache() -> None:
    """Forget the kernels chosen per call key and the workspaces kept per stream (the registry's
    refresh() calls this)."""
    _kernels.clear()
    launch.release_stream_workspaces()


registry.on_refresh(clear_cache)
