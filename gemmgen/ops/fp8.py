"""fused_attention on FP8 inputs: q, k, v in torch.float8_e4m3fn, O in bfloat16.

The stored values times their factors are the inputs: the scores are
scale * (q * q_descale) (k * k_descale)^T and O = softmax(scores) (v * v_descale). A factor is None
(1), a positive float, or a float32 tensor on q's device that broadcasts to [B, Hkv] (per tensor:
a scalar tensor; per K/V head: [Hkv] or [B, Hkv]; a query head takes its K/V head's factor, as
FlashAttention-3's descale arguments do).

The Hopper family's fp8 instances (fmha_sm90 `_fp8_`) read V transposed, keys contiguous (wgmma
reads 8-bit operands K-major only): each call copies V so into its workspace first, a kernel of the
instance's own (templates/include/gemmgen/fmha_sm90/transpose.h). No backward: inputs that require
grad raise.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gemmgen.errors import DeviceError, InputError
from gemmgen.generator import space
from gemmgen.ops.checks import check_4d, check_bool, check_finite, check_instance, check_strides
from gemmgen.ops.reference import ALIGNMENTS

DTYPE = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16
# Strides in elements outside the last dim: 16 one-byte elements keep row starts 16-byte aligned
# (what TMA descriptors need).
ALIGN_ELEMENTS = 16
ALIGN_BYTES = 16
INT32_MAX = 2**31 - 1
FLOAT32_MAX = torch.finfo(torch.float32).max


def is_fp8(*tensors: object) -> bool:
    """Whether any of `tensors` is an FP8 tensor (the call then takes the FP8 path)."""
    return any(isinstance(t, torch.Tensor) and t.dtype == DTYPE for t in tensors)


def head_dims() -> tuple[int, ...]:
    """The head dims the fp8 instances run."""
    return space.fp8_head_dims()


def validate(q, k, v) -> None:
    """Shapes, dtypes and strides of an FP8 call (metadata only, so tracing passes; the device and
    the data pointers: check_device)."""
    check_4d("batch, heads, seqlen, head_dim", q=q, k=k, v=v)
    if not q.dtype == k.dtype == v.dtype == DTYPE:
        raise InputError(f"fp8 attention takes q, k, v all in {DTYPE}; got {q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    if not d == dk == dv or d not in head_dims():
        raise InputError(f"fp8 attention: head_dim must be equal across q, k, v and one of "
                         f"{', '.join(map(str, head_dims()))}; got {d}, {dk}, {dv}")
    if not b == bk == bv:
        raise InputError(f"batch must be equal across q, k, v; got {b}, {bk}, {bv}")
    if nk != nv:
        raise InputError(f"k and v must have the same seqlen; got {nk} and {nv}")
    if hk != hv or hk == 0 or h % hk:
        raise InputError(f"k and v must have the same number of heads, dividing q's {h} (GQA/MQA); got {hk} and {hv}")
    if max(*q.shape, *k.shape) > INT32_MAX:
        raise InputError(f"sizes must fit in int32; got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_strides(name, t, ALIGN_ELEMENTS)


def check_device(q, k, v, factors) -> None:
    """One CUDA device for the inputs and the factor tensors; their data 16-byte aligned."""
    if not q.device == k.device == v.device:
        raise InputError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, t in factors:
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise InputError(f"{name} must be on q's device {q.device}; got {t.device}")
    if q.device.type != "cuda":
        raise DeviceError(f"fp8 attention needs a CUDA GPU (sm_90a): the tensors are on {q.device}")
    if not torch.compiler.is_compiling() and not isinstance(q, FakeTensor):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.data_ptr() % ALIGN_BYTES:
                raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                                 f"(storage offset {t.storage_offset()})")


def check_descale(name: str, value: object, batch: int, heads_kv: int) -> None:
    """A descale argument's metadata (or value, for a number): None, a float > 0, or a float32
    tensor without grad that broadcasts to [batch, heads_kv]."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise InputError(f"{name} must be a float32 tensor; got {value.dtype}")
        if value.requires_grad and torch.is_grad_enabled():
            raise InputError(f"{name} requires grad: fp8 attention has no backward (detach it)")
        if value.dim() > 2:
            raise InputError(f"{name} must broadcast to [B, Hkv] = {[batch, heads_kv]}; got shape {tuple(value.shape)}")
        try:
            value.expand(batch, heads_kv)
        except RuntimeError:
            raise InputError(f"{name} of shape {tuple(value.shape)} does not broadcast to [B, Hkv] = "
                             f"{[batch, heads_kv]}") from None
        return
    factor = check_finite(name, value)
    if not 0.0 < factor <= FLOAT32_MAX:  # (the kernel reads it as a float32)
        raise InputError(f"{name} must be > 0 and a finite float32, got {value}")


def descale(name: str, value: object, batch: int, heads_kv: int, device: torch.device) -> torch.Tensor | None:
    """A descale argument as the kernel reads it: None, or a contiguous float32 [batch, heads_kv]
    tensor on `device` (a float becomes one; a tensor is broadcast). Checks it (check_descale)."""
    check_descale(name, value, batch, heads_kv)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise InputError(f"{name} must be on q's device {device}; got {value.device}")
        full = value.expand(batch, heads_kv)
        return full if full.is_contiguous() else full.contiguous()
    return torch.full((batch, heads_kv), float(value), dtype=torch.float32, device=device)


def check_unsupported(unsupported) -> None:
    """`unsupported`: (name, value, default) of arguments without an FP8 form; any not at its
    default raises, naming it."""
    for name, value, default in unsupported:
        if not (value is default or (not isinstance(value, torch.Tensor) and value == default)):
            raise InputError(f"fp8 attention runs without {name} (got {value!r}); it takes causal, "
                             f"causal_alignment, scale, return_lse, instance and q/k/v_descale")


def prepare(q, k, v, *, causal: bool, causal_alignment: str, scale: float | None, return_lse: bool,
            instance: str | None, q_descale=None, k_descale=None, v_descale=None,
            unsupported=()) -> tuple[float | None, list[torch.Tensor | None]]:
    """gemmgen.fused_attention's FP8 call checked, and what torch.ops.gemmgen.fused_attention_fp8
    takes besides the tensors: (the scale, the factors as float32 [B, Hkv] tensors or None).
    `unsupported` as check_unsupported's."""
    check_unsupported(unsupported)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_instance(instance)
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise InputError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")
    if scale is not None:
        scale = check_finite("scale", scale)
        if scale < 0:
            raise InputError(f"fp8 attention runs scales >= 0; got {scale}")
    validate(q, k, v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InputError("fp8 attention has no backward: q, k, v require grad (detach them, or train in "
                         "bf16/fp16, whose backward gemmgen runs)")
    b, hkv = q.shape[0], k.shape[1]
    named = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    for name, value in named:
        check_descale(name, value, b, hkv)
    check_device(q, k, v, named)
    return scale, [descale(name, value, b, hkv, q.device) for name, value in named]
