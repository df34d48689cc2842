"""fused_attention: validate the tensors, then call the gemmgen::fused_attention custom op
(gemmgen.ops.torch_op), which selects an instance and launches it."""
from __future__ import annotations



import torch
from torch._subclasses.fake_tensor import FakeTensor

from gemmgen.kernels import launch
from gemmgen.select import calls, selection
from gemmgen.ops import eager, fp8, offsets, padding, torch_op, versioned
from gemmgen.ops.checks import (check_4d, check_bool, check_dense, check_finite, check_instance, check_no_overlap,
                                check_softcap, check_strides, check_window)
from gemmgen.ops.grad import check_no_grad
from gemmgen.errors import DeviceError, InputError
from gemmgen.select.problem import ALIGN_BYTES
from gemmgen.ops.reference import ALIGNMENTS
from gemmgen.generator.space import supported_head_dims

DTYPES = launch.DTYPE_NAMES
ALIGN_ELEMENTS = 8  # strides in elements: 8 x 2 bytes keeps every row start 16-byte aligned
INT32_MAX = 2**31 - 1
_CHECKED = eager.Checked()  # fused_attention's tensor signatures whose metadata checks passed


def _check_strides(name: str, t: torch.Tensor) -> None:
    check_strides(name, t, ALIGN_ELEMENTS)


def _check_out(out: torch.Tensor, q: torch.Tensor, *, kernel_writes: bool = True) -> None:
    """out=: q's shape and dtype, elements that do not overlap, and (where the kernel writes it,
    not a copy) the kernels' stride rules."""
    if not isinstance(out, torch.Tensor):
        raise InputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise InputError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    dims = sorted((s, n) for s, n in zip(out.stride(), out.shape) if n > 1)
    if any(s2 < s1 * n1 for (s1, n1), (s2, _) in zip(dims, dims[1:])) or (dims and dims[0][0] == 0):
        raise InputError(f"out's elements overlap (strides {tuple(out.stride())})")
    if kernel_writes:
        _check_strides("out", out)


