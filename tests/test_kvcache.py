"""fused_attention_with_kvcache without a GPU: every bad argument raises InputError naming the problem
before the device check (a well-formed call on CPU tensors reaches DeviceError), the value checks on
lengths and block tables (check_values=True), the C ABI args of a call and of its append of new keys
and values, and the selection side: the split-KV heuristic, which families take key-value-cache
problems, and the decode_sm80 family's instances. tests/gpu/test_decode_gpu.py runs the kernels."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import gemmgen
from conftest import make_entry, write_build_dir
from gemmgen.errors import DeviceError, InputError
from gemmgen.generator.families import decode_sm80, fa2_sm80, fmha_sm90, mea_sm80
from gemmgen.generator.families.base import DType
from gemmgen.generator.families.decode_sm80 import DecodeSm80Instance
from gemmgen.kernels import launch
from gemmgen.ops import kvcache
from gemmgen.select import device, heuristic, registry, selection
from gemmgen.select.problem import Problem
from gemmgen.select.registry import Candidate

FP16, BF16 = torch.float16, torch.bfloat16
I32 = torch.int32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=FP16, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)).to(dtype)


def inputs(b=2, nq=3, h=8, hkv=2, d=64, nmax=40, dtype=FP16, page_size=None, max_pages=3, num_pages=None,
           nnew=0, seed=0):
    """q [B, Nq, H, d], caches (contiguous [B, Nmax, Hkv, d] or paged [pages, page_size, Hkv, d] with a
    block table), cache_seqlens, and new k, v when nnew > 0; a dict of the public function's args."""
    args = {"q": randn(b, nq, h, d, dtype=dtype, seed=seed)}
    if page_size is None:
        shape = (b, nmax, hkv, d)
        args["block_table"] = None
    else:
        num_pages = num_pages or b * max_pages + 1
        shape = (num_pages, page_size, hkv, d)
        args["block_table"] = torch.randperm(num_pages, generator=gen(seed + 1))[:b * max_pages].view(
            b, max_pages).to(I32)
    args["k_cache"] = randn(*shape, dtype=dtype, seed=seed + 2)
    args["v_cache"] = randn(*shape, dtype=dtype, seed=seed + 3)
    args["cache_seqlens"] = torch.zeros(b, dtype=I32)
    if nnew:
        args["k"] = randn(b, nnew, hkv, d, dtype=dtype, seed=seed + 4)
        args["v"] = randn(b, nnew, hkv, d, dtype=dtype, seed=seed + 5)
    return args


def call(args: dict, **kw):
    a = {**args, **kw}
    return gemmgen.fused_attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                                                a.pop("cache_seqlens"), **a)


def misaligned(shape, pad=4, dtype=FP16):
    """A [.., d] tensor sliced from rows of d + pad elements: its outer strides are not multiples of 8."""
    *outer, d = shape
    return randn(*outer, d + pad, dtype=dtype)[..., :d]


def strided_last(shape, dtype=FP16):
    """A [.., d] tensor whose last dim has stride 2."""
    *outer, d = shape
    return randn(*outer, 2 * d, dtype=dtype)[..., ::2]


# ---- argument validation ----------------------------------------------------------------------------

