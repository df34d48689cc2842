"""Head dims without tiles (gemmgen.ops.padding): which head dim a call runs at, and the padded
call fused_attention makes (with the op stood in by a float64 CPU implementation: the padding, the
scale and the cut, forward and backward, against torch's math on the unpadded tensors). The GPU
side, on the real kernels: tests/gpu/test_fused_attention.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gemmgen
from gemmgen.ops import attention, padding


def test_tile_head_dims_are_the_default_families():
    assert padding.tile_head_dims() == (32, 64, 96, 128, 160, 192, 256)


@pytest.mark.parametrize("d, want", [(1, 32), (8, 32), (32, 32), (40, 64), (59, 64), (64, 64), (80, 96),
                                     (111, 128), (129, 160), (200, 256), (224, 256), (256, 256), (257, 257),
                                     (0, 0)])
def test_padded_head_dim(d, want):
    assert padding.padded_head_dim(d) == want


def test_needs_padding_only_for_equal_head_dims_without_tiles():
    t = lambda d: torch.empty(1, 2, 3, d)  # noqa: E731
    assert padding.needs_padding(t(80), t(80), t(80)) == 96
    assert padding.needs_padding(t(64), t(64), t(64)) is None
    assert padding.needs_padding(t(80), t(81), t(80)) is None  # the checks report the mismatch
    assert padding.needs_padding(t(80), None, t(80)) is None
    assert padding.needs_padding(t(300), t(300), t(300)) is None


@pytest.fixture
def stand_in(monkeypatch):
    """The unpadded fused_attention path replaced, below the padding, by torch's float64 math:
    records each call's head dim and scale."""
    calls = []
    real = attention.fused_attention

    def fused_attention(q, k, v, **kw):
        if padding.needs_padding(q, k, v) is not None:
            return real(q, k, v, **kw)  # the padding path, which calls back into this
        calls.append((q.shape[-1], kw.get("scale")))
        s = (kw["scale"] if kw.get("scale") is not None else q.shape[-1] ** -0.5) * q @ k.transpose(-2, -1)
        if kw.get("causal"):
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, -1) @ v
        return (o, torch.logsumexp(s, -1)) if kw.get("return_lse") else o

    monkeypatch.setattr(attention, "fused_attention", fused_attention)
    return calls


@pytest.mark.parametrize("d", [40, 59, 80])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_a_padded_call_matches_the_unpadded_math(stand_in, d, scale):
    gen = torch.Generator().manual_seed(d)
    # q from a [B, N, H, d] projection (a transposed view), k and v contiguous.
    q = torch.randn(2, 7, 3, d, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 3, 9, d, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    do = torch.randn(2, 3, 7, d, generator=gen, dtype=torch.float64)
    o, lse = attention.fused_attention(q, k, v, causal=True, scale=scale, return_lse=True)
    assert stand_in == [(padding.padded_head_dim(d), pytest.approx(scale if scale is not None else 1 / math.sqrt(d)))]
    assert o.shape == q.shape and o.stride() == q.stride()  # O in q's layout
    o.backward(do)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = torch.ones(7, 9, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    want.backward(do)
    torch.testing.assert_close(o, want)
    s = (scale if scale is not None else d ** -0.5) * q @ k.transpose(-2, -1)
    torch.testing.assert_close(lse, torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1))
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_a_padded_call_writes_out(stand_in):
    q, k, v = (torch.randn(1, 2, 5, 80, dtype=torch.float64) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    o = attention.fused_attention(q, k, v, out=out)
    assert o is out and not torch.isnan(out).any()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_out_of_a_padded_call_is_checked_against_q(stand_in):
    q, k, v = (torch.randn(1, 2, 5, 80, dtype=torch.float64) for _ in range(3))
    with pytest.raises(gemmgen.InputError, match="out must have q's shape"):
        attention.fused_attention(q, k, v, out=torch.empty(1, 2, 5, 96, dtype=torch.float64))
    with pytest.raises(gemmgen.InputError, match="overlaps"):
        attention.fused_attention(q, k, v, out=q)
    with pytest.raises(gemmgen.InputError, match="no backward"):
        attention.fused_attention(q.requires_grad_(), k, v, out=torch.empty_like(q))


def test_the_backward_pads_to_a_faster_familys_head_dim(tmp_path):
    """selection.padded_backward_head_dim on a build without libraries: at head dim 96 on Hopper
    only mea_bwd_sm80 runs the exact call, fmha_bwd_sm90 runs 128 (1.8 / 0.2 weighs more than the
    third more columns); 64 has an fmha_bwd_sm90 tile; an Ampere GPU keeps mea_bwd_sm80 at 96;
    deterministic calls and dropout pad too (the split-dQ instances run them: `_dropout` at 128, the
    mask independent of the head dim)."""
    import dataclasses

    from conftest import make_entry, write_build_dir
    from gemmgen.generator.families import fmha_bwd_sm90, mea_bwd_sm80
    from gemmgen.select import device, registry, selection
    from gemmgen.select.problem import BwdProblem

    hopper = ["-gencode=arch=compute_90a,code=sm_90a"]
    entries = [make_entry(i) for i in mea_bwd_sm80.DEFAULT if i.dtype.value == "bf16"]
    entries += [dataclasses.replace(make_entry(i), gencode=hopper) for i in fmha_bwd_sm90.DEFAULT
                if i.dtype.value == "bf16"]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    h100, a100 = device.synthetic((9, 0), 132), device.synthetic((8, 0), 108)
    try:
        def problem(d, dev=h100, **kw):
            return BwdProblem("bf16", d, True, dev, batch_heads=64, seqlen_q=2048, seqlen_k=2048, **kw)

        assert selection.select(problem(96)).entry.family == "mea_bwd_sm80"
        assert selection.padded_backward_head_dim(problem(96)) == 128
        assert selection.select(problem(128)).entry.family == "fmha_bwd_sm90"
        assert selection.padded_backward_head_dim(problem(64)) == 64
        assert selection.padded_backward_head_dim(problem(40)) == 64
        assert selection.padded_backward_head_dim(problem(96, a100)) == 96
        assert selection.padded_backward_head_dim(problem(96, dropout=True)) == 128
        assert selection.padded_backward_head_dim(problem(96, deterministic=True)) == 128  # split-dQ takes turns
        assert selection.padded_backward_head_dim(problem(192)) == 192  # no Hopper backward tile above
    finally:
        registry.set_build_dirs(None)
