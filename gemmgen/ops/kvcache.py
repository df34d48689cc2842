"""fused_attention_with_kvcache: attention of new query rows against a key-value cache (decode,
speculative decoding, chunked prefill), contiguous or paged, with the new tokens' keys and values
appended in place first. Validates, then calls the gemmgen::fused_attention_with_kvcache custom op,
which selects a key-value-cache instance (the decode family) and launches it."""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gemmgen.errors import InputError
from gemmgen.generator import space
from gemmgen.generator.space import FAMILIES
from gemmgen.ops import eager, torch_op
from gemmgen.ops.attention import ALIGN_ELEMENTS, DTYPES, INT32_MAX, _check_device
from gemmgen.ops.checks import check_bool, check_finite, check_instance, check_window
from gemmgen.ops.grad import check_no_grad
from gemmgen.select.problem import ALIGN_BYTES

_CHECKED = eager.Checked()  # the call signatures whose metadata checks passed


def kv_cache_head_dims() -> tuple[int, ...]:
    """The head dims some family with a key-value cache (PACKS_GQA) serves (computed once per
    version of the family list, not on every call)."""
    return _kv_cache_head_dims(space.version())


@functools.lru_cache(maxsize=1)
def _kv_cache_head_dims(_families_version: int) -> tuple[int, ...]:
    return tuple(sorted({d for f in FAMILIES if getattr(f, "PACKS_GQA", False) for d in f.HEAD_DIMS}))


def _check_bnhd(name: str, t: torch.Tensor) -> None:
    """A [batch-or-pages, rows, heads, head_dim] tensor: last dim contiguous, other strides multiples
    of 8 elements (16 bytes)."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape, stride = t.shape, t.stride()  # read once: this runs on every decode step
    if len(shape) != 4:
        raise InputError(f"{name} must be 4-D; got shape {tuple(shape)}")
    if shape[3] > 1 and stride[3] != 1:
        raise InputError(f"{name} must be contiguous in its last dim (head_dim); its strides are {stride}")
    for n, st in zip(shape[:3], stride[:3]):
        if n > 1 and st % ALIGN_ELEMENTS:
            raise InputError(f"{name}'s strides {stride} must be multiples of {ALIGN_ELEMENTS} elements "
                             f"(16 bytes) outside the last dim")
    if max(shape) > INT32_MAX:
        raise InputError(f"{name}'s sizes must fit in int32; got {tuple(t.shape)}")


def _check_int32_vector(name: str, t: torch.Tensor, rows: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise InputError(f"{name} must be a torch.int32 tensor; got {getattr(t, 'dtype', type(t).__name__)}")
    if rows is not None and (t.dim() != 1 or t.shape[0] != rows):
        raise InputError(f"{name} must be 1-D with one entry per sequence ({rows}); got shape {tuple(t.shape)}")


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, k, v) -> tuple[int, int]:
    """Metadata checks (traceable); returns (capacity in keys per sequence, page size or 0)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_bnhd(name, t)
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype not in DTYPES:
        raise InputError(f"q, k_cache, v_cache must share one dtype among torch.float16, torch.bfloat16; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise InputError(f"k_cache and v_cache must have one shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    b, nq, h, d = q.shape
    pages_or_b, rows, hkv, dk = k_cache.shape
    head_dims = kv_cache_head_dims()
    if d != dk or d not in head_dims:
        raise InputError(f"head_dim must be equal across q and the caches and one of {head_dims}; got {d} and {dk}")
    if hkv == 0 or h % hkv:
        raise InputError(f"the caches' heads ({hkv}) must divide q's ({h}) (GQA/MQA)")
    _check_int32_vector("cache_seqlens", cache_seqlens, b)
    if b > 1 and cache_seqlens.stride(0) != 1:
        raise InputError(f"cache_seqlens must be contiguous; its stride is {cache_seqlens.stride(0)}")
    if block_table is None:
        if pages_or_b != b:
            raise InputError(f"a contiguous cache is [batch, max_seqlen, heads_kv, head_dim] with q's batch {b}; "
                             f"got {tuple(k_cache.shape)} (a paged cache needs block_table)")
        capacity, page_size = rows, 0
    else:
        _check_int32_vector("block_table", block_table)
        if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] < 1:
            raise InputError(f"block_table must be [batch, max_pages] int32 with q's batch {b}; got shape "
                             f"{tuple(block_table.shape)}")
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            raise InputError(f"block_table's rows must be contiguous; its strides are {tuple(block_table.stride())}")
        capacity, page_size = block_table.shape[1] * rows, rows
    if (k is None) != (v is None):
        raise InputError("k and v (the new tokens) go together: pass both or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_bnhd(name, t)
            if t.dtype != q.dtype or tuple(t.shape) != (b, t.shape[1], hkv, d):
                raise InputError(f"{name} must be [batch {b}, new tokens, heads_kv {hkv}, head_dim {d}] in q's "
                                 f"dtype; got {tuple(t.shape)} {t.dtype}")
        if k.shape[1] != v.shape[1]:
            raise InputError(f"k and v must hold the same number of new tokens; got {k.shape[1]} and {v.shape[1]}")
    return capacity, page_size


def _has_memory(*tensors: torch.Tensor | None) -> bool:
    return not torch.compiler.is_compiling() and not any(isinstance(t, FakeTensor) for t in tensors)


def _check_values(cache_seqlens, block_table, new: int, capacity: int, pages: int) -> None:
    """The checks that read the lengths and the block table (a host sync): outside graph capture
    only, where an out-of-range index would otherwise fault on the GPU."""
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lengths = cache_seqlens.to("cpu", torch.int64)
    if lengths.numel() and (lengths.min() < 0 or lengths.max() + new > capacity):
        raise InputError(f"cache_seqlens + new tokens must lie in [0, {capacity}] (the cache's capacity); got "
                         f"lengths {lengths.min().item()} to {lengths.max().item()} with {new} new tokens")
    if block_table is not None and lengths.numel():
        page_size = capacity // block_table.shape[1]
        used = (lengths + new + page_size - 1) // page_size  # pages each sequence reads
        table = block_table.to("cpu", torch.int64)
        cols = torch.arange(table.shape[1])
        live = cols[None, :] < used[:, None]
        bad = live & ((table < 0) | (table >= pages))
        if bad.any():
            b, j = (int(x) for x in bad.nonzero()[0])
            raise InputError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the cache "
                             f"(0 to {pages - 1})")


