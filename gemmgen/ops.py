"""fused_attention: validate the tensors, pick an instance through the registry, launch it."""
from __future__ import annotations

import functools
import math

import torch

from gemmgen import abi, registry
from gemmgen.errors import DeviceError, InputError
from gemmgen.reference import ALIGNMENTS, causal_offset
from gemmgen.space import supported_head_dims

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
ALIGN_ELEMENTS = 8  # strides in elements: 8 x 2 bytes keeps every row start 16-byte aligned
ALIGN_BYTES = 16  # the kernels load 16 bytes per thread per copy
INT32_MAX = 2**31 - 1
# Opt-in shared memory per block by compute capability, for torch builds that do not report it.
SMEM_OPTIN = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
              (9, 0): 227 * 1024}


def _check_strides(name: str, t: torch.Tensor) -> None:
    # Dims of size 1 are never stepped over, so their strides do not matter.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InputError(f"{name} must be contiguous in its last dim (head_dim); its strides are "
                         f"{tuple(t.stride())}")
    bad = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1 and s % ALIGN_ELEMENTS]
    if bad:
        raise InputError(f"{name}'s strides {tuple(t.stride())} must be multiples of {ALIGN_ELEMENTS} "
                         f"elements (16 bytes) outside the last dim")
    if t.data_ptr() % ALIGN_BYTES:
        raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                         f"(storage offset {t.storage_offset()})")


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


def _empty_like_layout(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized tensor with q's dim order (q's layout, made dense), head_dim innermost."""
    order = sorted(range(3), key=lambda i: (-q.stride(i), i)) + [3]
    strides, step = [0] * 4, 1
    for i in reversed(order):
        strides[i], step = step, step * shape[i]
    return torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device)


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or SMEM_OPTIN.get(cc, 48 * 1024)
    return cc, int(smem)


def _validate(q, k, v, out) -> None:
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D ([batch, heads, seqlen, head_dim]); got shape "
                             f"{tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise InputError(f"q, k, v must share one dtype among torch.float16, torch.bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    dims = supported_head_dims()
    if not q.shape[3] == k.shape[3] == v.shape[3] or q.shape[3] not in dims:
        raise InputError(f"head_dim must be equal across q, k, v and one of {dims}; got "
                         f"{q.shape[3]}, {k.shape[3]}, {v.shape[3]}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise InputError(f"batch must be equal across q, k, v; got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"k and v must have the same seqlen; got {k.shape[2]} and {v.shape[2]}")
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InputError(f"k and v must have the same number of heads, dividing q's {q.shape[1]} "
                         f"(GQA/MQA); got {k.shape[1]} and {v.shape[1]}")
    if max(max(t.shape) for t in tensors.values()) > INT32_MAX:
        raise InputError(f"sizes must fit in int32; got {tuple(q.shape)}, {tuple(k.shape)}")
    for name, t in tensors.items():
        _check_strides(name, t)
    if out is not None:
        _check_out(out, q)
    devices = {t.device for t in [q, k, v] + ([out] if out is not None else [])}
    if len(devices) > 1:
        raise InputError(f"q, k, v{', out' if out is not None else ''} must be on one device; got "
                         f"{', '.join(sorted(map(str, devices)))}")
    if q.device.type != "cuda":
        gpu = "" if torch.cuda.is_available() else f"; this torch ({torch.__version__}) sees no CUDA GPU"
        raise DeviceError(f"fused_attention needs a CUDA GPU: the tensors are on {q.device}{gpu}")


def _problem(q: torch.Tensor, k: torch.Tensor, causal: bool) -> registry.Problem:
    cc, smem = _device_facts(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return registry.Problem(dtype=DTYPES[q.dtype], head_dim=q.shape[3], causal=bool(causal), cc=cc,
                            smem_limit=smem, seqlen_q=q.shape[2], seqlen_k=k.shape[2])


def selected_instance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      instance: str | None = None) -> str:
    """The name of the instance fused_attention would run for these tensors."""
    _validate(q, k, v, None)
    return registry.select(_problem(q, k, causal), instance).name


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
    `instance` forces a built instance by name.
    """
    if causal_alignment not in ALIGNMENTS:
        raise InputError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, (int, float))):
        raise InputError(f"scale must be a float or None, got {type(scale).__name__}")
    _validate(q, k, v, out)
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    o = out if out is not None else _empty_like_layout(q, tuple(q.shape))
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if o.numel() == 0 or seqlen_k == 0:  # nothing to launch: rows that see no key give 0 and -inf
        o.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return (o, lse) if return_lse else o
    kernel = registry.select(_problem(q, k, causal), instance).kernel
    p = abi.AttnParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=o.data_ptr(),
        lse=lse.data_ptr() if lse is not None else None,
        batch=batch, heads=heads, heads_kv=k.shape[1], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim=head_dim,
        q_batch_stride=q.stride(0), q_head_stride=q.stride(1), q_row_stride=q.stride(2),
        k_batch_stride=k.stride(0), k_head_stride=k.stride(1), k_row_stride=k.stride(2),
        v_batch_stride=v.stride(0), v_head_stride=v.stride(1), v_row_stride=v.stride(2),
        o_batch_stride=o.stride(0), o_head_stride=o.stride(1), o_row_stride=o.stride(2),
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        causal_offset=causal_offset(seqlen_q, seqlen_k, causal_alignment) if causal else 0)
    with torch.cuda.device(q.device):
        kernel.run(p, torch.cuda.current_stream(q.device).cuda_stream)
    return (o, lse) if return_lse else o
