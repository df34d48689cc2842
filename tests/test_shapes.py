"""Shapes: parsing "B,H,N,d[,causal]" and the FlashAttention sweep."""
from __future__ import annotations

import pytest

from gemmgen.select import shapes
from gemmgen.errors import InputError


def test_parse_shape():
    s = shapes.parse_shape("2,16,1000,128")
    assert (s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal) == (2, 16, 1000, 1000, 128, False)
    s = shapes.parse_shape(" 2, 16, 100, 300, 64, causal ", dtype="fp16", heads_kv=4, layout="bnhd")
    assert (s.seqlen_q, s.seqlen_k, s.causal, s.dtype, s.kv_heads, s.layout) == (100, 300, True, "fp16", 4, "bnhd")
    assert s.describe() == "B=2 H=16 Hkv=4 Nq=100 Nk=300 d=64 fp16 causal bnhd"
    assert s.spec() == "2,16,4,100,300,64"
    assert s.flops == 4 * 2 * 16 * 100 * 300 * 64 / 2


@pytest.mark.parametrize("text", ["", "1,2,3", "1,2,3,4,5,6", "1,2,x,4", "1,2,3,4,causal,causal", "-1,2,3,4"])
def test_malformed(text):
    with pytest.raises(InputError):
        shapes.parse_shape(text)


def test_fa_sweep():
    sweep = shapes.fa_sweep()
    assert len(sweep) == 2 * 2 * 2 * 6
    assert sweep[0].describe() == "B=32 H=32 Nq=Nk=512 d=64 bf16"
    assert sweep[-1].describe() == "B=1 H=16 Nq=Nk=16384 d=128 fp16 causal"
    assert all(s.batch * s.seqlen_q == shapes.TOKENS and s.heads * s.head_dim == shapes.HIDDEN for s in sweep)
    assert shapes.sweep("fa", dtypes=("fp16",)) == shapes.fa_sweep(dtypes=("fp16",))
    with pytest.raises(InputError, match="unknown sweep 'x'"):
        shapes.sweep("x")
