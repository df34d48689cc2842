"""From tensors to a launch: the output layout, the C ABI params, and running one compiled instance
on the inputs' device and current stream. (The selection problem of a call on tensors is
gemmgen.select.calls'.)"""
from __future__ import annotations

import math
from typing import Any

import torch

from gemmgen.kernels import abi

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
TORCH_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
# Input dtypes of the selection problem: the 16-bit ones, and fp8 (gemmgen.ops.fp8's calls only).
PROBLEM_DTYPES = {**DTYPE_NAMES, torch.float8_e4m3fn: "fp8"}

try:  # the raw cudaStream_t, without building a torch.cuda.Stream object (inductor uses the same)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # a torch build without CUDA
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def raw_stream(index: int) -> int:
    """The current torch stream of CUDA device `index` as a cudaStream_t (an int)."""
    return _raw_stream(index)


def empty_like_layout(q: torch.Tensor, shape: tuple[int, ...] | torch.Size | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor with q's dim order (q's layout, made dense), head_dim innermost, in
    `dtype` (q's by default).

    The real op and its fake implementation both allocate O through this, so they agree on strides.
    """
    if shape is None and q.is_contiguous():
        return torch.empty_like(q, dtype=dtype)
    shape = tuple(q.shape if shape is None else shape)
    order = sorted(range(3), key=lambda i: (-q.stride(i), i)) + [3]
    strides, step = [0] * 4, 1
    for i in reversed(order):
        strides[i], step = step, step * shape[i]
    return torch.empty_strided(shape, strides, dtype=q.dtype if dtype is None else dtype, device=q.device)


def max_offset(*tensors: torch.Tensor | None) -> int:
    """The largest element offset from its data pointer that any of `tensors` reaches, plus one.
    Every call computes it (a cache key holds whether it passes int32), so a dense tensor, whose
    reach is its element count, skips the sum over its dims."""
    best = 0
    for t in tensors:
        if t is None:
            continue
        n = t.numel()
        if n:
            best = max(best, n if t.is_contiguous() else sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1)
    return best


ALIGNMENTS = ("top_left", "bottom_right")


def check_alignment(causal_alignment: str) -> None:
    """Raise ValueError for an alignment that is not one of ALIGNMENTS."""
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment {causal_alignment!r}; supported: {', '.join(ALIGNMENTS)}")


def causal_offset(seqlen_q: int, seqlen_k: int, causal_alignment: str) -> int:
    """Key j is visible to query i iff j <= i + offset: 0 for top-left (torch), Nk - Nq for bottom-right."""
    check_alignment(causal_alignment)
    return 0 if causal_alignment == "top_left" else seqlen_k - seqlen_q


# causal_offset of a call without a mask: every key j <= i + INT32_MAX is visible. Families whose
# instances are causal or not read the offset only when causal; those serving both read it always.
NO_MASK_OFFSET = 2**31 - 1


def params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
           *, causal: bool, causal_alignment: str, scale: float | None, dropout_p: float = 0.0,
           seed: int = 0, offset: int = 0, bias: torch.Tensor | None = None,
           window: tuple[int, int] | None = None, softcap: float = 0.0) -> abi.AttnParams:
    """The C ABI params of one call (pointers, sizes, strides in elements, scale, causal offset, and
    the optional dropout, bias, sliding window and logit softcap; `bias` is [B, H, Nq, Nk] by its
    strides, 0 broadcasting; a `window` (left, right) lies around the diagonal of `causal_alignment`)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    p = abi.AttnParams(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr() if lse is not None else None,
        b, h, k.shape[1], nq, nk, d,
        qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
        1.0 / math.sqrt(d) if scale is None else float(scale),
        causal_offset(nq, nk, causal_alignment) if causal or window is not None else NO_MASK_OFFSET)
    _set_features(p, dropout_p, seed, offset)
    if window is not None:
        p.local, (p.window_left, p.window_right) = 1, window
    p.softcap = softcap
    if bias is not None:
        p.bias = bias.data_ptr()
        p.bias_batch_stride, p.bias_head_stride, p.bias_row_stride = bias.stride()[:3]
    return p


def params_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  *, causal: bool, scale: float | None, dropout_p: float = 0.0, seed: int = 0,
                  offset: int = 0, causal_alignment: str = "top_left", window: tuple[int, int] | None = None,
                  softcap: float = 0.0) -> abi.AttnParams:
    """The C ABI params of a variable-length call: packed q, o [Tq, H, d], k, v [Tk, Hkv, d]; LSE
    [B, H, max_seqlen_q]; the mask (causal or a `window`) aligned within each sequence by
    `causal_alignment` (bottom-right: abi.h's align_per_sequence)."""
    h, d = q.shape[1], q.shape[2]
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    p = abi.AttnParams(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr() if lse is not None else None,
        cu_seqlens_q.shape[0] - 1, h, k.shape[1], max_seqlen_q, max_seqlen_k, d,
        0, qs[1], qs[0], 0, ks[1], ks[0], 0, vs[1], vs[0], 0, os_[1], os_[0],
        1.0 / math.sqrt(d) if scale is None else float(scale), 0)
    _set_features(p, dropout_p, seed, offset)
    _set_varlen(p, cu_seqlens_q, cu_seqlens_k, causal, causal_alignment, window, softcap)
    p.total_q, p.total_k = q.shape[0], k.shape[0]
    return p