# (id, changes to the well-formed args or a function of them, the message's words)
BAD = [
    ("q not a tensor", {"q": [[1.0]]}, "q must be a torch.Tensor, got list"),
    ("q 3-D", lambda a: {"q": a["q"][0]}, r"q must be 4-D; got shape \(3, 8, 64\)"),
    ("k_cache 5-D", lambda a: {"k_cache": a["k_cache"][None]}, r"k_cache must be 4-D; got shape \(1, 2, 40, 2, 64\)"),
    ("v_cache 3-D", lambda a: {"v_cache": a["v_cache"][0]}, "v_cache must be 4-D"),
    ("q bf16, caches fp16", lambda a: {"q": a["q"].to(BF16)},
     "q, k_cache, v_cache must share one dtype among torch.float16, torch.bfloat16; got torch.bfloat16, "
     "torch.float16, torch.float16"),
    ("v_cache bf16", lambda a: {"v_cache": a["v_cache"].to(BF16)}, "must share one dtype"),
    ("float32 everywhere", lambda a: {n: a[n].float() for n in ("q", "k_cache", "v_cache")},
     "must share one dtype among torch.float16, torch.bfloat16; got torch.float32"),
    ("k_cache and v_cache shapes differ", lambda a: {"v_cache": a["v_cache"][:, :32]},
     r"k_cache and v_cache must have one shape; got \(2, 40, 2, 64\) and \(2, 32, 2, 64\)"),
    ("head_dim 72 (no decode instance)", lambda a: {n: randn(*a[n].shape[:3], 72) for n in ("q", "k_cache", "v_cache")},
     r"head_dim must be equal across q and the caches and one of \(32, 64, 96, 128, 160, 192, 256\); got 72 and 72"),
    ("head_dim of q 64, caches 128", lambda a: {n: randn(*a[n].shape[:3], 128) for n in ("k_cache", "v_cache")},
     "head_dim must be equal across q and the caches .*; got 64 and 128"),
    ("Hkv 3 does not divide H 8", lambda a: {n: randn(2, 40, 3, 64) for n in ("k_cache", "v_cache")},
     r"the caches' heads \(3\) must divide q's \(8\)"),
    ("Hkv 0", lambda a: {n: randn(2, 40, 0, 64) for n in ("k_cache", "v_cache")}, r"the caches' heads \(0\)"),
    ("cache_seqlens int64", lambda a: {"cache_seqlens": a["cache_seqlens"].long()},
     "cache_seqlens must be a torch.int32 tensor; got torch.int64"),
    ("cache_seqlens a list", {"cache_seqlens": [0, 0]}, "cache_seqlens must be a torch.int32 tensor; got list"),
    ("cache_seqlens one entry too many", {"cache_seqlens": torch.zeros(3, dtype=I32)},
     r"cache_seqlens must be 1-D with one entry per sequence \(2\); got shape \(3,\)"),
    ("cache_seqlens 2-D", {"cache_seqlens": torch.zeros(2, 1, dtype=I32)},
     r"cache_seqlens must be 1-D with one entry per sequence \(2\); got shape \(2, 1\)"),
    ("cache_seqlens 0-D", {"cache_seqlens": torch.tensor(0, dtype=I32)}, "cache_seqlens must be 1-D"),
    ("paged cache without block_table", lambda a: {n: randn(7, 16, 2, 64) for n in ("k_cache", "v_cache")},
     r"a contiguous cache is \[batch, max_seqlen, heads_kv, head_dim\] with q's batch 2; got \(7, 16, 2, 64\) "
     r"\(a paged cache needs block_table\)"),
    ("block_table int64", {"block_table": torch.zeros(2, 3, dtype=torch.int64)},
     "block_table must be a torch.int32 tensor; got torch.int64"),
    ("block_table 1-D", {"block_table": torch.zeros(6, dtype=I32)},
     r"block_table must be \[batch, max_pages\] int32 with q's batch 2; got shape \(6,\)"),
    ("block_table 3-D", {"block_table": torch.zeros(2, 3, 1, dtype=I32)}, r"block_table must be \[batch, max_pages\]"),
    ("block_table of another batch", {"block_table": torch.zeros(3, 3, dtype=I32)},
     r"block_table must be \[batch, max_pages\] int32 with q's batch 2; got shape \(3, 3\)"),
    ("block_table without pages", {"block_table": torch.zeros(2, 0, dtype=I32)},
     r"block_table must be \[batch, max_pages\] .*got shape \(2, 0\)"),
    ("block_table a list", {"block_table": [[0], [1]]}, "block_table must be a torch.int32 tensor; got list"),
    ("block_table rows not contiguous", {"block_table": torch.zeros(3, 2, dtype=I32).t()},
     r"block_table's rows must be contiguous; its strides are \(1, 2\)"),
    ("k without v", lambda a: {"k": randn(2, 1, 2, 64)},
     r"k and v \(the new tokens\) go together: pass both or neither"),
    ("v without k", lambda a: {"v": randn(2, 1, 2, 64)}, r"k and v \(the new tokens\) go together"),
    ("k 3-D", lambda a: {"k": randn(2, 2, 64), "v": randn(2, 2, 64)}, "k must be 4-D"),
    ("k with Hkv + 1 heads", lambda a: {"k": randn(2, 1, 3, 64), "v": randn(2, 1, 2, 64)},
     r"k must be \[batch 2, new tokens, heads_kv 2, head_dim 64\] in q's dtype; got \(2, 1, 3, 64\) torch.float16"),
    ("k of another batch", lambda a: {"k": randn(1, 1, 2, 64), "v": randn(1, 1, 2, 64)}, r"k must be \[batch 2,"),
    ("k of another head_dim", lambda a: {"k": randn(2, 1, 2, 32), "v": randn(2, 1, 2, 32)}, "head_dim 64"),
    ("v bf16", lambda a: {"k": randn(2, 1, 2, 64), "v": randn(2, 1, 2, 64, dtype=BF16)},
     r"v must be \[batch 2, new tokens, heads_kv 2, head_dim 64\] in q's dtype; got \(2, 1, 2, 64\) torch.bfloat16"),
    ("k, v with different new tokens", lambda a: {"k": randn(2, 2, 2, 64), "v": randn(2, 3, 2, 64)},
     "k and v must hold the same number of new tokens; got 2 and 3"),
    ("q last dim strided", {"q": strided_last((2, 3, 8, 64))},
     r"q must be contiguous in its last dim \(head_dim\); its strides are \(3072, 1024, 128, 2\)"),
    ("k_cache last dim strided", {"k_cache": strided_last((2, 40, 2, 64)), "v_cache": randn(2, 40, 2, 64)},
     "k_cache must be contiguous in its last dim"),
    ("v_cache last dim strided", {"v_cache": strided_last((2, 40, 2, 64))},
     "v_cache must be contiguous in its last dim"),
    ("k last dim strided", lambda a: {"k": strided_last((2, 1, 2, 64)), "v": randn(2, 1, 2, 64)},
     "k must be contiguous in its last dim"),
    ("q strides not multiples of 8", {"q": misaligned((2, 3, 8, 64))},
     r"q's strides \(1632, 544, 68, 1\) must be multiples of 8 elements \(16 bytes\) outside the last dim"),
    ("k_cache strides not multiples of 8", {"k_cache": misaligned((2, 40, 2, 64)), "v_cache": randn(2, 40, 2, 64)},
     r"k_cache's strides \(5440, 136, 68, 1\) must be multiples of 8"),
    ("v_cache strides not multiples of 8", {"v_cache": misaligned((2, 40, 2, 64))}, "v_cache's strides"),
    ("v strides not multiples of 8", lambda a: {"k": randn(2, 2, 2, 64), "v": misaligned((2, 2, 2, 64))},
     "v's strides .* must be multiples of 8"),
    ("causal='yes'", {"causal": "yes"}, "causal must be a bool"),
    ("causal=1", {"causal": 1}, "causal must be a bool"),
    ("return_lse=None", {"return_lse": None}, "return_lse must be a bool"),
    ("scale=nan", {"scale": float("nan")}, "scale must be finite"),
    ("scale='x'", {"scale": "x"}, "scale must be a float"),
    ("check_values='yes'", {"check_values": "yes"}, "check_values must be a bool"),
    ("instance=3", {"instance": 3}, "instance must be an instance name"),
    ("q requires grad", lambda a: {"q": a["q"].clone().requires_grad_()},
     "fused_attention_with_kvcache has no backward pass: q requires grad"),
    ("cache_seqlens on another device", {"cache_seqlens": torch.zeros(2, dtype=I32, device="meta")},
     "every tensor must be on one device; got cpu, meta"),
    ("q on another device", lambda a: {"q": a["q"].to("meta")}, "every tensor must be on one device; got cpu, meta"),
    ("sizes past int32", {"k_cache": torch.empty(2, 2**31, 2, 64, dtype=FP16, device="meta")},
     r"k_cache's sizes must fit in int32; got \(2, 2147483648, 2, 64\)"),
]


@pytest.mark.parametrize("change, match", [(c, m) for _, c, m in BAD], ids=[i for i, _, _ in BAD])
def test_bad_arguments_raise_input_error_before_the_device_check(change, match):
    args = inputs()
    changes = change(args) if callable(change) else change
    with pytest.raises(InputError, match=match):
        call(args, **changes)


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("nnew", [0, 1, 5])
def test_well_formed_calls_reach_the_device_check(page_size, nnew):
    """CPU tensors pass every metadata check and stop at the device check (DeviceError, not InputError)."""
    args = inputs(page_size=page_size, nnew=nnew)
    with pytest.raises(DeviceError, match="needs a CUDA GPU: the tensors are on cpu"):
        call(args)
    with pytest.raises(DeviceError):
        call(args, causal=False, return_lse=True, scale=0.25, check_values=True)


def test_well_formed_unusual_layouts_reach_the_device_check():
    """Caches stored [B, Hkv, N, d] (passed as transpose(1, 2)), slices of wider rows whose strides are
    multiples of 8, MQA, a block table sliced out of a wider one, dims of size 1 with any stride,
    empty new tokens, and a paged cache with a page of one row."""
    args = inputs()
    kc = randn(2, 2, 40, 64).transpose(1, 2)
    vc = randn(2, 2, 40, 128)[..., 64:].transpose(1, 2)
    for changes in ({"k_cache": kc, "v_cache": vc},
                    {"k_cache": randn(2, 40, 1, 64), "v_cache": randn(2, 40, 1, 64)},  # MQA
                    {"q": randn(2 * 1536).as_strided((2, 1, 8, 64), (1536, 3, 64, 1))},  # Nq 1: its stride is free
                    {"k": randn(2, 0, 2, 64), "v": randn(2, 0, 2, 64)},
                    {"k_cache": randn(12, 1, 2, 64), "v_cache": randn(12, 1, 2, 64),
                     "block_table": torch.arange(24, dtype=I32).view(2, 12)[:, :5]},
                    {"k_cache": randn(7, 16, 2, 64), "v_cache": randn(7, 16, 2, 64),
                     "block_table": torch.zeros(2, 1, 8, dtype=I32)[:, 0]}):
        with pytest.raises(DeviceError):
            call(args, **changes)
    with torch.no_grad():  # no grad mode: inputs that require grad are accepted
        with pytest.raises(DeviceError):
            call(args, q=args["q"].clone().requires_grad_())