def fused_attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                                 k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                                 causal: bool = True, scale: float | None = None, return_lse: bool = False,
                                 check_values: bool = False, instance: str | None = None,
                                 window: tuple[int, int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q's new rows against a key-value cache, FlashAttention's flash_attn_with_kvcache.

    q: [B, Nq, H, d] (FlashAttention's layout: a [B, H, Nq, d] tensor passes as x.transpose(1, 2)).
    k_cache, v_cache: contiguous [B, Nmax, Hkv, d], or paged [num_pages, page_size, Hkv, d] with
    block_table [B, max_pages] int32 (key t of sequence b is row t % page_size of page
    block_table[b, t // page_size]; any page size, 16 to 256 tested). Any strides with a contiguous
    last dim (a [B, Hkv, Nmax, d] cache passes as x.transpose(1, 2)). cache_seqlens [B] int32: the
    keys each sequence holds (0 allowed). k, v [B, Nnew, Hkv, d]: new tokens written into the caches
    in place at rows cache_seqlens[b] .. + Nnew - 1 before attending (cache_seqlens itself is not
    changed); sequence b then attends to its first cache_seqlens[b] + Nnew keys.

    causal (the default) aligns the mask bottom-right per sequence: query i of Nq sees keys
    j <= i + L_b - Nq, L_b the sequence's keys. window=(left, right) (FlashAttention's window_size)
    is a sliding window around that diagonal: keys i + L_b - Nq - left <= j <= i + L_b - Nq + right,
    a side of -1 unbounded (right 0 with causal); the decode family reads only the window's keys. scale defaults to 1/sqrt(d). Returns O [B, Nq, H, d]
    (a new tensor) and, with return_lse, the float32 natural-log LSE [B, H, Nq] (-inf and O = 0 for
    a row that sees no key). fp16 or bf16. Hkv divides H (GQA/MQA).

    Runs on the inputs' device and current stream as the torch custom op
    torch.ops.gemmgen.fused_attention_with_kvcache: torch.compile traces it and CUDA graphs capture
    it, with new cache_seqlens on each replay. The lengths and the block table stay on the GPU (no
    host sync per call): a sequence whose length (new tokens included) lies outside [0, capacity], or
    whose block table names a page the cache does not have, gets NaN rows in O and LSE, never a
    memory fault, and appending past the capacity is skipped for it. check_values=True reads them
    back first (a host sync; skipped under CUDA graph capture and torch.compile tracing) and raises
    InputError naming the bad length or entry. No gradients: inputs that require grad raise.
    Selection: the decode family's instances; the number of key splits per call is the registry's
    heuristic over the cache's capacity. A chunk of at least gemmgen.ops.torch_op.DENSE_CHUNK_ROWS
    query rows (chunked prefill) runs on a prefill family instead: against a contiguous cache in
    [B, Nmax, Hkv, d] storage order without a window, as packed sequences on fmha_sm90 (Hopper,
    the sm90 default build), which reads the lengths on the GPU (no host sync; graph capture runs
    it too); otherwise, outside CUDA-graph capture, as one dense bottom-right call per sequence on
    its keys (gathered from their pages for a paged cache), which reads the lengths and the pages
    used back to the host first (one copy per call). Both give the same NaN rows for bad lengths or
    pages, and never read a cache row past a sequence's keys.
    """
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_bool("check_values", check_values)
    check_instance(instance)
    scale = None if scale is None else check_finite("scale", scale)
    causal, window = check_window(window, causal)
    direct = eager.runs_directly(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    checked = direct and eager.signature(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    if not (checked and checked in _CHECKED):
        _validate(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
        check_no_grad("fused_attention_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        devices = {t.device for t in (q, k_cache, v_cache, cache_seqlens, block_table, k, v) if t is not None}
        if len(devices) > 1:
            raise InputError(f"every tensor must be on one device; got {', '.join(sorted(map(str, devices)))}")
        _check_device(q, k_cache, v_cache, None)
        if checked:
            _CHECKED.add(checked)
    if direct or _has_memory(q, k_cache, v_cache, cache_seqlens, block_table, k, v):
        pointers = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
        if k is not None:
            pointers |= k.data_ptr() | v.data_ptr()
        if pointers % ALIGN_BYTES:
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
                if t is not None and t.data_ptr() % ALIGN_BYTES:
                    raise InputError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned "
                                     f"(storage offset {t.storage_offset()})")
        if check_values:
            capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
            _check_values(cache_seqlens, block_table, 0 if k is None else k.shape[1], capacity, k_cache.shape[0])
    op = torch_op.run_fused_attention_with_kvcache if direct else torch_op.fused_attention_with_kvcache_op
    o, lse = op(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, scale, return_lse, instance,
                None if window is None else list(window))
    return (o, lse) if return_lse else o