def _set_varlen(p: abi.AttnParams | abi.AttnBwdParams, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                causal: bool, causal_alignment: str, window: tuple[int, int] | None, softcap: float) -> None:
    """The offsets, mask and softcap of a variable-length call (forward or backward params)."""
    p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    check_alignment(causal_alignment)
    masked = causal or window is not None
    p.causal_offset = 0 if masked else NO_MASK_OFFSET
    p.align_per_sequence = int(masked and causal_alignment == "bottom_right")
    if window is not None:
        p.local, (p.window_left, p.window_right) = 1, window
    p.softcap = softcap


def _set_features(p: abi.AttnParams, dropout_p: float, seed: int, offset: int) -> None:
    if dropout_p > 0.0:
        p.dropout_p, p.dropout_seed, p.dropout_offset = dropout_p, seed, offset


def _triple(t: torch.Tensor) -> tuple[int, int, int]:
    s = t.stride()
    return s[0], s[1], s[2]


def params_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, d_o: torch.Tensor,
               lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, causal: bool,
               causal_alignment: str, scale: float | None, dropout_p: float = 0.0, seed: int = 0,
               offset: int = 0, bias: torch.Tensor | None = None, dbias: torch.Tensor | None = None,
               deterministic: bool = False, window: tuple[int, int] | None = None,
               softcap: float = 0.0) -> abi.AttnBwdParams:
    """The C ABI params of one backward call (all [B, H, N, d] by their strides; K and V with Q's
    heads, or with their own for an instance that reads GQA (dK and dV then with Q's heads); LSE the
    forward's [B, H, Nq] float32; `window` the forward's sliding window, around the diagonal of
    `causal_alignment`; `softcap` its logit softcap); the workspace is set by bwd_workspace."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    p = _bwd_pointers(q, k, v, o, d_o, lse, dq, dk, dv)
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = b, h, k.shape[1], nq, nk, d
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", d_o), ("dq", dq), ("dk", dk), ("dv", dv)):
        for dim, stride in zip(("batch", "head", "row"), _triple(t)):
            setattr(p, f"{name}_{dim}_stride", stride)
    p.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    p.causal_offset = (
        causal_offset(nq, nk, causal_alignment) if causal or window is not None else NO_MASK_OFFSET)
    if window is not None:
        p.local, (p.window_left, p.window_right) = 1, window
    p.softcap = softcap
    if bias is not None:
        p.bias = bias.data_ptr()
        p.bias_batch_stride, p.bias_head_stride, p.bias_row_stride = _triple(bias)
    if dbias is not None:
        p.dbias = dbias.data_ptr()
        p.dbias_batch_stride, p.dbias_head_stride, p.dbias_row_stride = _triple(dbias)
    _set_features(p, dropout_p, seed, offset)
    p.deterministic = int(deterministic)
    return p


def params_bwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, d_o: torch.Tensor,
                      lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      *, causal: bool, scale: float | None, dropout_p: float = 0.0, seed: int = 0,
                      offset: int = 0, causal_alignment: str = "top_left", window: tuple[int, int] | None = None,
                      softcap: float = 0.0, deterministic: bool = False) -> abi.AttnBwdParams:
    """The C ABI params of a variable-length backward call: packed q, o, d_o, dq [Tq, H, d] and k, v
    [Tk, H or Hkv, d] (Hkv for an instance that reads GQA), dk, dv [Tk, H, d], sequence b at rows
    cu_seqlens_q[b] (cu_seqlens_k[b]) on; LSE the forward's [B, H, max_seqlen_q] float32. Batch
    strides stay 0: with cu_seqlens the kernel places a sequence by its first row, as the forward
    (params_varlen) does. The mask, alignment, softcap, dropout_p, seed and offset are the forward's;
    deterministic asks for dQ added in key-tile order."""
    p = _bwd_pointers(q, k, v, o, d_o, lse, dq, dk, dv)
    d = q.shape[2]
    p.batch, p.heads, p.heads_kv = cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1]
    p.seqlen_q, p.seqlen_k, p.head_dim = max_seqlen_q, max_seqlen_k, d
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", d_o), ("dq", dq), ("dk", dk), ("dv", dv)):
        setattr(p, f"{name}_head_stride", t.stride(1))
        setattr(p, f"{name}_row_stride", t.stride(0))
    p.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _set_features(p, dropout_p, seed, offset)
    _set_varlen(p, cu_seqlens_q, cu_seqlens_k, causal, causal_alignment, window, softcap)
    p.total_q, p.total_k = q.shape[0], k.shape[0]
    p.deterministic = int(deterministic)
    return p


def _bwd_pointers(q, k, v, o, d_o, lse, dq, dk, dv) -> abi.AttnBwdParams:
    """Backward params with the tensors' data pointers set (everything else zero)."""
    p = abi.AttnBwdParams()
    set_bwd_pointers(p, q, k, v, o, d_o, lse, dq, dk, dv)
    return p


