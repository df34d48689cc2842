"""fused_attention: validate the tensors, then call the gemmgen::fused_attention custom op
(gemmgen.torch_op), which selects an instance and launches it."""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gemmgen import launch, selection, torch_op
from gemmgen.errors import DeviceError, InputError
from gemmgen.problem import ALIGN_BYTES
from gemmgen.reference import ALIGNMENTS
from gemmgen.space import supported_head_dims

DTYPES = launch.DTYPE_NAMES
ALIGN_ELEMENTS = 8  # strides in elements: 8 x 2 bytes keeps every row start 16-byte aligned
INT32_MAX = 2**31 - 1
HEAD_DIMS = supported_head_dims()


def _check_strides(name: str, t: torch.Tensor) -> None:
    (n0, n1, n2, n3), (s0, s1, s2, s3) = t.shape, t.stride()
    # Dims of size 1 are never stepped over, so their strides do not matter.
    if n3 > 1 and s3 != 1:
        raise InputError(f"{name} must be contiguous in its last dim (head_dim); its strides are "
                         f"{(s0, s1, s2, s3)}")
    if (n0 > 1 and s0 % ALIGN_ELEMENTS) or (n1 > 1 and s1 % ALIGN_ELEMENTS) or (n2 > 1 and s2 % ALIGN_ELEMENTS):
        raise InputError(f"{name}'s strides {(s0, s1, s2, s3)} must be multiples of {ALIGN_ELEMENTS} "
                         f"elements (16 bytes) outside the last dim")


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise InputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise InputError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    dims = sorted((s, n) for s, n in zip(out.stride(), out.shape) if n > 1)
    if any(s2 < s1 * n1 for (s1, n1), (s2, _) in zip(dims, dims[1:])) or (dims and dims[0][0] == 0):
        raise InputError(f"out's elements overlap (strides {tuple(out.stride())})")
    _check_strides("out", out)


def _validate(q, k, v, out) -> None:
    """Every check that needs only the tensors' metadata (so torch.compile traces it), and the data
    pointers' alignment outside of tracing."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D ([batch, heads, seqlen, head_dim]); got shape "
                             f"{tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise InputError(f"q, k, v must share one dtype among torch.float16, torch.bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    if not d == dk == dv or d not in HEAD_DIMS:
        raise InputError(f"head_dim must be equal across q, k, v and one of {HEAD_DIMS}; got {d}, {dk}, {dv}")
    if not b == bk == bv:
        raise InputError(f"batch must be equal across q, k, v; got {b}, {bk}, {bv}")
    if nk != nv:
        raise InputError(f"k and v must have the same seqlen; got {nk} and {nv}")
    if hk != hv or hk == 0 or h % hk:
        raise InputError(f"k and v must have the same number of heads, dividing q's {h} (GQA/MQA); "
                         f"got {hk} and {hv}")
    if max(*q.shape, *k.shape) > INT32_MAX:
        raise InputError(f"sizes must fit in int32; got {tuple(q.shape)}, {tuple(k.shape)}")
    _check_strides("q", q)
    _check_strides("k", k)
    _check_strides("v", v)
    if out is not None:
        _check_out(out, q)
    if not torch.compiler.is_compiling() and not isinstance(q, FakeTensor):  # the op checks them too
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | (out.data_ptr() if out is not None else 0)) % ALIGN_BYTES:
            for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
                if t is not None and t.data_ptr() % ALIGN_BYTES:
                    raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                                     f"(storage offset {t.storage_offset()})")
    if not q.device == k.device == v.device or (out is not None and out.device != q.device):
        devices = {t.device for t in (q, k, v, out) if t is not None}
        raise InputError(f"q, k, v{', out' if out is not None else ''} must be on one device; got "
                         f"{', '.join(sorted(map(str, devices)))}")
    if q.device.type != "cuda":
        gpu = "" if torch.cuda.is_available() else f"; this torch ({torch.__version__}) sees no CUDA GPU"
        raise DeviceError(f"fused_attention needs a CUDA GPU: the tensors are on {q.device}{gpu}")


def _check_args(causal_alignment: str, scale: float | None) -> float | None:
    if causal_alignment not in ALIGNMENTS:
        raise InputError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, (int, float))):
        raise InputError(f"scale must be a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise InputError(f"scale must be finite, got {scale}")
    return None if scale is None else float(scale)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    causal_alignment: str = "top_left", scale: float | None = None,
                    return_lse: bool = False, instance: str | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """O = softmax(scale * Q K^T + mask) V on the GPU, without copying the inputs.

    q: [B, H, Nq, d]; k, v: [B, Hkv, Nk, d], Hkv dividing H (GQA/MQA); fp16 or bf16; any strides
    with a contiguous last dim, other strides multiples of 8 elements and 16-byte aligned data
    (a [B, N, H, d] tensor passes as x.transpose(1, 2)). causal_alignment "top_left" (torch's) lets
    query i see keys j <= i; "bottom_right" (FlashAttention's) keys j <= i + Nk - Nq. scale defaults
    to 1/sqrt(d). O comes back in q's layout (or is written into `out`); with return_lse, also the
    float32 natural-log LSE [B, H, Nq] (-inf and O = 0 for a row that sees no key).
    `instance` forces a built instance by name. Runs on the inputs' device and current stream, as
    the torch custom op torch.ops.gemmgen.fused_attention (torch.compile and CUDA graphs work).
    """
    scale = _check_args(causal_alignment, scale)
    _validate(q, k, v, out)
    causal = bool(causal)
    if out is None:
        o, lse = torch_op.fused_attention_op(q, k, v, causal, causal_alignment, scale, return_lse, instance)
    else:
        lse = torch_op.fused_attention_out_op(q, k, v, out, causal, causal_alignment, scale, return_lse,
                                              instance)
        o = out
    return (o, lse) if return_lse else o


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            instance: str | None = None) -> selection.Decision:
    """The decision fused_attention makes for these tensors: candidates, rejects with their reasons,
    winner and its source (decision.report() gives the text `gemmgen explain` prints)."""
    _validate(q, k, v, None)
    return selection.decide(launch.problem_for(q, k, causal), instance)


def selected_instance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      instance: str | None = None) -> str:
    """The name of the instance fused_attention would run for these tensors."""
    _validate(q, k, v, None)
    return selection.select(launch.problem_for(q, k, causal), instance).name
