"""The mea_sm80 family on the GPU against float64 references: every head dim x dtype x mask, odd
lengths, layouts, GQA, dropout (its mask reconstructed with the kernel itself), additive masks and
variable lengths. Needs the family's recommended instances built into ./build:

    gemmgen generate --arch sm80 --all --filter "mea_sm80_.*(k64_q64k64|k128_q32k128|k256_q32k128)"
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gemmgen
from gemmgen.select import registry
from gemmgen.generator.families import mea_sm80
from gemmgen.ops.reference import attention_reference, causal_offset
from test_fused_attention import DTYPES, MASK_IDS, MASKS, TOLERANCE, check, make_qkv, randn

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 17), (127, 129), (129, 127), (1000, 1000), (1000, 17), (17, 1000)]
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def instance_for(dtype: torch.dtype, head_dim: int) -> str:
    """The recommended instance with the smallest bound that runs head_dim (skips if not built)."""
    inst = next(i for i in mea_sm80.DEFAULT
                if i.dtype.value == DTYPE_NAMES[dtype] and i.max_head_dim >= head_dim)
    if not any(c.name == inst.name and c.entry.state == "built" for c in registry.load()[0]):
        pytest.skip(f"{inst.name} is not built (see this module's docstring)")
    return inst.name


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_head_dim_dtype_mask(head_dim, dtype, mask):
    name = instance_for(dtype, head_dim)
    for nq, nk in ((129, 127), (127, 129)):
        q, k, v = make_qkv(2, 3, 3, nq, nk, head_dim, dtype, ("mea", head_dim, dtype, mask, nq))
        check(q, k, v, causal=mask[0], alignment=mask[1], instance=name)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("nq, nk", LENGTHS)
def test_lengths_layouts_gqa(nq, nk, layout, mask):
    dtype, d = torch.bfloat16, 128
    name = instance_for(dtype, d)
    for h, hkv in ((4, 4), (4, 2), (4, 1)):
        q, k, v = make_qkv(2, h, hkv, nq, nk, d, dtype, ("mea-len", nq, nk, layout, mask, hkv))
        if layout == "bnhd":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        check(q, k, v, causal=mask[0], alignment=mask[1], instance=name)


def test_many_batches_and_negative_scale():
    name = instance_for(torch.float16, 64)
    q, k, v = make_qkv(70000, 1, 1, 3, 5, 64, torch.float16, "mea-grid")  # grid.z holds 65535 batches
    check(q, k, v, instance=name)
    q, k, v = make_qkv(2, 2, 2, 33, 65, 64, torch.float16, "mea-neg")
    check(q, k, v, scale=-0.2, causal=True, instance=name)


# Dropout.
def keep_mask(q, k, *, p, seed, offset, name, causal=False, alignment="top_left"):
    """The kernel's kept-weight mask [B, H, Nq, Nk], read back by running it with V = identity
    columns: O[i, j] is then the dropped weight of key c + j, zero exactly where it was dropped.
    A tiny scale keeps every visible weight well above underflow."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    keep = torch.zeros(b, h, nq, nk, dtype=torch.bool, device=q.device)
    for c in range(0, nk, d):
        cols = min(d, nk - c)
        v = torch.zeros(b, hkv, nk, d, dtype=q.dtype, device=q.device)
        v[:, :, torch.arange(c, c + cols), torch.arange(cols)] = 1
        o = gemmgen.fused_attention(q, k, v, scale=1e-3, dropout_p=p, seed=seed, offset=offset, causal=causal,
                                    causal_alignment=alignment, instance=name)
        keep[..., c:c + cols] = o[..., :cols] != 0
    return keep