def set_bwd_pointers(p: abi.AttnBwdParams, q, k, v, o, d_o, lse, dq, dk, dv, bias=None, dbias=None) -> None:
    """Set one backward call's data pointers in `p` (params_bwd's params, or a copy of another
    call's with the same key): the tensors', and the mask's and its gradient's where given."""
    p.q, p.k, p.v, p.o, p.d_o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr()
    p.lse, p.dq, p.dk, p.dv = lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if bias is not None:
        p.bias = bias.data_ptr()
    if dbias is not None:
        p.dbias = dbias.data_ptr()


def expanded_layout(t: torch.Tensor, group: int, device: str | torch.device | None = None) -> torch.Tensor:
    """An uninitialized [B, Hkv * group, N, d] tensor in t's dim order (t itself when group is 1);
    on the "meta" device it has the strides without the memory (for selecting a kernel)."""
    if group == 1:
        return t
    b, hkv, n, d = t.shape
    return empty_like_layout(t.to("meta") if device == "meta" else t, (b, hkv * group, n, d))


def expand_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """K or V with Q's heads, in t's layout: query head h reads key/value head h // group (for the
    backward instances that do not read GQA, abi.INFO_READS_GQA)."""
    if group == 1:
        return t
    b, hkv, n, d = t.shape
    out = expanded_layout(t, group)
    out.unflatten(1, (hkv, group)).copy_(t.unsqueeze(2).expand(b, hkv, group, n, d))
    return out