def test_validate_returns_capacity_and_page_size():
    a = inputs()
    assert kvcache._validate(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], None, None, None) == (40, 0)
    a = inputs(page_size=16, max_pages=5)
    assert kvcache._validate(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"], None,
                             None) == (80, 16)
    a = inputs(page_size=256, max_pages=3, nnew=2)
    assert kvcache._validate(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"], a["k"],
                             a["v"]) == (768, 256)


def test_the_public_function_is_exported():
    assert gemmgen.fused_attention_with_kvcache is kvcache.fused_attention_with_kvcache
    assert "fused_attention_with_kvcache" in gemmgen.__all__
    assert kvcache.kv_cache_head_dims() == decode_sm80.HEAD_DIMS


# ---- the append entry point's args ---------------------------------------------------------------

def append_args(args, capacity=None):
    table = args["block_table"]
    if capacity is None:
        capacity = args["k_cache"].shape[1] * (1 if table is None else table.shape[1])
    return launch.kv_append_args(args["k_cache"], args["v_cache"], args["cache_seqlens"], table, args["k"], args["v"],
                                 capacity)


def strides_of(a, prefix):
    return tuple(getattr(a, f"{prefix}_{dim}_stride") for dim in ("batch", "row", "head"))


def test_append_args_of_a_contiguous_cache():
    args = inputs(b=3, h=8, hkv=2, d=64, nmax=40, nnew=5)
    a = append_args(args)
    k, v, kc, vc = args["k"], args["v"], args["k_cache"], args["v_cache"]
    assert (a.k, a.v, a.k_cache, a.v_cache, a.seqlens) == (k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                                           args["cache_seqlens"].data_ptr())
    assert a.block_table is None and a.block_table_batch_stride == 0 and a.page_size == 0
    assert (a.batch, a.new_tokens, a.heads_kv, a.head_dim, a.capacity, a.elem_bytes) == (3, 5, 2, 64, 40, 2)
    assert a.num_pages == 3  # a contiguous cache: one "page" per sequence
    # [B, N, Hkv, d] tensors: (batch, row, head) strides in elements.
    for prefix, t in (("k", k), ("v", v), ("kc", kc), ("vc", vc)):
        assert strides_of(a, prefix) == (t.stride(0), t.stride(1), t.stride(2)), prefix
    assert strides_of(a, "k") == (5 * 2 * 64, 2 * 64, 64) and strides_of(a, "kc") == (40 * 2 * 64, 2 * 64, 64)


def test_append_args_of_a_paged_cache_and_strided_tensors():
    args = inputs(b=2, h=4, hkv=2, d=128, page_size=16, max_pages=4, num_pages=11, nnew=1, dtype=BF16)
    wide = torch.zeros(2, 9, dtype=I32)
    wide[:, :4] = args["block_table"]
    args["block_table"] = wide[:, :4]
    args["k_cache"] = randn(11, 2, 16, 128, dtype=BF16).transpose(1, 2)  # pages stored [pages, Hkv, rows, d]
    args["k"] = randn(2, 1, 2, 256, dtype=BF16)[..., 128:]  # a slice of wider rows
    a = append_args(args)
    assert a.block_table == args["block_table"].data_ptr() and a.block_table_batch_stride == 9
    assert (a.page_size, a.num_pages, a.capacity, a.new_tokens, a.head_dim) == (16, 11, 64, 1, 128)
    assert a.k == args["k"].data_ptr()
    assert strides_of(a, "k") == (512, 512, 256)
    assert strides_of(a, "kc") == (2 * 16 * 128, 128, 16 * 128)
    assert strides_of(a, "vc") == (16 * 2 * 128, 2 * 128, 128)


# ---- the value checks -------------------------------------------------------------------------------

def check_values(lengths, table=None, new=0, capacity=64, pages=16):
    kvcache._check_values(torch.tensor(lengths, dtype=I32), None if table is None else torch.tensor(table, dtype=I32),
                          new, capacity, pages)


def test_lengths_within_the_capacity_pass():
    check_values([0, 10, 64])
    check_values([0, 59], new=5)
    check_values([], capacity=64)  # no sequence
    torch_empty = torch.zeros(0, dtype=I32)
    kvcache._check_values(torch_empty, torch.zeros(0, 4, dtype=I32), 3, 64, 16)


@pytest.mark.parametrize("lengths, new, words", [
    ([0, 65], 0, r"cache_seqlens \+ new tokens must lie in \[0, 64\] \(the cache's capacity\); got lengths 0 to 65 "
                 r"with 0 new tokens"),
    ([60, 3], 5, r"must lie in \[0, 64\] .*got lengths 3 to 60 with 5 new tokens"),
    ([64], 1, r"must lie in \[0, 64\]"),
    ([-1, 4], 0, r"must lie in \[0, 64\] .*got lengths -1 to 4"),
    ([2**31 - 1], 1, r"must lie in \[0, 64\]"),  # no int32 wrap-around
])
def test_lengths_past_the_capacity_or_negative_raise(lengths, new, words):
    with pytest.raises(InputError, match=words):
        check_values(lengths, new=new)


def test_block_table_entries_are_checked_for_used_pages_only():
    # 4 pages of 16 per sequence; pages 0..15 exist.
    table = [[3, 1, 99, -1], [7, 8, 9, 10]]
    check_values([32, 64], table)  # sequence 0 reads pages 0 and 1 only: 99 and -1 are never read
    check_values([0, 0], [[-5, 99, 100, 16], [16, 16, 16, 16]])  # no key: no page read
    with pytest.raises(InputError, match=r"block_table\[0, 2\] = 99 is not a page of the cache \(0 to 15\)"):
        check_values([33, 64], table)  # key 32 is on the third page
    with pytest.raises(InputError, match=r"block_table\[0, 2\] = 99 is not a page"):
        check_values([32, 0], table, new=1)  # the new token goes to the third page
    with pytest.raises(InputError, match=r"block_table\[1, 0\] = -1 is not a page of the cache \(0 to 15\)"):
        check_values([1, 1], [[0, 0, 0, 0], [-1, 0, 0, 0]])
    with pytest.raises(InputError, match=r"block_table\[1, 3\] = 16 is not a page"):
        check_values([1, 64], [[0, 0, 0, 0], [1, 2, 3, 16]])  # one past the last page
    check_values([1, 64], [[0, 0, 0, 0], [1, 2, 3, 15]])


def test_block_table_check_uses_the_page_size_of_the_call():
    # 2 pages of 256 (capacity 512): key 256 is on page index 1.
    check_values([256], [[0, 99]], capacity=512, pages=4)
    with pytest.raises(InputError, match=r"block_table\[0, 1\] = 99"):
        check_values([257], [[0, 99]], capacity=512, pages=4)


# ---- the C ABI params ---------------------------------------------------------------------------------

def abi_params(args, *, causal=True, scale=None, lse=True, capacity=None, seqlens=None):
    q, kc = args["q"], args["k_cache"]
    o = torch.empty(q.shape, dtype=q.dtype)
    lse_t = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32) if lse else None
    seqlens = args["cache_seqlens"] if seqlens is None else seqlens
    table = args["block_table"]
    if capacity is None:
        capacity = kc.shape[1] * (1 if table is None else table.shape[1])
    p = launch.params_kvcache(q, kc, args["v_cache"], seqlens, table, o, lse_t, causal=causal, scale=scale,
                              capacity=capacity)
    return p, o, lse_t


