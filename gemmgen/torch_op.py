"""The torch custom ops behind gemmgen.fused_attention, with fake implementations, so that
torch.compile traces them without a graph break and CUDA graphs capture them:

    torch.ops.gemmgen.fused_attention(q, k, v, causal, causal_alignment, scale, return_lse, instance)
        -> (O in q's layout, LSE [B, H, Nq] float32, or an empty tensor without return_lse)
    torch.ops.gemmgen.fused_attention_out(q, k, v, out, causal, causal_alignment, scale, return_lse,
                                          instance) -> LSE (O written into `out`)

The CUDA kernels expect inputs that gemmgen.ops validated. The hot path is one dictionary lookup
per call: the kernel chosen for a (device, dtype, sizes, layout, mask, instance) key is cached;
the first call of a key selects (gemmgen.selection), tunes the bucket first under
GEMMGEN_AUTOTUNE=1, and compiles a missing instance on demand (gemmgen.jit).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

from gemmgen import jit, launch, registry, selection
from gemmgen.errors import InputError
from gemmgen.problem import ALIGN_BYTES

_LIB = torch.library.Library("gemmgen", "DEF")
_ARGS = "bool causal=False, str causal_alignment='top_left', float? scale=None, bool return_lse=False, str? instance=None"
_LIB.define(f"fused_attention(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"fused_attention_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_ARGS}) -> Tensor")

_kernels: dict[tuple, Any] = {}
_MAX_CACHED = 4096


def autotune_enabled() -> bool:
    """GEMMGEN_AUTOTUNE=1: tune a bucket the first time a call falls in it."""
    return os.environ.get("GEMMGEN_AUTOTUNE", "0") not in ("", "0")


def _select(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, causal_alignment: str,
            scale: float | None, instance: str | None) -> tuple[Any, bool]:
    """The kernel for this call and whether the choice may be cached."""
    problem = launch.problem_for(q, k, causal, v=v, causal_alignment=causal_alignment, scale=scale)
    cand = jit.select_or_build(problem, instance)
    cacheable = True
    if instance is None and autotune_enabled() and selection.needs_tuning(problem):
        if torch.cuda.is_current_stream_capturing():  # timing synchronizes: tune after the capture
            cacheable = False
        else:
            from gemmgen import tuner

            print(f"gemmgen: autotuning bucket {problem.bucket.key} of {problem.describe()}",
                  file=sys.stderr, flush=True)
            tuner.tune_call(q, k, causal)
            cand = selection.select(problem)
    return cand.kernel, cacheable


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
         causal: bool, causal_alignment: str, scale: float | None, instance: str | None) -> None:
    if o.numel() == 0 or k.shape[2] == 0:  # nothing to launch: rows that see no key give 0 and -inf
        o.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) % ALIGN_BYTES:
        raise InputError(f"q, k, v and out must be {ALIGN_BYTES}-byte aligned")
    index = q.get_device()
    qs, ks = q.stride(), k.stride()
    # Everything a family's problem_reason may look at: shapes, layout kind, mask and its alignment,
    # the scale's sign, offsets past int32.
    big = launch.max_offset(q, k, v, o) >= 2**31
    key = (index, q.dtype, q.shape, k.shape, qs[2] <= qs[1], ks[2] <= ks[1], causal,
           causal_alignment if causal else None, scale is not None and scale < 0, big, instance)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel, cacheable = _select(q, k, v, causal, causal_alignment, scale, instance)
        if cacheable:
            if len(_kernels) >= _MAX_CACHED:
                _kernels.clear()
            _kernels[key] = kernel
    launch.launch(kernel, launch.params(q, k, v, o, lse, causal=causal, causal_alignment=causal_alignment,
                                        scale=scale), index)


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
                     instance=None):
    o = launch.empty_like_layout(q)
    if not return_lse:
        _run(q, k, v, o, None, causal, causal_alignment, scale, instance)
        return o, _no_lse_on(q.device)
    lse = _lse_like(q, True)
    _run(q, k, v, o, lse, causal, causal_alignment, scale, instance)
    return o, lse


def _fused_attention_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None,
                         return_lse=False, instance=None):
    lse = _lse_like(q, return_lse)
    _run(q, k, v, out, lse if return_lse else None, causal, causal_alignment, scale, instance)
    return lse


def _fake(q, k, v, causal=False, causal_alignment="top_left", scale=None, return_lse=False, instance=None):
    return launch.empty_like_layout(q), _lse_like(q, return_lse)


def _fake_out(q, k, v, out, causal=False, causal_alignment="top_left", scale=None, return_lse=False,
              instance=None):
    return _lse_like(q, return_lse)


_LIB.impl("fused_attention", _fused_attention, "CUDA")
_LIB.impl("fused_attention_out", _fused_attention_out, "CUDA")
torch.library.register_fake("gemmgen::fused_attention", _fake, lib=_LIB)
torch.library.register_fake("gemmgen::fused_attention_out", _fake_out, lib=_LIB)

fused_attention_op = torch.ops.gemmgen.fused_attention.default
fused_attention_out_op = torch.ops.gemmgen.fused_attention_out.default


def clear_cache() -> None:
    """Forget the kernels chosen per call key (the registry's refresh() calls this)."""
    _kernels.clear()


registry.on_refresh(clear_cache)