def bwd_workspace(kernel: Any, p: abi.AttnBwdParams, index: int) -> torch.Tensor:
    """A workspace of the size the backward instance asks for, from torch's caching allocator
    (freed in stream order; captured like any allocation inside a CUDA graph), set in `p`; the
    caller keeps the tensor alive while `p` is launched."""
    return _set_workspace(p, kernel.workspace_bytes(p), index)


def _set_workspace(p: Any, size: int, index: int) -> torch.Tensor:
    """`size` bytes from torch's caching allocator on device `index`, 256-byte aligned, set as
    p.workspace / p.workspace_bytes; the caller holds the returned tensor while `p` is launched."""
    workspace = torch.empty(max(size, 1) + 256, dtype=torch.uint8, device=device(index))
    base = workspace.data_ptr()
    p.workspace, p.workspace_bytes = base + (-base % 256), size
    return workspace


def run_bwd(kernel: Any, p: abi.AttnBwdParams, index: int, workspace_bytes: int | None = None) -> None:
    """Run the backward instance `kernel` with `p` on CUDA device `index` and its current stream,
    with a workspace made for the call: `workspace_bytes` (what the kernel asked of params with the
    same sizes), else bwd_workspace's."""
    with torch.cuda.device(index):
        workspace = (bwd_workspace(kernel, p, index) if workspace_bytes is None
                     else _set_workspace(p, workspace_bytes, index))
        kernel.run(p, _raw_stream(index))
        del workspace  # freed in stream order, after the launch