def test_params_of_a_contiguous_cache():
    args = inputs(b=2, nq=3, h=8, hkv=2, d=64, nmax=40)
    q, kc, vc = args["q"], args["k_cache"], args["v_cache"]
    p, o, lse = abi_params(args)
    assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), o.data_ptr(), lse.data_ptr())
    assert (p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim) == (2, 8, 2, 3, 40, 64)
    # The [B, H, N, d] ABI: batch, head, row strides of the [B, N, H, d] tensors.
    for prefix, t in (("q", q), ("k", kc), ("v", vc), ("o", o)):
        got = tuple(getattr(p, f"{prefix}_{dim}_stride") for dim in ("batch", "head", "row"))
        assert got == (t.stride(0), t.stride(2), t.stride(1)), prefix
    assert (p.q_batch_stride, p.q_head_stride, p.q_row_stride) == (3 * 8 * 64, 64, 8 * 64)
    assert (p.k_batch_stride, p.k_head_stride, p.k_row_stride) == (40 * 2 * 64, 64, 2 * 64)
    assert p.scale == pytest.approx(1 / 8)
    assert p.causal_offset == 40 - 3  # capacity - Nq; the kernel adds each sequence's length - capacity
    assert p.seqlens_k == args["cache_seqlens"].data_ptr()
    assert p.block_table is None and p.block_table_batch_stride == 0 and p.page_size == 0
    assert p.num_splits == 0 and p.workspace is None and p.workspace_bytes == 0
    assert p.bias is None and p.dropout_p == 0.0 and p.cu_seqlens_q is None and p.cu_seqlens_k is None


def test_params_without_mask_scale_and_lse():
    args = inputs(nq=5, d=128)
    p, _, _ = abi_params(args, causal=False, scale=0.3, lse=False)
    assert p.causal_offset == launch.NO_MASK_OFFSET
    assert p.scale == pytest.approx(0.3) and p.lse is None
    p, _, _ = abi_params(args, causal=True, scale=-0.5)
    assert p.scale == pytest.approx(-0.5) and p.causal_offset == 40 - 5
    p, _, _ = abi_params(args, scale=None)
    assert p.scale == pytest.approx(1 / math.sqrt(128))


def test_params_of_a_paged_cache():
    args = inputs(b=3, nq=2, h=4, hkv=4, page_size=16, max_pages=5)
    wide = torch.zeros(3, 12, dtype=I32)  # the table as a slice of a wider one: row stride 12
    wide[:, :5] = args["block_table"]
    args["block_table"] = wide[:, :5]
    p, _, _ = abi_params(args)
    kc, table = args["k_cache"], args["block_table"]
    assert p.block_table == table.data_ptr()
    assert p.block_table_batch_stride == 12 and p.page_size == 16
    assert p.seqlen_k == 80 and p.causal_offset == 80 - 2
    assert (p.k_batch_stride, p.k_head_stride, p.k_row_stride) == (kc.stride(0), kc.stride(2), kc.stride(1))
    assert p.k_batch_stride == 16 * 4 * 64  # a page's stride
    assert (p.batch, p.heads, p.heads_kv) == (3, 4, 4)


def test_params_take_the_seqlens_given_and_transposed_caches():
    """The seqlens the call hands over (after an append: a new tensor), and caches stored [B, Hkv, N, d]."""
    args = inputs(b=2, nq=1, h=4, hkv=2, nmax=24)
    args["k_cache"] = randn(2, 2, 24, 64).transpose(1, 2)
    args["v_cache"] = randn(2, 2, 24, 64).transpose(1, 2)
    appended = torch.tensor([3, 4], dtype=I32)
    p, _, _ = abi_params(args, seqlens=appended)
    assert p.seqlens_k == appended.data_ptr() != args["cache_seqlens"].data_ptr()
    assert (p.k_batch_stride, p.k_head_stride, p.k_row_stride) == (2 * 24 * 64, 24 * 64, 64)
    assert (p.v_batch_stride, p.v_head_stride, p.v_row_stride) == (2 * 24 * 64, 24 * 64, 64)
    assert p.causal_offset == 23


# ---- selection ------------------------------------------------------------------------------------

H100 = device.synthetic((9, 0), 132, "NVIDIA H100")
A100 = device.synthetic((8, 0), 108, "NVIDIA A100")


