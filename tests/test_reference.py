"""The float64 reference on CPU: masks, GQA and rows that see no key."""
from __future__ import annotations

import math

import pytest
import torch

from gemmgen.ops.reference import attention_reference, causal_offset


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("nq, nk", [(5, 5), (3, 7), (7, 3)])
def test_matches_sdpa_top_left(nq, nk):
    q, k, v = rand(2, 3, nq, 8, seed=1), rand(2, 3, nk, 8, seed=2), rand(2, 3, nk, 8, seed=3)
    for causal in (False, True):
        o, lse = attention_reference(q, k, v, causal)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(o, want, atol=1e-12)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
        if not causal:
            assert torch.allclose(lse, torch.logsumexp(s, -1))


def test_bottom_right_and_empty_rows():
    q, k, v = rand(1, 2, 6, 8, seed=4), rand(1, 2, 3, 8, seed=5), rand(1, 2, 3, 8, seed=6)
    o, lse = attention_reference(q, k, v, True, "bottom_right", scale=0.5)
    assert causal_offset(6, 3, "bottom_right") == -3
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))  # rows 0..2 see no key
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert not torch.isnan(o).any()
    mask = torch.arange(3)[None, :] <= torch.arange(6)[:, None] - 3
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, 3:], k, v, attn_mask=mask[3:], scale=0.5)
    assert torch.allclose(o[:, :, 3:], want, atol=1e-12)


def test_gqa_equals_repeated_heads():
    q, k, v = rand(1, 8, 5, 8, seed=7), rand(1, 2, 5, 8, seed=8), rand(1, 2, 5, 8, seed=9)
    o, _ = attention_reference(q, k, v, scale=-0.3)
    o2, _ = attention_reference(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), scale=-0.3)
    assert torch.equal(o, o2) and o.dtype == torch.float64


def test_bad_alignment():
    with pytest.raises(ValueError, match="top_left, bottom_right"):
        causal_offset(1, 1, "middle")