def draw_seed(index: int, draws: int) -> tuple[int, int]:
    """(seed, offset) for dropout from torch's CUDA generator of device `index`, advancing it past
    `draws` 32-bit Philox outputs, so that torch.manual_seed makes the masks reproducible."""
    gen = torch.cuda.default_generators[index]
    base = gen.get_offset()
    try:
        gen.set_offset(base + -(-draws // 4) * 4)
    except RuntimeError:  # a generator in CUDA graph capture: the captured call keeps its mask
        pass
    return gen.initial_seed(), base


# Eager forward calls reuse one workspace per (device, stream), as torch keeps one cuBLAS workspace
# per handle and stream: the calls of one stream run in order, so a call's kernels start after the
# previous call's are done with it (a split decode call spent 5-7 us of its host path on the
# allocation, bench/NOTES.md, experiment 95). Under CUDA-graph capture, and above this size, each
# call gets its own from torch's caching allocator (the graph's pool keeps a captured one).
STREAM_WORKSPACE_BYTES = 16 << 20
_stream_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_devices: dict[int, torch.device] = {}
_capturing = torch._C._cuda_isCurrentStreamCapturing if hasattr(torch._C, "_cuda_isCurrentStreamCapturing") \
    else torch.cuda.is_current_stream_capturing
_current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device


def device(index: int) -> torch.device:
    """torch.device("cuda", index), made once per index."""
    dev = _devices.get(index)
    if dev is None:
        dev = _devices[index] = torch.device("cuda", index)
    return dev


def _stream_workspace(p: Any, size: int, index: int, stream: int) -> None:
    """Set p.workspace to `size` bytes (256-byte aligned, at most STREAM_WORKSPACE_BYTES) of the
    workspace kept for this device and stream, grown to the next power of two (capped) when short."""
    buf = _stream_workspaces.get((index, stream))
    if buf is None or buf.numel() < size + 256:
        _stream_workspaces.pop((index, stream), None)  # the old buffer goes back to the allocator first
        want = min(max(1 << (size + 255).bit_length(), 1 << 16), STREAM_WORKSPACE_BYTES + 256)
        buf = torch.empty(want, dtype=torch.uint8, device=device(index))
        _stream_workspaces[(index, stream)] = buf
    base = buf.data_ptr()
    p.workspace, p.workspace_bytes = base + (-base % 256), size


def release_stream_workspaces() -> None:
    """Hand the workspaces kept per (device, stream) back to torch's caching allocator."""
    _stream_workspaces.clear()


def launch(kernel: Any, p: abi.AttnParams, index: int, workspace_bytes: int | None = None, *,
           owned: bool = False) -> None:
    """Run `kernel` with `p` on CUDA device `index` and its current stream. A kernel that always
    writes LSE (its info flags say so) gets a scratch buffer when the caller wants none; the call
    then runs on a copy of `p` unless `owned` (the caller made `p` for this call only), so a caller
    that launches the same params again (the tuner) never hands the kernel this call's buffer after
    it is freed. `workspace_bytes`: what the kernel's workspace entry point says for `p` (asked when
    None); outside CUDA-graph capture it comes from the stream's kept workspace."""
    if not p.lse and kernel.needs_lse:
        scratch = torch.empty(p.batch * p.heads * p.seqlen_q, dtype=torch.float32, device=device(index))
        if not owned:
            p = type(p).from_buffer_copy(p)
            owned = True
        p.lse = scratch.data_ptr()  # the caching allocator reuses it only after this stream's work
    if workspace_bytes is None:
        workspace_bytes = kernel.workspace_bytes(p)
    if workspace_bytes > 0:  # split-KV partial rows, a mask's tile lists
        if not owned:
            p = type(p).from_buffer_copy(p)
        # The kept buffer only where the call's device is the current one, whose stream _capturing() asks.
        if workspace_bytes <= STREAM_WORKSPACE_BYTES and _current_device() == index and not _capturing():
            _stream_workspace(p, workspace_bytes, index, _raw_stream(index))
        else:  # freed after this stream's work
            workspace = _set_workspace(p, workspace_bytes, index)  # noqa: F841 (alive until the launch)
    if _current_device() == index:
        kernel.run(p, _raw_stream(index))
    else:
        with torch.cuda.device(index):
            kernel.run(p, _raw_stream(index))


# Key-value caches (fused_attention_with_kvcache): q, o [B, Nq, H, d]; caches [B or pages, rows, Hkv, d].
def kv_append_args(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                   block_table: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, capacity: int) -> abi.KvAppendArgs:
    """The append entry point's args: k, v [B, Nnew, Hkv, d] go to each sequence's rows
    cache_seqlens[b] .. + Nnew - 1 (indices stay on the GPU: no host sync, CUDA graphs capture it)."""
    a = abi.KvAppendArgs(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr(),
                         block_table.data_ptr() if block_table is not None else None,
                         block_table.stride(0) if block_table is not None else 0,
                         k.shape[0], k.shape[1], k.shape[2], k.shape[3], capacity,
                         k_cache.shape[1] if block_table is not None else 0,
                         k_cache.shape[0], k.element_size())
    for name, t in (("k", k), ("v", v), ("kc", k_cache), ("vc", v_cache)):
        s0, s1, s2, _ = t.stride()
        setattr(a, f"{name}_batch_stride", s0)
        setattr(a, f"{name}_row_stride", s1)
        setattr(a, f"{name}_head_stride", s2)
    return a


def params_kvcache(q, k_cache, v_cache, seqlens, block_table, o, lse, *, causal: bool, scale: float | None,
                   capacity: int, window: tuple[int, int] | None = None) -> abi.AttnParams:
    """The C ABI params of a key-value-cache call (q, o [B, Nq, H, d]; seqlens the keys of each
    sequence, new tokens included); the causal mask and a window lie around each sequence's
    bottom-right diagonal."""
    qt, ot = q.transpose(1, 2), o.transpose(1, 2)  # [B, H, Nq, d] views for the ABI
    kt, vt = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    p = params(qt, kt, vt, ot, lse, causal=False, causal_alignment="top_left", scale=scale, window=window)
    p.seqlen_k = capacity
    p.causal_offset = capacity - q.shape[1] if causal or window is not None else NO_MASK_OFFSET
    p.seqlens_k = seqlens.data_ptr()
    if block_table is not None:
        p.block_table = block_table.data_ptr()
        p.block_table_batch_stride = block_table.stride(0)
        p.page_size = k_cache.shape[1]
        p.num_pages = k_cache.shape[0]
    return p