def splits_by_the_rule(row_ctas, key_tiles, per_sm, sm_count, paged=False):
    """num_splits' docstring, restated as a search over every count."""
    if row_ctas <= 0 or key_tiles <= 1:
        return 1
    slots = sm_count * min(per_sm, heuristic.SPLIT_CTAS_PER_SM)
    fits = [s for s in range(1, min(heuristic.MAX_SPLITS, key_tiles) + 1) if row_ctas * s <= slots]
    most = max(fits, default=1)
    full = sm_count * per_sm
    if paged and row_ctas < full:
        counts = range(1, min(heuristic.MAX_SPLITS, key_tiles // heuristic.PAGED_MIN_TILES) + 1)
        fills = {s: row_ctas * s / (math.ceil(row_ctas * s / full) * full) for s in counts}
        if fills:
            best = max(fills.values())
            most = max(most, min(s for s, f in fills.items() if f >= heuristic.PAGED_WAVE_FILL * best))
    tiles_each = math.ceil(key_tiles / most)
    return min(s for s in range(1, most + 1) if math.ceil(key_tiles / s) == tiles_each)


def test_num_splits_is_one_when_the_grid_is_half_full_or_keys_are_few():
    assert heuristic.num_splits(264, 10_000, 2, 132) == 1  # row tiles fill every slot
    assert heuristic.num_splits(5000, 10_000, 2, 132) == 1
    assert heuristic.num_splits(133, 10_000, 2, 132) == 1  # two splits each would overflow one wave
    assert heuristic.num_splits(132, 10_000, 2, 132) == 2
    assert heuristic.num_splits(1, 1, 2, 132) == 1
    assert heuristic.num_splits(0, 1000, 2, 132) == 1


def test_num_splits_measured_shapes():
    # The H100 shapes of bench/NOTES.md, experiment 94 (3 CTAs fit per SM; 2 are filled), and the
    # count that ran fastest on each: about 256 CTAs, no split without a key tile.
    for row_ctas, key_tiles, best in ((8, 16, 16), (64, 16, 4), (8, 128, 32), (32, 64, 8), (8, 64, 32),
                                      (256, 64, 1), (32, 1024, 8), (128, 128, 2), (8, 1024, 32)):
        assert heuristic.num_splits(row_ctas, key_tiles, 3, 132) == best, (row_ctas, key_tiles)


def test_num_splits_of_paged_caches():
    # bench/NOTES.md, experiment 96 (H100, 3 CTAs fit per SM): paged caches take the count that
    # fills the waves at the full residency where each split keeps 6 key tiles or more, else the
    # contiguous count.
    for row_ctas, key_tiles, contiguous, paged in ((256, 64, 1, 3), (256, 512, 1, 3), (64, 512, 4, 6),
                                                   (8, 512, 32, 47), (32, 1024, 8, 12), (128, 128, 2, 3),
                                                   (256, 8, 1, 1), (256, 16, 1, 1), (64, 16, 4, 4),
                                                   (8, 128, 32, 32), (1024, 128, 1, 1)):
        assert heuristic.num_splits(row_ctas, key_tiles, 3, 132) == contiguous, (row_ctas, key_tiles)
        assert heuristic.num_splits(row_ctas, key_tiles, 3, 132, paged=True) == paged, (row_ctas, key_tiles)
    assert heuristic.PAGED_MIN_TILES == 6 and heuristic.PAGED_WAVE_FILL == 0.95


def test_a_block_table_makes_a_paged_problem(monkeypatch):
    from gemmgen.select import calls

    monkeypatch.setattr(calls.device, "facts", lambda index: H100)
    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(64, 64, 2, 128, dtype=torch.bfloat16, device="meta")
    for paged in (False, True):
        problem = calls.problem_for_kvcache(q, cache, cache, 4096, True, paged=paged)
        assert problem.paged is paged and problem.kv_cache


def test_num_splits_grows_for_few_row_ctas():
    assert heuristic.num_splits(100, 1000, 2, 132) == 2  # 200 of 264 slots
    assert heuristic.num_splits(1, 15, 2, 132) == 15  # one key tile each
    assert heuristic.num_splits(1, 20, 1, 132) == 20
    few = [heuristic.num_splits(r, 10_000, 1, 132) for r in (1, 2, 4, 8, 16, 33, 66, 132)]
    assert few[-1] == 1 and all(s > 1 for s in few[:-1])
    assert few == sorted(few, reverse=True)  # fewer row tiles, more splits


def test_num_splits_caps_and_leaves_no_split_empty():
    assert heuristic.MAX_SPLITS == 128 and heuristic.SPLIT_CTAS_PER_SM == 2
    assert heuristic.num_splits(1, 10**6, 1, 10**4) == heuristic.MAX_SPLITS
    assert all(heuristic.num_splits(1, 10**6, per_sm, sms) <= heuristic.MAX_SPLITS
               for per_sm in (1, 2, 8) for sms in (108, 132, 10**4))
    # 33 splits of 80 tiles would leave 3 tiles to each of 26 and none to the rest: 27 splits.
    assert heuristic.num_splits(8, 80, 2, 132) == 27
    for tiles in range(1, 1200, 7):
        for row_ctas in (1, 5, 8, 40):
            s = heuristic.num_splits(row_ctas, tiles, 2, 132)
            per = math.ceil(tiles / s)
            assert s <= tiles and (s - 1) * per < tiles  # the kernel's last split has a tile
            assert row_ctas * s <= 264


def test_num_splits_follows_its_docstring():
    for row_ctas in (1, 3, 7, 32, 50, 100, 131, 200, 263, 264, 1000):
        for key_tiles in (1, 2, 3, 4, 9, 65, 257, 1025, 5000):
            for per_sm, sms in ((1, 132), (2, 132), (3, 132), (2, 108), (4, 84)):
                for paged in (False, True):
                    assert heuristic.num_splits(row_ctas, key_tiles, per_sm, sms, paged=paged) == \
                        splits_by_the_rule(row_ctas, key_tiles, per_sm, sms, paged), \
                        (row_ctas, key_tiles, per_sm, sms, paged)


def decode_default(dtype="bf16", head_dim=128) -> DecodeSm80Instance:
    return next(i for i in decode_sm80.DEFAULT if i.dtype.value == dtype and i.head_dim == head_dim)


def pick(**props) -> DecodeSm80Instance:
    """The first instance of decode_sm80's SPACE with these attribute values (block_m, threads, ...)."""
    return next(i for i in decode_sm80.SPACE if all(getattr(i, k) == v for k, v in props.items()))


SMALL = dict(dtype=DType.BF16, head_dim=128, block_m=16, block_n=64)  # one 16-row slice
TALL = dict(dtype=DType.BF16, head_dim=128, block_m=64, block_n=64)  # four 16-row slices


def kv_problem(**kw) -> Problem:
    """fused_attention_with_kvcache's Problem for B=4, H=32, Hkv=8, Nq=1, capacity 4097 on an H100."""
    return Problem(**{"dtype": "bf16", "head_dim": 128, "causal": True, "device": H100, "batch_heads": 4 * 32,
                      "seqlen_q": 1, "seqlen_k": 4097, "gqa": 4, "layout": "bnhd",
                      "causal_alignment": "bottom_right", "kv_cache": True, **kw})


def expected_plan(inst, p: Problem) -> tuple[int, int]:
    """split_plan as its docstrings state it: row tiles of block_m of the Nq * group packed rows,
    B * Hkv groups, num_splits' rule over the instance's residency."""
    cost = inst.cost_inputs
    row_tiles = -(-p.seqlen_q * p.gqa // cost.block_m)
    groups = p.batch_heads // p.gqa
    per_sm = heuristic.ctas_per_sm(cost.smem_bytes, cost.threads, p, cost.regs_per_thread)
    return row_tiles, splits_by_the_rule(row_tiles * groups, -(-p.seqlen_k // cost.block_n), per_sm, p.device.sm_count)


def test_split_plan_of_a_decode_call():
    small, tall = pick(**SMALL), pick(**TALL)
    for inst in (small, tall):
        for p in (kv_problem(), kv_problem(seqlen_q=16), kv_problem(seqlen_k=65537), kv_problem(device=A100)):
            assert heuristic.split_plan(inst, p) == expected_plan(inst, p)
        # 4 packed rows (1 query x 4 heads of a group) in one row tile, 32 groups: far fewer CTAs than
        # the GPU's slots, so the 65 key tiles are split.
        row_tiles, splits = heuristic.split_plan(inst, kv_problem())
        assert row_tiles == 1 and splits > 1
        est = heuristic.estimate(inst, kv_problem())
        assert est.ctas == 32 * splits and est.padded_rows == inst.block_m
        assert heuristic.split_plan(inst, kv_problem(seqlen_k=64)) == (1, 1)  # one key tile
        assert heuristic.split_plan(inst, kv_problem(batch_heads=2048 * 32)) == (1, 1)  # 8192 groups fill the GPU
    # 16 queries x 4 heads = 64 packed rows: four 16-row tiles or one 64-row tile per group.
    assert heuristic.split_plan(small, kv_problem(seqlen_q=16))[0] == 4
    assert heuristic.split_plan(tall, kv_problem(seqlen_q=16))[0] == 1


def test_splits_of_a_candidate():
    inst = pick(**TALL)
    dec = Candidate(make_entry(inst), Path("lib.so"), Path("build"), 0)
    fa2 = Candidate(make_entry(fa2_sm80.DEFAULT[0]), Path("lib.so"), Path("build"), 0)
    assert selection.splits(dec, kv_problem()) == heuristic.split_plan(inst, kv_problem())[1] > 1
    assert selection.splits(fa2, kv_problem()) == 0  # no split-KV: the ABI's 0


def test_problem_names_the_kv_cache_feature():
    p = kv_problem()
    assert p.functional_key == "bf16_d128_causal_a16_kv_cache"
    assert p.describe() == "bf16 head_dim=128 causal (bottom_right), kv-cache on sm_90"
    assert kv_problem(kv_cache=False).functional_key == "bf16_d128_causal_a16"


def test_only_the_decode_family_takes_kv_cache_problems():
    """Key-value caches go to the decode family, and to fmha_sm90 only as packed sequences (a
    contiguous cache's chunk, gemmgen.ops.torch_op._packed_chunk)."""
    p = kv_problem()
    for inst in decode_sm80.SPACE:
        assert decode_sm80.problem_reason(inst, dataclasses.replace(p, dtype=inst.dtype.value,
                                                                    head_dim=inst.head_dim)) is None
    dec = decode_default()
    assert decode_sm80.problem_reason(dec, kv_problem(causal=False)) is None
    assert decode_sm80.problem_reason(dec, kv_problem(kv_cache=False, layout="bhnd")) is None  # dense calls too
    assert decode_sm80.problem_reason(dec, kv_problem(negative_scale=True, zero_scale=False)) is None
    for feature in ("dropout", "bias", "varlen"):
        assert decode_sm80.problem_reason(dec, kv_problem(**{feature: True})) == f"decode_sm80 has no {feature}"
    fa2 = next(i for i in fa2_sm80.SPACE if i.head_dim == 128 and i.dtype is DType.BF16)
    assert fa2_sm80.problem_reason(fa2, p) == "fa2_sm80 has no kv cache"
    assert fa2_sm80.problem_reason(fa2, kv_problem(kv_cache=False)) is None
    sm90 = next(i for i in fmha_sm90.SPACE if i.head_dim == 128 and i.dtype is DType.BF16)
    assert "as packed sequences only" in fmha_sm90.problem_reason(sm90, p)
    assert "as packed sequences only" in fmha_sm90.problem_reason(sm90, kv_problem(paged=True, varlen=True))
    packs = next(i for i in fmha_sm90.DEFAULT if i.head_dim == 128 and i.dtype is DType.BF16 and i.runs_varlen)
    assert fmha_sm90.problem_reason(packs, kv_problem(varlen=True)) is None
    assert fmha_sm90.problem_reason(packs, kv_problem(varlen=True, causal=False)) is None
    assert decode_sm80.problem_reason(dec, kv_problem(varlen=True)) == "decode_sm80 has no varlen"
    mea = next(i for i in mea_sm80.DEFAULT if i.dtype is DType.BF16 and i.max_head_dim >= 128)
    assert mea_sm80.problem_reason(mea, p) == "mea_sm80 has no kv cache"
    assert mea_sm80.problem_reason(mea, kv_problem(kv_cache=False, causal_alignment="top_left")) is None


def test_the_registry_sends_kv_cache_problems_to_the_decode_family(tmp_path):
    insts = [i for i in fa2_sm80.DEFAULT + mea_sm80.DEFAULT + decode_sm80.DEFAULT if i.dtype is DType.BF16]
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(i) for i in insts])])
    try:
        p = kv_problem(device=A100)
        good, rejected = registry.candidates(p)
        assert good and {c.entry.family for c in good} == {"decode_sm80"}
        assert {c.instance.head_dim for c in good} == {128}
        reasons = [reason for _, reason in rejected]
        assert any(r == "fa2_sm80 has no kv cache" for r in reasons)
        assert any(r == "mea_sm80 has no kv cache" for r in reasons)
        pick = selection.select(p)
        assert pick.entry.family == "decode_sm80" and pick.instance in decode_sm80.DEFAULT
        assert pick.instance.head_dim == 128 and pick.instance.dtype is DType.BF16
        assert selection.splits(pick, p) > 1  # 32 row tiles on 108 SMs: the keys are split
        # A dense decode-shaped call without a mask: the decode family's split-KV grid is estimated
        # well below fa2_sm80's one 128-row tile per head.
        dense = kv_problem(device=A100, kv_cache=False, causal=False, causal_alignment="top_left", layout="bhnd")
        assert {c.entry.family for c in registry.candidates(dense)[0]} >= {"decode_sm80", "fa2_sm80"}
        assert selection.select(dense).entry.family == "decode_sm80"
    finally:
        registry.set_build_dirs(None)


# ---- the decode_sm80 family ------------------------------------------------------------------------

def test_decode_family_specifics():
    """(The contract, name and hash pins and the params round trip of every instance are
    tests/test_family_contract.py's, for every family.)"""
    from gemmgen.generator import space
    assert space.family_named("decode_sm80") is decode_sm80
    assert decode_sm80.KIND == "attention" and decode_sm80.BUILT_BY_DEFAULT and decode_sm80.PACKS_GQA
    assert decode_sm80.SPACE and all(decode_sm80.invalid_reason(i) is None for i in decode_sm80.SPACE)
    names = [i.name for i in decode_sm80.SPACE]
    assert len(set(names)) == len(names)
    assert all(f"_d{i.head_dim}_m{i.block_m}n{i.block_n}" in i.name for i in decode_sm80.SPACE)
    assert {i.head_dim for i in decode_sm80.SPACE} == set(decode_sm80.HEAD_DIMS)
    assert set(decode_sm80.HEAD_DIMS) <= set(space.supported_head_dims())


def test_decode_defaults():
    defaults = decode_sm80.DEFAULT
    assert defaults and set(defaults) <= set(decode_sm80.SPACE)
    assert all("decode" in i.name and i.name.startswith("decode_sm80_") for i in defaults)
    # The head dims LLM serving runs (64 and 128), both dtypes, a 16-row and a 64-row tile for each
    # (the same for both dtypes; the d64 16-row tile takes 128 keys).
    assert {(i.dtype.value, i.head_dim) for i in defaults} == {(dt, d) for dt in ("fp16", "bf16") for d in (64, 128)}
    tiles = {(i.dtype, i.head_dim): set() for i in defaults}
    for i in defaults:
        tiles[(i.dtype, i.head_dim)].add(i.name.rsplit("_", 1)[1])
    assert {d: frozenset(t) for (_, d), t in tiles.items()} == {64: {"m16n128w1x4s2", "m64n64w4x1s2"},
                                                                 128: {"m16n64w1x4s2", "m64n64w4x1s2"}}
    assert len(defaults) == 2 * sum(len(t) for t in decode_sm80.DEFAULT_TILES.values())
    assert all(i.mask is None for i in defaults)  # both masks: the causal offset is a launch parameter
    assert all(i.symbol == f"gemmgen_{i.name}" for i in defaults)


def test_invalid_reason():
    """Rows come in 16-row MMA slices, one per row of warps: block_m is 16 per warp over the rows,
    never another count; the axes, the warp count and the tile's keys per warp are checked."""
    for inst in decode_sm80.SPACE:
        rows_of_warps = inst.threads // 32 // (inst.warps_n if hasattr(inst, "warps_n") else 1)
        assert inst.block_m == 16 * rows_of_warps and inst.block_m in (16, 32, 64)
    valid = pick(**SMALL)
    assert decode_sm80.invalid_reason(valid) is None
    assert "head_dim" in decode_sm80.invalid_reason(dataclasses.replace(valid, head_dim=72))
    assert "stages" in decode_sm80.invalid_reason(dataclasses.replace(valid, stages=1))
    assert "block_n" in decode_sm80.invalid_reason(dataclasses.replace(valid, block_n=48))
    fields = {f.name for f in dataclasses.fields(decode_sm80.INSTANCE)}
    if "block_m" in fields:  # block_m an axis of its own: it must be 16 per warp
        for block_m, warps in ((32, 1), (16, 2), (64, 2), (16, 4)):
            inst = dataclasses.replace(valid, block_m=block_m, warps=warps)
            assert decode_sm80.invalid_reason(inst) == \
                f"block_m {block_m} is not one 16-row MMA slice per warp ({warps} warps)"
    else:  # block_m = 16 * warps_m by construction; warps_n share the keys
        assert "warps_m" in decode_sm80.invalid_reason(dataclasses.replace(valid, warps_m=3))
        assert "warps_n" in decode_sm80.invalid_reason(dataclasses.replace(valid, warps_n=8))
        assert "exceed" in decode_sm80.invalid_reason(dataclasses.replace(valid, warps_m=4, warps_n=4))
        assert "multiple of 16 keys" in decode_sm80.invalid_reason(dataclasses.replace(valid, block_n=32, warps_n=4))
    big = pick(dtype=DType.BF16, head_dim=256, block_m=16)
    too_big = dataclasses.replace(big, block_n=128, stages=4)  # (16 + 8 * 128) * 256 * 2 bytes of shared memory
    assert decode_sm80.invalid_reason(too_big) is not None and too_big not in decode_sm80.SPACE


def test_instance_sizes():
    for inst in (pick(**SMALL), pick(**TALL)):
        assert inst.name.startswith(f"decode_sm80_bf16_d128_m{inst.block_m}n64")
        assert inst.smem_bytes == (inst.block_m + 2 * inst.stages * 64) * 128 * 2
        cost = inst.cost_inputs
        assert (cost.block_m, cost.block_n, cost.stages, cost.threads, cost.smem_bytes) == \
            (inst.block_m, 64, inst.stages, inst.threads, inst.smem_bytes)


def test_decode_instances_render(tmp_path):
    from gemmgen.arch import Arch
    from gemmgen.generator import build

    chosen = [decode_default("fp16", 64)]
    result = build.generate(Arch.SM80, chosen, out=tmp_path, compile=False, log=lambda line: None)
    assert sorted(result.rendered) == [chosen[0].name]
    text = (tmp_path / "sm80" / "src" / f"{chosen[0].name}.cu").read_text()
    assert '#include "gemmgen/decode_sm80/launch.h"' in text
    assert "KernelTraits<cutlass::half_t, /*HeadDim=*/64," in text and f"/*Stages=*/{chosen[0].stages}>" in text
    for suffix in ("", "_workspace", "_info"):
        assert f"{chosen[0].symbol}{suffix}(" in text


class RecordingKernel:
    """Stands in for a decode instance: records what the op hands its two entry points."""

    kv_cache, needs_lse = True, False

    def __init__(self):
        self.appends, self.runs = [], []

    def workspace_bytes(self, params):
        return 0

    def append(self, args, stream):
        self.appends.append(args)

    def run(self, params, stream):
        self.runs.append(params)


@pytest.fixture
def recording(monkeypatch):
    from gemmgen.ops import torch_op

    kernel = RecordingKernel()
    monkeypatch.setattr(torch_op, "_kernel_for", lambda key, problem_of, *rest: torch_op._Plan(kernel, 0))
    monkeypatch.setattr(torch_op, "_packed_chunk", lambda *args: None)  # (its own tests below)
    monkeypatch.setattr(launch, "raw_stream", lambda index: 0)
    return kernel


@pytest.fixture
def packed_selection(monkeypatch):
    """A stand-in prefill kernel selected for the chunks run as packed sequences: (the kernel, the
    problems the selection was asked)."""
    from gemmgen.ops import torch_op

    kernel = RecordingKernel()
    kernel.kv_cache = False
    asked = []

    class Cand:
        pass

    Cand.kernel = kernel
    monkeypatch.setattr(selection, "select", lambda problem, instance=None: asked.append(problem) or Cand)
    monkeypatch.setattr(selection, "splits", lambda cand, problem: 0)
    monkeypatch.setattr(device, "facts", lambda index: H100)
    monkeypatch.setattr(launch, "raw_stream", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "launch", lambda kernel, p, index, workspace_bytes=None, owned=False: kernel.run(p, 0))
    torch_op._kernels.clear()
    yield kernel, asked
    torch_op._kernels.clear()


@pytest.mark.parametrize("causal", [True, False])
def test_a_long_chunk_against_a_contiguous_cache_runs_as_packed_sequences(packed_selection, causal):
    """Nq >= DENSE_CHUNK_ROWS against a contiguous cache: one launch over the packed rows (sequence b's
    queries rows b * Nq.., its keys rows b * Nmax..), the lengths handed to the kernel on the device
    (seqlens_k: no host read), bottom-right per sequence; the selection asked for a key-value cache as
    packed sequences, once per call signature."""
    import ctypes

    from gemmgen.ops import torch_op

    kernel, asked = packed_selection
    nq = torch_op.DENSE_CHUNK_ROWS + 1
    args = inputs(b=3, nq=nq, h=4, hkv=2, d=64, nmax=300, dtype=BF16, seed=5)
    seqlens = torch.tensor([5, 0, 300], dtype=I32)
    for _ in range(2):
        o, lse = torch_op._fused_attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], seqlens, None,
                                                        None, None, causal, None, True, None)
    assert len(asked) == 1 and len(kernel.runs) == 2
    (problem,) = asked
    assert problem.kv_cache and problem.varlen and not problem.short_keys and not problem.paged
    assert (problem.seqlen_q, problem.seqlen_k, problem.batch_heads, problem.gqa) == (nq, 300, 12, 2)
    assert problem.causal == causal and problem.causal_alignment == "bottom_right"
    p = kernel.runs[-1]
    assert (p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (3, 4, 2, nq, 300, 3 * nq,
                                                                                            900)
    assert list((ctypes.c_int32 * 4).from_address(p.cu_seqlens_q)) == [0, nq, 2 * nq, 3 * nq]
    assert list((ctypes.c_int32 * 4).from_address(p.cu_seqlens_k)) == [0, 300, 600, 900]
    assert p.seqlens_k == seqlens.data_ptr() and p.align_per_sequence == int(causal)
    assert (p.q, p.k, p.v, p.o, p.lse) == (args["q"].data_ptr(), args["k_cache"].data_ptr(),
                                           args["v_cache"].data_ptr(), o.data_ptr(), lse.data_ptr())
    assert (p.q_row_stride, p.k_row_stride, p.o_row_stride) == (4 * 64, 2 * 64, 4 * 64)


def test_chunks_the_packed_route_does_not_take(packed_selection, monkeypatch):
    """Paged caches, windows, caches whose sequences are not evenly spaced rows and calls no built
    instance runs as packed sequences go the other routes (None); a q whose batch entries are not
    evenly spaced rows is copied into packed rows."""
    from gemmgen.errors import NoInstanceError
    from gemmgen.ops import torch_op

    kernel, asked = packed_selection
    nq = torch_op.DENSE_CHUNK_ROWS
    paged = inputs(b=2, nq=nq, page_size=16, max_pages=4, dtype=BF16)
    flat = inputs(b=2, nq=nq, nmax=64, dtype=BF16)
    hnd = flat["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, Nmax, Hkv, d] view of BHND storage
    for key, (q, kc, vc, table, window) in enumerate([
            (paged["q"], paged["k_cache"], paged["v_cache"], paged["block_table"], None),
            (flat["q"], flat["k_cache"], flat["v_cache"], None, (16, 0)),
            (flat["q"], hnd, hnd, None, None)]):
        assert torch_op._packed_chunk((key,), q, kc, vc, table, True, None, window) is None
    assert asked == []
    monkeypatch.setattr(selection, "select", lambda problem, instance=None: (_ for _ in ()).throw(
        NoInstanceError("none built")))
    assert torch_op._packed_chunk(("none",), flat["q"], flat["k_cache"], flat["v_cache"], None, True, None,
                                  None) is None
    assert torch_op._kernels[("kv_packed", "none")] is torch_op._NO_PACKED
    q = flat["q"].transpose(1, 2).contiguous().transpose(1, 2)
    qp, kp, _ = torch_op._packed_views(q, flat["k_cache"], flat["v_cache"])
    assert qp.shape == (2 * nq, 8, 64) and torch.equal(qp.view(2, nq, 8, 64), q)
    assert kp.data_ptr() == flat["k_cache"].data_ptr() and kp.shape == (2 * 64, 2, 64)


def test_new_tokens_are_appended_without_query_rows(recording):
    """Nq = 0 (or batch of queries empty): nothing to attend, but the new keys and values still go in."""
    from gemmgen.ops import torch_op

    q = torch.empty(2, 0, 8, 64, dtype=torch.float16)
    cache = torch.zeros(2, 32, 2, 64, dtype=torch.float16)
    k = torch.randn(2, 3, 2, 64, dtype=torch.float16)
    o, lse = torch_op._fused_attention_with_kvcache(q, cache, cache.clone(), torch.tensor([4, 0], dtype=I32),
                                                   None, k, k.clone(), True, None, True, None)
    assert o.shape == (2, 0, 8, 64) and lse.shape == (2, 8, 0)
    assert len(recording.appends) == 1 and recording.runs == []
    a = recording.appends[0]
    assert (a.batch, a.new_tokens, a.heads_kv, a.head_dim, a.capacity) == (2, 3, 2, 64, 32)
    recording.appends.clear()
    torch_op._fused_attention_with_kvcache(q, cache, cache.clone(), torch.tensor([4, 0], dtype=I32), None,
                                           None, None, True, None, False, None)
    assert recording.appends == [] and recording.runs == []


def test_a_cache_without_rows_gives_nan_rows_to_sequences_that_claim_keys(recording):
    from gemmgen.ops import torch_op

    q = torch.randn(3, 2, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 0, 1, 64, dtype=torch.bfloat16)
    o, lse = torch_op._fused_attention_with_kvcache(q, cache, cache.clone(), torch.tensor([0, 5, 0], dtype=I32),
                                                   None, None, None, True, None, True, None)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert o[1].isnan().all() and lse[1].isnan().all()
    assert recording.appends == [] and recording.runs == []
    new = torch.randn(3, 1, 1, 64, dtype=torch.bfloat16)
    o, lse = torch_op._fused_attention_with_kvcache(q, cache, cache.clone(), torch.tensor([0, 0, 0], dtype=I32),
                                                   None, new, new.clone(), True, None, True, None)
    assert o.isnan().all() and lse.isnan().all()  # one new token each, and no row to hold it


def test_the_split_count_sees_whether_the_cache_is_paged(recording, monkeypatch):
    """The decode path's problem says whether a block table is read (the split count depends on it)."""
    from gemmgen.ops import torch_op

    problems = []
    monkeypatch.setattr(torch_op, "_kernel_for",
                        lambda key, problem_of, *rest: (problems.append(problem_of()), torch_op._Plan(recording, 0))[1])
    monkeypatch.setattr(torch_op.calls.device, "facts", lambda index: H100)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: None)
    for paged in (False, True):
        args = inputs(b=2, nq=1, page_size=8 if paged else None, seed=4)
        args["cache_seqlens"] = torch.tensor([5, 9], dtype=I32)
        torch_op._fused_attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"],
                                               args["block_table"], None, None, True, None, False, None)
        assert problems[-1].paged is paged and problems[-1].kv_cache