def reference(q, k, v, *, scale=None, bias=None, keep=None, p=0.0, causal=False, alignment="top_left"):
    """float64 softmax(scale * Q K^T + bias + causal mask), weights times keep / (1 - p), times V."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = scale * q64 @ k64.transpose(-2, -1)
    if bias is not None:
        s = s + bias.double()
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        rows = torch.arange(nq, device=q.device)[:, None]
        cols = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(cols > rows + causal_offset(nq, nk, alignment), float("-inf"))
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    w = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], 0.0)), 0.0)
    if keep is not None:
        w = w * keep / (1 - p)
    return w @ v64, lse


def rel_err(o, ref):
    return ((o.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_dropout_zero_equals_no_dropout(dtype):
    name = instance_for(dtype, 64)
    q, k, v = make_qkv(2, 3, 3, 129, 127, 64, dtype, "mea-p0")
    plain = gemmgen.fused_attention(q, k, v, instance=name)
    assert torch.equal(gemmgen.fused_attention(q, k, v, dropout_p=0.0, seed=7, instance=name), plain)


def test_dropout_seed_reproducible():
    name = instance_for(torch.float16, 64)
    q, k, v = make_qkv(2, 3, 3, 129, 127, 64, torch.float16, "mea-seed")
    a = gemmgen.fused_attention(q, k, v, dropout_p=0.3, seed=1234, offset=5, instance=name)
    b = gemmgen.fused_attention(q, k, v, dropout_p=0.3, seed=1234, offset=5, instance=name)
    assert torch.equal(a, b)
    assert not torch.equal(a, gemmgen.fused_attention(q, k, v, dropout_p=0.3, seed=1235, offset=5, instance=name))
    assert not torch.equal(a, gemmgen.fused_attention(q, k, v, dropout_p=0.3, seed=1234, offset=6, instance=name))
    torch.manual_seed(3)
    c = gemmgen.fused_attention(q, k, v, dropout_p=0.3, instance=name)
    d = gemmgen.fused_attention(q, k, v, dropout_p=0.3, instance=name)
    torch.manual_seed(3)
    assert torch.equal(c, gemmgen.fused_attention(q, k, v, dropout_p=0.3, instance=name))
    assert not torch.equal(c, d)  # the generator advanced


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_kept_fraction(p):
    name = instance_for(torch.bfloat16, 128)
    q, k, _ = make_qkv(2, 4, 4, 1000, 1000, 128, torch.bfloat16, ("mea-frac", p))
    keep = keep_mask(q, k, p=p, seed=99, offset=0, name=name)
    frac = keep.float().mean().item()  # 8M weights
    assert abs(frac - (1 - p)) <= 0.01 * (1 - p), frac


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 128), (torch.float16, 256)])
def test_dropout_matches_reference_with_its_mask(dtype, head_dim, mask):
    name = instance_for(dtype, head_dim)
    causal, alignment = mask
    p, seed, offset = 0.2, 42, 1000
    for nq, nk, hkv in ((129, 127, 3), (127, 300, 1)):
        q, k, v = make_qkv(2, 3, hkv, nq, nk, head_dim, dtype, ("mea-drop", head_dim, mask, nq))
        keep = keep_mask(q, k, p=p, seed=seed, offset=offset, name=name, causal=causal, alignment=alignment)
        out = torch.full_like(q, float("nan"))
        o, lse = gemmgen.fused_attention(q, k, v, dropout_p=p, seed=seed, offset=offset, causal=causal,
                                         causal_alignment=alignment, instance=name, out=out, return_lse=True)
        ref, ref_lse = reference(q, k, v, keep=keep, p=p, causal=causal, alignment=alignment)
        assert not torch.isnan(o).any()
        assert rel_err(o, ref) <= TOLERANCE[dtype]
        finite = torch.isfinite(ref_lse)  # LSE is of the weights before dropout
        assert torch.equal(torch.isneginf(lse), ~finite)
        assert ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[finite].max().item() <= 1e-3


# Additive masks.
BIAS_SHAPES = [lambda b, h, nq, nk: (nq, nk), lambda b, h, nq, nk: (b, 1, nq, nk),
               lambda b, h, nq, nk: (1, h, nq, nk), lambda b, h, nq, nk: (b, h, nq, nk),
               lambda b, h, nq, nk: (nk,), lambda b, h, nq, nk: (h, 1, nk)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=["nq-nk", "b1", "1h", "bh", "row", "h1-nk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_bias_equals_sdpa_math(dtype, shape):
    name = instance_for(dtype, 64)
    b, h, nq, nk = 2, 3, 129, 127
    q, k, v = make_qkv(b, h, h, nq, nk, 64, dtype, ("mea-bias", dtype, shape(b, h, nq, nk)))
    mask = randn(shape(b, h, nq, nk), dtype, ("mask", shape(b, h, nq, nk)))
    out = torch.full_like(q, float("nan"))
    o = gemmgen.fused_attention(q, k, v, attn_mask=mask, out=out, instance=name)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert not torch.isnan(o).any()
    assert rel_err(o, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_bias_with_causal_gqa_and_bool_mask(mask):
    name = instance_for(torch.bfloat16, 128)
    q, k, v = make_qkv(2, 4, 2, 127, 200, 128, torch.bfloat16, ("mea-bias-causal", mask))
    keep = torch.rand(127, 200, device="cuda") > 0.3
    keep[:, 0] = True  # every row keeps a key
    o, lse = gemmgen.fused_attention(q, k, v, attn_mask=keep, causal=mask[0], causal_alignment=mask[1],
                                     return_lse=True, instance=name)
    bias = torch.zeros(127, 200, device="cuda", dtype=torch.float64).masked_fill(~keep, float("-inf"))
    ref, ref_lse = reference(q, k, v, bias=bias, causal=mask[0], alignment=mask[1])
    assert rel_err(o, ref) <= TOLERANCE[torch.bfloat16]
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty) and (o[empty] == 0).all()


def test_bias_row_of_minus_inf_gives_zero():
    name = instance_for(torch.float16, 64)
    q, k, v = make_qkv(1, 2, 2, 17, 33, 64, torch.float16, "mea-inf")
    mask = torch.zeros(17, 33, dtype=torch.float16, device="cuda")
    mask[5] = float("-inf")
    o, lse = gemmgen.fused_attention(q, k, v, attn_mask=mask, return_lse=True, instance=name)
    assert (o[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()
    assert not torch.isnan(o).any()


# Variable lengths.
def check_varlen(q, k, v, cu_q, cu_k, o, lse, causal):
    """o and lse of a varlen call against the float64 reference of each sequence alone."""
    dtype, h, head_dim = q.dtype, q.shape[1], q.shape[2]
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    lens_q = [b - a for a, b in zip(offsets_q, offsets_q[1:])]
    lens_k = [b - a for a, b in zip(offsets_k, offsets_k[1:])]
    assert lse.shape == (len(lens_q), h, max(lens_q))
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(offsets_q[b], offsets_q[b + 1])
        keys = slice(offsets_k[b], offsets_k[b + 1])
        if lq == 0:
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys]))
        ref, ref_lse = attention_reference(qs, ks, vs, causal) if lk else (
            torch.zeros(1, h, lq, head_dim, dtype=torch.float64, device="cuda"),
            torch.full((1, h, lq), float("-inf"), dtype=torch.float64, device="cuda"))
        got = o[rows].transpose(0, 1).unsqueeze(0)
        assert not torch.isnan(got).any()
        if ref.norm() > 0:
            assert rel_err(got, ref) <= TOLERANCE[dtype], (b, lq, lk)
        empty = torch.isneginf(ref_lse[0])
        assert torch.equal(torch.isneginf(lse[b, :, :lq]), empty) and (got[0][empty] == 0).all()
        finite = ~empty
        if finite.any():
            gap = (lse[b, :, :lq].double() - ref_lse[0]).abs()[finite].max().item()
            assert gap <= 1e-3 * max(1.0, ref_lse[0][finite].abs().max().item())
        assert torch.isneginf(lse[b, :, lq:]).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 128)])
def test_varlen_equals_per_sequence_reference(dtype, head_dim, causal):
    name = instance_for(dtype, head_dim)
    lens_q, lens_k = [1, 17, 127, 129, 1000, 0], [17, 1, 129, 127, 1000, 5]
    h, hkv = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn((sum(lens_q), h, head_dim), dtype, ("vq", dtype, causal))
    k = randn((sum(lens_k), hkv, head_dim), dtype, ("vk", dtype, causal))
    v = randn((sum(lens_k), hkv, head_dim), dtype, ("vv", dtype, causal))
    o, lse = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_lse=True, instance=name)
    check_varlen(q, k, v, cu_q, cu_k, o, lse, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_non_contiguous_cu_seqlens(causal):
    """Offsets given as strided views run on the values the view shows (the kernel reads an array)."""
    name = instance_for(torch.bfloat16, 128)
    # Every other element: the views read [0, 50, 200] and [0, 17, 200]; the memory holds other values.
    cu_q = torch.tensor([0, 120, 50, 170, 200], dtype=torch.int32, device="cuda")[::2]
    cu_k = torch.tensor([[0, 1], [17, 1], [200, 1]], dtype=torch.int32, device="cuda")[:, 0]
    assert not cu_q.is_contiguous() and not cu_k.is_contiguous()
    q = randn((200, 4, 128), torch.bfloat16, ("vnc-q", causal))
    k = randn((200, 2, 128), torch.bfloat16, ("vnc-k", causal))
    v = randn((200, 2, 128), torch.bfloat16, ("vnc-v", causal))
    o, lse = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 150, 183, causal=causal, return_lse=True,
                                            instance=name)
    check_varlen(q, k, v, cu_q, cu_k, o, lse, causal)
    again = gemmgen.fused_attention_varlen(q, k, v, cu_q.contiguous(), cu_k.contiguous(), 150, 183,
                                           causal=causal, instance=name)
    assert torch.equal(o, again)


def test_varlen_dropout_reproducible_and_compiles():
    name = instance_for(torch.float16, 64)
    lens = [5, 64, 130]
    cu = torch.tensor([0, 5, 69, 199], dtype=torch.int32, device="cuda")
    q, k, v = (randn((sum(lens), 2, 64), torch.float16, ("vd", t)) for t in "qkv")
    args = (q, k, v, cu, cu, 130, 130)
    a = gemmgen.fused_attention_varlen(*args, dropout_p=0.25, seed=5, instance=name)
    assert torch.equal(a, gemmgen.fused_attention_varlen(*args, dropout_p=0.25, seed=5, instance=name))
    compiled = torch.compile(lambda *t: gemmgen.fused_attention_varlen(*t, dropout_p=0.25, seed=5, instance=name),
                             fullgraph=True)
    assert torch.equal(compiled(*args), a)


def test_compile_fullgraph_and_cuda_graph_with_features():
    name = instance_for(torch.bfloat16, 128)
    q, k, v = make_qkv(2, 4, 4, 127, 129, 128, torch.bfloat16, "mea-compile")
    mask = randn((127, 129), torch.bfloat16, "mea-compile-mask")

    def f(q, k, v, mask):
        return gemmgen.fused_attention(q, k, v, attn_mask=mask, dropout_p=0.1, seed=3, instance=name)

    eager = f(q, k, v, mask)
    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v, mask), eager)
    f(q, k, v, mask)  # warm the kernel cache outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(q, k, v, mask)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
