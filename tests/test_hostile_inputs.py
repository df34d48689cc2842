"""Inputs a hostile caller passes, on CPU tensors: validation runs before the device check, so each
bad input raises InputError naming the argument and each well-formed call DeviceError; nothing
else escapes (no TypeError, OverflowError, AttributeError), and nothing large is allocated first."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.ops import attention

FP16 = torch.float16


def qkv(nq=16, nk=16, d=64):
    return (torch.randn(1, 2, nq, d, dtype=FP16), torch.randn(1, 2, nk, d, dtype=FP16),
            torch.randn(1, 2, nk, d, dtype=FP16))


def mat(m=8, n=8):
    return torch.randn(m, n, dtype=FP16)


ATTENTION_BAD = [
    ("causal='no'", lambda q, k, v: gemmgen.fused_attention(q, k, v, causal="no"), "causal must be a bool"),
    ("causal=1", lambda q, k, v: gemmgen.fused_attention(q, k, v, causal=1), "causal must be a bool"),
    ("return_lse='no'", lambda q, k, v: gemmgen.fused_attention(q, k, v, return_lse="no"), "return_lse must be a bool"),
    ("scale=10**400", lambda q, k, v: gemmgen.fused_attention(q, k, v, scale=10**400), "scale must be a finite"),
    ("scale=nan", lambda q, k, v: gemmgen.fused_attention(q, k, v, scale=float("nan")), "scale must be finite"),
    ("instance=['x']", lambda q, k, v: gemmgen.fused_attention(q, k, v, instance=["x"]), "instance must be"),
    ("causal_alignment=5", lambda q, k, v: gemmgen.fused_attention(q, k, v, causal_alignment=5), "causal_alignment"),
    ("out=q", lambda q, k, v: gemmgen.fused_attention(q, k, v, out=q), "out overlaps q"),
    ("out=v", lambda q, k, v: gemmgen.fused_attention(q, k, v, out=v), "out overlaps v"),
    ("sparse mask", lambda q, k, v: gemmgen.fused_attention(
        q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool).to_sparse()), "attn_mask must be a dense"),
    ("varlen causal='no'", lambda q, k, v: gemmgen.fused_attention_varlen(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), torch.tensor([0, 16], dtype=torch.int32),
        torch.tensor([0, 16], dtype=torch.int32), 16, 16, causal="no"), "causal must be a bool"),
    ("explain instance=['x']", lambda q, k, v: gemmgen.explain(q, k, v, instance=["x"]), "instance must be"),
    ("selected_instance causal='yes'", lambda q, k, v: gemmgen.selected_instance(q, k, v, causal="yes"),
     "causal must be a bool"),
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in ATTENTION_BAD], ids=[i for i, _, _ in ATTENTION_BAD])
def test_attention_bad_arguments_raise_input_error(call, match):
    with pytest.raises(gemmgen.InputError, match=match):
        call(*qkv())


GEMM_BAD = [
    ("b_transposed='yes'", lambda: gemmgen.batched_gemm(mat()[None, None], mat()[None, None], b_transposed="yes"),
     "b_transposed must be a bool"),
    ("instance=['x']", lambda: gemmgen.batched_gemm(mat()[None, None], mat()[None, None], instance=["x"]),
     "instance must be"),
    ("alpha=10**400", lambda: gemmgen.batched_gemm(mat()[None, None], mat()[None, None], alpha=10**400),
     "alpha must be a finite"),
    ("out=a", lambda: (lambda a: gemmgen.batched_gemm(a, a.clone(), out=a))(mat()[None, None]), "out overlaps a"),
    ("ptrs(None, [m])", lambda: gemmgen.batched_gemm_ptrs(None, [mat()]), "a_list must be a list"),
    ("out_list=5", lambda: gemmgen.batched_gemm_ptrs([mat()], [mat()], out_list=5), "out_list must be a list"),
    ("out_list=[None]", lambda: gemmgen.batched_gemm_ptrs([mat()], [mat()], out_list=[None]),
     r"out_list\[0\] must be a torch.Tensor"),
    ("out_list aliasing", lambda: (lambda c: gemmgen.batched_gemm_ptrs([mat(), mat()], [mat(), mat()], out_list=[c, c]))(mat()),
     r"out_list\[0\] overlaps out_list\[1\]"),
    ("out_list rows overlap", lambda: gemmgen.batched_gemm_ptrs(
        [mat()], [mat()], out_list=[torch.empty(1, 8, dtype=FP16).expand(8, 8)]), "elements overlap"),
    ("out_list is an input", lambda: (lambda a: gemmgen.batched_gemm_ptrs([a], [mat()], out_list=[a]))(mat()),
     r"out_list\[0\] overlaps a_list\[0\]"),
    ("ptrs alpha=inf", lambda: gemmgen.batched_gemm_ptrs([mat()], [mat()], alpha=float("inf")), "alpha must be finite"),
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in GEMM_BAD], ids=[i for i, _, _ in GEMM_BAD])
def test_gemm_bad_arguments_raise_input_error(call, match):
    with pytest.raises(gemmgen.InputError, match=match):
        call()


def test_a_repeated_gemm_call_checks_its_arguments_too():
    a = mat()[None, None]
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.batched_gemm(a, a)
    with pytest.raises(gemmgen.InputError, match="instance must be"):
        gemmgen.batched_gemm(a, a, instance=["x"])


def test_well_formed_calls_on_cpu_raise_device_error():
    q, k, v = qkv()
    for call in (lambda: gemmgen.fused_attention(q, k, v, causal=True, return_lse=True, scale=10**3),
                 lambda: gemmgen.fused_attention(q, k, v, out=torch.empty_like(q)),
                 lambda: gemmgen.batched_gemm(mat()[None, None], mat()[None, None], alpha=3),
                 lambda: gemmgen.batched_gemm_ptrs([mat(), mat()], [mat(), mat()])):
        with pytest.raises(gemmgen.DeviceError):
            call()


def test_nothing_large_is_allocated_before_the_device_check():
    """A 2**31 - 1 row expanded q with a mask that needs padding, and an expanded GEMM operand whose C
    would take 34 GB: the device check comes first (no RuntimeError from a failed allocation)."""
    rows = 2**31 - 1
    q = torch.zeros(1, 1, 1, 64, dtype=FP16).expand(1, 1, rows, 64)
    k = torch.zeros(1, 1, 3, 64, dtype=FP16)
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention(q, k, k, attn_mask=torch.zeros(1, 1, rows, 3, dtype=FP16).expand(1, 1, rows, 3)
                                .as_strided((1, 1, rows, 3), (0, 0, 0, 1)))
    a = torch.zeros(1, 1, 1, 8, dtype=FP16).expand(1, 1, rows, 8)
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.batched_gemm(a, torch.zeros(1, 1, 8, 8, dtype=FP16))


def test_meta_tensors_in_varlen_are_a_device_error():
    q = torch.empty(16, 2, 64, dtype=FP16, device="meta")
    cu = torch.tensor([0, 16], dtype=torch.int32, device="meta")
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention_varlen(q, q, q, cu, cu, 16, 16)


@pytest.mark.parametrize("nk", [100, 64, 3, 1])
def test_row_and_head_broadcasts_of_a_mask_stay_broadcasts(nk):
    """[1, 1, 1, Nk] and [1, 1, Nq, Nk] masks keep stride 0 over what they broadcast, for every Nk
    (a padded copy holds one row per distinct row, not Nq of them)."""
    q = torch.randn(2, 4, 4096, 64, dtype=FP16)
    k = torch.randn(2, 4, nk, 64, dtype=FP16)
    for mask in (torch.zeros(1, 1, 1, nk, dtype=FP16), torch.rand(1, 1, 1, nk) > 0.5):
        bias = attention._prepare_mask(mask, q, k)
        assert bias.shape == (2, 4, 4096, nk) and bias.stride()[:3] == (bias.stride(0), 0, 0)
        assert bias.untyped_storage().nbytes() <= 2 * (-(-nk // 8) * 8) * 2
        want = torch.zeros(nk, dtype=FP16).masked_fill(~mask[0, 0, 0], float("-inf")) \
            if mask.dtype == torch.bool else mask[0, 0, 0]
        assert torch.equal(bias[1, 3, 4095], want)
    per_row = torch.randn(4096, nk, dtype=FP16)
    bias = attention._prepare_mask(per_row, q, k)
    assert bias.stride()[:2] == (bias.stride(0), 0) and torch.equal(bias[1, 2], per_row)