def test_a_long_chunk_runs_sequence_by_sequence_as_dense_calls(recording, monkeypatch):
    """Nq >= DENSE_CHUNK_ROWS outside graph capture: each sequence's first L_b keys (gathered from
    its pages) go to one dense bottom-right call, after the new tokens are appended; a sequence
    without keys gets O = 0 and LSE = -inf, a bad length or page NaN rows; the decode kernel does
    not run. The dense calls are checked against the float64 reference here (stand-in kernel)."""
    from gemmgen.ops import torch_op
    from gemmgen.ops.reference import attention_reference

    dense = []

    def run(q, k, v, o, lse, causal, alignment, scale, instance, window=None):
        dense.append((q.shape, k.shape, causal, alignment))
        ref_o, ref_lse = attention_reference(q, k, v, causal, alignment, scale, window=window)
        o.copy_(ref_o.to(o.dtype))
        if lse is not None:
            lse.copy_(ref_lse.float())

    monkeypatch.setattr(torch_op, "_run", run)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    nq = torch_op.DENSE_CHUNK_ROWS
    for paged in (False, True):
        args = inputs(b=5, nq=nq, h=4, hkv=2, d=64, nmax=320, page_size=64 if paged else None, max_pages=5,
                      dtype=torch.float32, seed=3)
        lengths = [200, 0, -1, 321, 130]  # keys before the call; no new tokens
        args["cache_seqlens"] = torch.tensor(lengths, dtype=I32)
        if paged:
            args["block_table"][4, 1] = 999  # sequence 4 reads a page the cache does not have
        dense.clear()
        o, lse = torch_op._fused_attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                                        args["cache_seqlens"], args["block_table"], None, None, True,
                                                        None, True, None)
        assert recording.runs == [] and len(dense) == (1 if paged else 2)
        for b, n in enumerate(lengths):
            if b == 1:
                assert torch.equal(o[b], torch.zeros_like(o[b])) and torch.isneginf(lse[b]).all()
            elif b in (2, 3) or (paged and b == 4):
                assert o[b].isnan().all() and lse[b].isnan().all()
            else:
                if paged:
                    pages = args["block_table"][b, :-(-n // 64)].long()
                    k = args["k_cache"][pages].reshape(-1, 2, 64)[:n]
                    v = args["v_cache"][pages].reshape(-1, 2, 64)[:n]
                else:
                    k, v = args["k_cache"][b, :n], args["v_cache"][b, :n]
                ref_o, ref_lse = attention_reference(args["q"][b:b + 1].transpose(1, 2), k[None].transpose(1, 2),
                                                     v[None].transpose(1, 2), True, "bottom_right", None)
                torch.testing.assert_close(o[b], ref_o[0].transpose(0, 1).float(), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse[b], ref_lse[0].float(), atol=1e-5, rtol=1e-5)
        assert all(shape[2] == nq and alignment == "bottom_right" and causal for shape, _, causal, alignment in dense)
    # Under CUDA graph capture the lengths cannot be read: the decode kernel runs the chunk.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(launch, "launch", lambda kernel, p, index, workspace=None, owned=False: kernel.run(p, 0))
    torch_op._fused_attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"],
                                           args["block_table"], None, None, True, None, False, None)
    assert len(recording.runs) == 1