def _validate(q, k, v, out, *, device: bool = True) -> None:
    """Every check that needs only the tensors' metadata (so torch.compile traces it), and the data
    pointers' alignment outside of tracing; the device checks last unless device=False."""
    check_4d("batch, heads, seqlen, head_dim", q=q, k=k, v=v)
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise InputError(f"q, k, v must share one dtype among torch.float16, torch.bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    if not d == dk == dv or d not in supported_head_dims():  # what the families serve, together
        raise InputError(f"head_dim must be equal across q, k, v and {padding.describe()}; got {d}, {dk}, {dv}")
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
        _check_pointers(q, k, v, out)
    if device:
        _check_device(q, k, v, out)


def _check_pointers(q, k, v, out) -> None:
    """The data pointers' alignment (a per-call fact: never part of a checked signature)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | (out.data_ptr() if out is not None else 0)) % ALIGN_BYTES:
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t is not None and t.data_ptr() % ALIGN_BYTES:
                raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                                 f"(storage offset {t.storage_offset()})")


def _has_memory(t: torch.Tensor) -> bool:
    """False while tracing (fake tensors): there are no data pointers to compare."""
    return not torch.compiler.is_compiling() and not isinstance(t, FakeTensor)


def _check_device(q, k, v, out) -> None:
    if not q.device == k.device == v.device or (out is not None and out.device != q.device):
        devices = {t.device for t in (q, k, v, out) if t is not None}
        raise InputError(f"q, k, v{', out' if out is not None else ''} must be on one device; got "
                         f"{', '.join(sorted(map(str, devices)))}")
    if q.device.type != "cuda":
        gpu = "" if torch.cuda.is_available() else f"; this torch ({torch.__version__}) sees no CUDA GPU"
        raise DeviceError(f"fused_attention needs a CUDA GPU: the tensors are on {q.device}{gpu}")


def _check_out_overlap(out, q, k, v, attn_mask) -> None:
    """out= shares no memory with an input (a per-call fact: the data pointers)."""
    if out is not None and _has_memory(q):
        check_no_overlap([("out", out)], [("q", q), ("k", k), ("v", v)] +
                         ([("attn_mask", attn_mask)] if attn_mask is not None else []))


def _check_args(causal_alignment: str, scale: float | None) -> float | None:
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise InputError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")
    return None if scale is None else check_finite("scale", scale)


SEED_LIMIT = 2**63  # seeds and offsets travel as int64 through the torch op


def _check_dropout(dropout_p: float, seed: int | None, offset: int) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise InputError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, value in (("seed", seed), ("offset", offset)):
        if value is None and name == "seed":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
            raise InputError(f"{name} must be an int in [0, 2**63), got {value!r}")
    return float(dropout_p)


def _padded_copy(mask: torch.Tensor) -> torch.Tensor:
    """mask ([B or 1, H or 1, Nq, Nk] view) copied into rows padded to a multiple of ALIGN_ELEMENTS: the
    kernel reads the mask in 16-byte vectors, up to the padded end of a row. A row broadcast (row
    stride 0) stays one: one row is stored and read for every query."""
    b, h, nq, nk = mask.shape
    rows = 1 if nq > 1 and mask.stride(2) == 0 else nq
    padded = -(-nk // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    store = mask.new_empty((b, h, rows, padded))
    store[..., :nk].copy_(mask[:, :, :rows])
    return store[..., :nk].expand(b, h, nq, nk)


def _check_mask(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    """The mask's metadata: a dense tensor on q's device, bool or q's dtype, broadcasting to
    [B, H, Nq, Nk] (no allocation: _prepare_mask makes the kernel's copy after the device check)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise InputError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    check_dense("attn_mask", attn_mask)
    if attn_mask.device != q.device:
        raise InputError(f"attn_mask must be on q's device {q.device}; got {attn_mask.device}")
    if attn_mask.dtype not in (torch.bool, q.dtype):
        raise InputError(f"attn_mask must be torch.bool or q's dtype {q.dtype}; got {attn_mask.dtype}")
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    if attn_mask.dim() > 4:
        raise InputError(f"attn_mask must have at most 4 dims; got shape {tuple(attn_mask.shape)}")
    try:
        attn_mask.expand(b, h, nq, nk)
    except RuntimeError:
        raise InputError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"[B, H, Nq, Nk] = {[b, h, nq, nk]}") from None


# The kernel's copies of masks (a bool mask's additive one; rows padded where the kernel cannot read
# them in place), made once per mask tensor, version and stream: a model's layers pass the same mask,
# which its first layer then converts for all (gemmgen.ops.versioned; bench/NOTES.md 101). A copy
# is kept while its mask lives; a few at most. The stream is part of the key: a copy made on one
# stream may still be in the making when another stream would read it.
_MASK_COPIES = versioned.PerVersion(most=4)


def _stream_key(t: torch.Tensor) -> int | None:
    """The current stream of t's device (its handle), which a call's kernels run on; None on the CPU."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _prepare_mask(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """attn_mask (checked by _check_mask) as the op's bias: q's dtype, [B, H, Nq, Nk] by its strides
    (0 where it broadcasts over batch, heads or rows), rows contiguous, 16-byte aligned and padded
    to 8 elements: the mask itself where the kernel can read it so, else a copy, kept per mask
    version and stream (_MASK_COPIES) unless the mask takes a gradient (its copy is then part of
    this call's autograd graph)."""
    if attn_mask is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if attn_mask.dtype != torch.bool and _in_place(_compact(attn_mask, shape), q):
        return attn_mask.expand(shape)
    if attn_mask.requires_grad:
        return _kernel_copy(attn_mask, q, shape)
    return _MASK_COPIES.get(attn_mask, (q.dtype, shape, _stream_key(q)), lambda: _kernel_copy(attn_mask, q, shape))


def _compact(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """mask broadcast to shape, its broadcast over batch and heads (stride 0) kept as one entry."""
    full = mask.expand(shape)
    return full[:1 if full.stride(0) == 0 else shape[0], :1 if full.stride(1) == 0 else shape[1]]


def _in_place(compact: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel reads this (compacted) mask where it lies: rows contiguous, strides and the
    data pointer 16-byte aligned, rows a multiple of 8 elements long (not while tracing, where the
    pointer is unknown)."""
    s0, s1, s2, s3 = compact.stride()
    nk = compact.shape[3]
    aligned = (s3 == 1 or nk == 1) and s2 % ALIGN_ELEMENTS == 0 and s1 % ALIGN_ELEMENTS == 0 \
        and s0 % ALIGN_ELEMENTS == 0 and nk % ALIGN_ELEMENTS == 0 and nk > 1
    return aligned and not (torch.compiler.is_compiling() or isinstance(q, FakeTensor)) and \
        compact.data_ptr() % ALIGN_BYTES == 0


def _kernel_copy(attn_mask: torch.Tensor, q: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The kernel's copy of attn_mask (_prepare_mask), made anew."""
    if attn_mask.dtype == torch.bool:  # True: take part (torch's convention); broadcasts kept; one kernel
        attn_mask = torch.where(attn_mask, torch.zeros((), dtype=q.dtype, device=q.device),
                                torch.full((), float("-inf"), dtype=q.dtype, device=q.device))
    compact = _compact(attn_mask, shape)
    if not _in_place(compact, q):
        compact = _padded_copy(compact)
    return compact.expand(shape)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    causal_alignment: str = "top_left", scale: float | None = None,
                    return_lse: bool = False, instance: str | None = None,
                    out: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
                    offset: int = 0, attn_mask: torch.Tensor | None = None,
                    deterministic: bool = False, window: tuple[int, int] | None = None,
                    softcap: float = 0.0, q_descale=None, k_descale=None,
                    v_descale=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """O = softmax(scale * Q K^T + mask) V on the GPU, reading the inputs where they are (at a tile
    head dim; see d below).

    q: [B, H, Nq, d]; k, v: [B, Hkv, Nk, d], Hkv dividing H (GQA/MQA); fp16 or bf16; any strides
    with a contiguous last dim, other strides multiples of 8 elements and 16-byte aligned data
    (a [B, N, H, d] tensor passes as x.transpose(1, 2)). d from 1 to 256: a head dim the default
    families have no tile for (one of 32, 64, 96, 128, 160, 192, 256) runs on copies of q, k, v
    padded with zero columns to the next of them (gemmgen.ops.padding), at its own scale.
    causal_alignment "top_left" (torch's) lets query i see keys j <= i; "bottom_right"
    (FlashAttention's) keys j <= i + Nk - Nq. scale defaults to 1/sqrt(d). O comes back in q's
    layout (or is written into `out`); with return_lse, also the float32 natural-log LSE
    [B, H, Nq] (-inf and O = 0 for a row that sees no key).
    `instance` forces a built instance by name. Runs on the inputs' device and current stream, as
    the torch custom op torch.ops.gemmgen.fused_attention (torch.compile and CUDA graphs work).

    Differentiable: when q, k, v or a float attn_mask require grad (grad mode on), autograd gets dQ,
    dK and dV (summed over each group for GQA/MQA) and the mask's gradient from a backward instance
    (gemmgen.ops.torch_op.fused_attention_backward), in the inputs' layouts; the forward saves LSE for it.
    The forward checks at once that a backward instance serves the call, and raises NoInstanceError
    with every instance's reason if none does. deterministic=True asks for a backward whose result does
    not depend on the order blocks finish in (bitwise repeatable; slower: fmha_bwd_sm90 on Hopper and
    fa2_bwd_sm80 elsewhere add each query tile's dQ in key-tile order, at 0.79-0.94x and 0.58-0.82x
    their default speeds on an H100; with dropout or a mask mea_bwd_sm80 runs one CTA per head). The
    returned LSE has no gradient of its own; `out=` has no backward. Double backward raises.

    dropout_p zeroes each attention weight with that probability and scales the rest by
    1/(1 - dropout_p); the mask is a function of (seed, offset) and the weight's position
    (Philox), so the same pair gives the same mask. seed=None draws one from torch's CUDA generator
    (torch.manual_seed makes it reproducible; a CUDA graph replays the mask it captured).
    attn_mask is added to the scaled scores, broadcastable to [B, H, Nq, Nk] like torch SDPA's float
    mask, in q's dtype (a bool mask becomes 0 where True and -inf where False: a copy made once per
    mask tensor and version, kept while the mask lives, so that a model's layers share it).

    window=(left, right) is a sliding window (local attention, FlashAttention's window_size): query i
    sees keys j with i + off - left <= j <= i + off + right, off the diagonal's offset of
    causal_alignment (0 top-left, Nk - Nq bottom-right), a side of -1 unbounded; key tiles wholly
    outside the window are skipped. With causal=True the right side is 0 (pass 0 or -1). Instances
    built for the "local" mask run it (fa2_sm80 and, on Hopper, fmha_sm90 build them by default); its
    backward runs on fa2_bwd_sm80 (every instance reads the window, every GPU) and on Hopper on
    fmha_bwd_sm90's local instances (d32-128); where neither is built, inputs that require grad raise
    NoInstanceError at the forward.

    softcap > 0 caps the logits (Gemma 2's attn_logit_softcapping): the scaled scores s become
    softcap * tanh(s / softcap) before the mask; 0 (the default) leaves them. Instances built for it
    run it (fa2_sm80's `_sc` instances at head dims 128 and 256 by default, on every GPU, and on
    Hopper fmha_sm90's at 128 and 256, without a window); its backward
    runs on fa2_bwd_sm80's `_sc` instances (head dims 128 and 256 by default, every GPU) and on Hopper
    fmha_bwd_sm90's (128): at other head dims inputs that require grad raise NoInstanceError at the
    forward.

    FP8: q, k, v in torch.float8_e4m3fn (all three) run on Hopper's fp8 instances (fmha_sm90
    `_fp8_`, head dims 64, 128, 256, causal or not, either alignment, GQA/MQA) and return O in
    bfloat16. q_descale, k_descale, v_descale are the factors that turn the stored values into the
    inputs (scores = scale * (q * q_descale) (k * k_descale)^T, O = softmax(scores) (v * v_descale)):
    None (1), a float > 0, or a float32 tensor broadcasting to [B, Hkv] (per tensor or per K/V head,
    FlashAttention-3's convention; a tensor whose q and k factors multiply to a value that is not
    positive and finite gives NaN rows). scale >= 0. Strides are multiples of 16 elements outside
    the last dim. No dropout, mask tensor, window, softcap, out= or backward (inputs
    that require grad raise); see gemmgen.ops.fp8 and docs/fp8.md for the accuracy.
    """
    if fp8.is_fp8(q, k, v):
        check_bool("causal", causal)
        causal, fp8_window = check_window(window, causal)  # (-1, -1): none; (-1, 0): causal
        scale, factors = fp8.prepare(
            q, k, v, causal=causal, causal_alignment=causal_alignment, scale=scale, return_lse=return_lse,
            instance=instance, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            unsupported=(("dropout_p", dropout_p, 0.0), ("attn_mask", attn_mask, None), ("out", out, None),
                         ("window", fp8_window, None), ("softcap", softcap, 0.0)))
        o, lse = torch_op.fused_attention_fp8_op(q, k, v, *factors, causal, causal_alignment, scale, return_lse,
                                                 instance)
        return (o, lse) if return_lse else o
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise InputError("q_descale, k_descale, v_descale apply to fp8 inputs (torch.float8_e4m3fn); "
                         f"q, k, v are {getattr(q, 'dtype', type(q).__name__)}")
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_bool("deterministic", deterministic)
    check_instance(instance)
    scale = _check_args(causal_alignment, scale)
    dropout_p = _check_dropout(dropout_p, seed, offset)
    causal, window = check_window(window, causal)
    softcap = check_softcap(softcap)
    if (dp := padding.needs_padding(q, k, v)) is not None:
        return _fused_attention_padded(q, k, v, dp, out, return_lse, scale, attn_mask, causal=causal,
                                       causal_alignment=causal_alignment, instance=instance, dropout_p=dropout_p,
                                       seed=seed, offset=offset, deterministic=deterministic, window=window,
                                       softcap=softcap)
    direct = eager.runs_directly(q, k, v, out, attn_mask)
    training = not direct and torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, attn_mask))  # direct: no graph
    checked = direct and eager.signature(q, k, v, out, attn_mask)
    if checked and checked in _CHECKED:
        _check_pointers(q, k, v, out)
        _check_out_overlap(out, q, k, v, attn_mask)
    else:
        _validate(q, k, v, out, device=False)
        if training and out is not None:
            check_no_grad("fused_attention with out=", q=q, k=k, v=v, attn_mask=attn_mask,
                          hint="call it without out= to get gradients")
        _check_mask(attn_mask, q, k)
        _check_out_overlap(out, q, k, v, attn_mask)
        _check_device(q, k, v, out)
        if checked:
            _CHECKED.add(checked)
    bias = _prepare_mask(attn_mask, q, k)
    if training and dropout_p > 0.0 and seed is None:  # the backward regenerates the forward's mask
        b, h, nq, _ = q.shape
        seed, base = launch.draw_seed(q.get_device(), b * h * nq * k.shape[2])
        offset += base
    features = (dropout_p, seed, offset, bias)
    window_arg = None if window is None else list(window)  # the op's int[]
    if out is None:
        if direct:
            op = torch_op.run_fused_attention
        elif training and eager.runs_eagerly(q, k, v, attn_mask):
            op = torch_op.run_fused_attention_training
        else:
            op = torch_op.fused_attention_op
        o, lse = op(q, k, v, causal, causal_alignment, scale, return_lse or training, instance, *features,
                    deterministic, window_arg, softcap)
    else:
        op = torch_op.run_fused_attention_out if direct else torch_op.fused_attention_out_op
        lse = op(q, k, v, out, causal, causal_alignment, scale, return_lse, instance, *features, window_arg, softcap)
        o = out
    return (o, lse) if return_lse else o


def _fused_attention_padded(q, k, v, dp: int, out, return_lse: bool, scale: float | None, attn_mask, **kw):
    """fused_attention of a head dim without tiles, at head dim dp (gemmgen.ops.padding): q, k, v
    padded with zero columns, at the real head dim's scale; O cut back into q's layout (or out=)."""
    if out is not None:  # out= is checked against the caller's q (a copy fills it), and has no backward
        _check_out(out, q, kernel_writes=False)
        _check_out_overlap(out, q, k, v, attn_mask)
        check_no_grad("fused_attention with out=", q=q, k=k, v=v, attn_mask=attn_mask,
                      hint="call it without out= to get gradients")
    res = fused_attention(padding.pad(q, dp), padding.pad(k, dp), padding.pad(v, dp), attn_mask=attn_mask,
                          scale=padding.default_scale(scale, q.shape[-1]), return_lse=return_lse, **kw)
    o, lse = res if return_lse else (res, None)
    if out is not None:
        with torch.no_grad():
            out.copy_(o[..., :q.shape[-1]])
        o = out
    else:
        o = padding.cut(o, q)
    return (o, lse) if return_lse else o


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> None:
    """max_seqlen, and cu's values against the packed tensor's rows and max_seqlen (cu's metadata
    checked before, in _check_varlen_tensors)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 <= max_seqlen <= INT32_MAX:
        raise InputError(f"max_seqlen for {name} must be an int in [0, 2**31), got {max_seqlen!r}")
    seen = offsets.entry(cu)  # the values: read once per tensor version (gemmgen.ops.offsets)
    if seen is None or (total, max_seqlen) in seen.checked:
        return  # unreadable now (tracing, capture, meta), or these values passed against these sizes
    values, lengths = seen.values, seen.lengths
    if values[0] != 0 or min(lengths) < 0:
        raise InputError(f"{name} must start at 0 and never decrease; got {list(values[:8])}"
                         f"{'...' * (len(values) > 8)}")
    if values[-1] != total:
        raise InputError(f"{name} ends at {values[-1]}, the packed tensor has {total} rows")
    if max(lengths) > max_seqlen:
        raise InputError(f"max_seqlen {max_seqlen} is below {name}'s longest sequence, {max(lengths)}")
    seen.checked.add((total, max_seqlen))


def _check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    """fused_attention_varlen's checks of the tensors' metadata but the device (and q, k, v's data
    pointers)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise InputError(f"{name} must be a 3-D torch.Tensor ([total_tokens, heads, head_dim]); got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[0] != v.shape[0]:
        raise InputError(f"k and v must have the same number of rows; got {k.shape[0]} and {v.shape[0]}")
    # As [1, H, T, d] views the 4-D checks apply: dtype, head dim, heads, strides, device.
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]
    _validate(*views, None, device=False)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise InputError(f"{name} must be a 1-D torch.int32 tensor of batch + 1 offsets; got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")
        check_dense(name, cu)
        if cu.device != q.device:
            raise InputError(f"{name} must be on the tensors' device {q.device}; got {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise InputError(f"cu_seqlens_q and cu_seqlens_k must have the same length; got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")


def fused_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, scale: float | None = None, return_lse: bool = False,
                           instance: str | None = None, dropout_p: float = 0.0, seed: int | None = None,
                           offset: int = 0, causal_alignment: str = "top_left",
                           window: tuple[int, int] | None = None, softcap: float = 0.0,
                           deterministic: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (FlashAttention's varlen API).

    q: [Tq, H, d]; k, v: [Tk, Hkv, d], Hkv dividing H; sequence b is rows cu_seqlens_q[b] to
    cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] to cu_seqlens_k[b + 1] of k and v (int32, batch + 1
    entries, starting at 0); max_seqlen_q/k bound the lengths. The mask applies within each sequence:
    causal with causal_alignment "top_left" lets query i see keys j <= i, "bottom_right" keys
    j <= i + len_k - len_q of that sequence (FlashAttention's varlen causal: a chunk of new queries
    against its sequence's keys); window=(left, right) is a sliding window around that diagonal, as
    in fused_attention; softcap caps the logits, as in fused_attention. Returns O [Tq, H, d] and with
    return_lse the float32 LSE [B, H, max_seqlen_q] (-inf past a sequence's end and where no key is
    seen). d from 1 to 256, padded where no tile has it, and dropout_p, seed and offset, as in
    fused_attention. The cu_seqlens values are checked (a device-to-host copy, once per tensor and
    version: an in-place change is checked again) outside torch.compile and CUDA graph capture; a
    non-contiguous cu_seqlens view is copied to a contiguous one (the kernel
    reads the offsets as an array). fa2_sm80 runs every mask and softcap here on every GPU;
    fmha_sm90 on Hopper at head dims 64-192 and d256 with a causal mask or a window (windows but
    on d64's four-group tile, softcaps where its `_sc` instances are built), where every sequence
    with queries has keys (causal or a window: at least as many as queries), the offsets readable
    (not under CUDA graph capture); mea_sm80 (built on request) runs dropout and top-left causal.

    Differentiable: when q, k or v require grad (grad mode on), autograd gets dQ, dK and dV (summed
    over each group for GQA/MQA; zero for rows of sequences without keys, and for keys of sequences
    without queries) from a backward instance
    (gemmgen.ops.torch_op.fused_attention_varlen_backward), packed like the inputs and in their dim
    order; the forward saves LSE and the cu_seqlens for it. With dropout the backward regenerates
    the forward's mask from the same seed and offset (seed=None draws one at the forward). The
    forward checks at once that a backward instance serves the call, and raises NoInstanceError
    with every instance's reason if none does. deterministic=True asks for a backward whose result
    does not depend on the order blocks finish in (bitwise repeatable), as in fused_attention:
    fmha_bwd_sm90's split-dQ instances on Hopper and fa2_bwd_sm80 add each query tile's dQ in
    key-tile order (on an H100, fmha_bwd_sm90 at 0.83-0.95x its default speed on packed
    sequences). The returned LSE has no gradient of its own; double backward raises.
    """
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_bool("deterministic", deterministic)
    check_instance(instance)
    scale = _check_args(causal_alignment, scale)
    causal, window = check_window(window, causal)
    softcap = check_softcap(softcap)
    dropout_p = _check_dropout(dropout_p, seed, offset)
    if (dp := padding.needs_padding(q, k, v, ndim=3)) is not None:  # a head dim without tiles: gemmgen.ops.padding
        res = fused_attention_varlen(padding.pad(q, dp), padding.pad(k, dp), padding.pad(v, dp), cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                     scale=padding.default_scale(scale, q.shape[-1]), return_lse=return_lse,
                                     instance=instance, dropout_p=dropout_p, seed=seed, offset=offset,
                                     causal_alignment=causal_alignment, window=window, softcap=softcap,
                                     deterministic=deterministic)
        o, lse = res if return_lse else (res, None)
        o = padding.cut(o, q)
        return (o, lse) if return_lse else o
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    direct = eager.runs_directly(*tensors)
    checked = direct and eager.signature(*tensors)  # 3-D q: never a fused_attention signature
    known = checked and checked in _CHECKED
    if known:
        _check_pointers(q, k, v, None)
    else:
        _check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
    # The offsets' values against the sizes (read once per tensor version: gemmgen.ops.offsets).
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if not known:
        _check_device(q, k, v, None)
        if checked:
            _CHECKED.add(checked)
    training = not direct and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if training and dropout_p > 0.0 and seed is None:  # the backward regenerates the forward's mask
        draws = (cu_seqlens_q.shape[0] - 1) * q.shape[1] * max_seqlen_q * max_seqlen_k
        seed, base = launch.draw_seed(q.get_device(), draws)
        offset += base
    if direct:
        op = torch_op.run_fused_attention_varlen
    elif training and eager.runs_eagerly(*tensors):
        op = torch_op.run_fused_attention_varlen_training
    else:
        op = torch_op.fused_attention_varlen_op
    o, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), scale,
                return_lse or training, instance, dropout_p, seed, offset, causal_alignment,
                None if window is None else list(window), softcap, bool(deterministic))
    return (o, lse) if return_lse else o


def _check_fp8_explained(q, k, v, *, dropout_p=0.0, attn_mask=None, window=None, softcap=0.0) -> None:
    """explain / selected_instance of fp8 tensors: the checks of the call they describe."""
    fp8.check_unsupported((("dropout_p", dropout_p, 0.0), ("attn_mask", attn_mask, None), ("window", window, None),
                           ("softcap", softcap, 0.0)))
    fp8.validate(q, k, v)
    fp8.check_device(q, k, v, ())


def _call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, causal_alignment: str,
                  instance: str | None, dropout_p: float, attn_mask: torch.Tensor | None,
                  window: tuple[int, int] | None, softcap: float):
    """The Problem fused_attention selects for with these arguments (checked as it checks them): a
    head dim without tiles as the padded call it runs (gemmgen.ops.padding)."""
    check_bool("causal", causal)
    check_instance(instance)
    _check_args(causal_alignment, None)
    causal, window = check_window(window, causal)
    softcap = check_softcap(softcap)
    if fp8.is_fp8(q, k, v):  # the fp8 call: no mask tensor, dropout, window or softcap
        _check_fp8_explained(q, k, v, dropout_p=dropout_p, attn_mask=attn_mask, window=window, softcap=softcap)
        return calls.problem_for(q, k, causal, v=v, causal_alignment=causal_alignment)
    if (dp := padding.needs_padding(q, k, v)) is not None:  # the padded call it runs
        q, k, v = (padding.pad(t, dp) for t in (q, k, v))
    _validate(q, k, v, None, device=False)
    dropout_p = _check_dropout(dropout_p, None, 0)
    _check_mask(attn_mask, q, k)
    _check_device(q, k, v, None)
    bias = _prepare_mask(attn_mask, q, k)
    return calls.problem_for(q, k, causal, v=v, causal_alignment=causal_alignment, dropout=dropout_p > 0.0,
                             bias=bias, window=window, softcap=softcap > 0)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            causal_alignment: str = "top_left", instance: str | None = None, dropout_p: float = 0.0,
            attn_mask: torch.Tensor | None = None, window: tuple[int, int] | None = None,
            softcap: float = 0.0) -> selection.Decision:
    """The decision fused_attention makes for these tensors: candidates, rejects with their reasons,
    winner and its source (decision.report() gives the text `gemmgen explain` prints). A head dim
    without tiles is explained as the padded call it runs (gemmgen.ops.padding)."""
    problem = _call_problem(q, k, v, causal, causal_alignment, instance, dropout_p, attn_mask, window, softcap)
    return selection.decide(problem, instance)


def selected_instance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      causal_alignment: str = "top_left", instance: str | None = None, dropout_p: float = 0.0,
                      attn_mask: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                      softcap: float = 0.0) -> str:
    """The name of the instance fused_attention would run for these tensors and arguments."""
    problem = _call_problem(q, k, v, causal, causal_alignment, instance, dropout_p, attn_mask, window, softcap)
    return selection.select(problem, instance).name
