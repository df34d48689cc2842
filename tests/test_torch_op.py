"""The custom ops without a GPU: schemas, fake implementations (O in q's layout, LSE float32) and a
torch.compile trace of fused_attention in one graph (fullgraph=True), on fake CUDA tensors."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gemmgen
from gemmgen.ops import torch_op

FP16 = torch.float16


def fake_qkv(mode: FakeTensorMode, layout: str = "bhnd"):
    with mode:
        if layout == "bnhd":
            q = torch.empty(2, 17, 4, 64, dtype=FP16, device="cuda").transpose(1, 2)
            k = torch.empty(2, 19, 2, 64, dtype=FP16, device="cuda").transpose(1, 2)
        elif layout == "sliced":
            q = torch.empty_strided((2, 4, 17, 64), (4 * 17 * 128, 17 * 128, 128, 1), dtype=FP16, device="cuda")
            k = torch.empty(2, 2, 19, 64, dtype=FP16, device="cuda")
        else:
            q = torch.empty(2, 4, 17, 64, dtype=FP16, device="cuda")
            k = torch.empty(2, 2, 19, 64, dtype=FP16, device="cuda")
    return q, k, k


def test_schemas():
    assert torch_op.fused_attention_op is torch.ops.gemmgen.fused_attention.default
    assert "Tensor(a!) out" in str(torch.ops.gemmgen.fused_attention_out.default._schema)
    assert str(torch.ops.gemmgen.fused_attention.default._schema).endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("layout, strides", [("bhnd", (4 * 17 * 64, 17 * 64, 64, 1)),
                                             ("bnhd", (17 * 4 * 64, 64, 4 * 64, 1)),
                                             ("sliced", (4 * 17 * 64, 17 * 64, 64, 1))])
def test_fake_implementation(layout, strides):
    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode, layout)
    with mode:
        o, lse = torch.ops.gemmgen.fused_attention(q, k, v, True, "bottom_right", None, True, None)
        _, no_lse = torch.ops.gemmgen.fused_attention(q, k, v)
        out = torch.empty_like(q)
        lse_out = torch.ops.gemmgen.fused_attention_out(q, k, v, out, return_lse=True)
    assert o.shape == q.shape and o.stride() == strides and o.dtype == FP16 and o.device.type == "cuda"
    assert lse.shape == (2, 4, 17) and lse.dtype == torch.float32 and no_lse.numel() == 0
    assert lse_out.shape == (2, 4, 17)


def test_wrapper_on_fake_tensors_matches_the_layout():
    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode, "bnhd")
    with mode:
        o, lse = gemmgen.fused_attention(q, k, v, causal=True, return_lse=True)
    assert o.stride() == q.stride() and lse.shape == q.shape[:3]


def test_compiles_into_one_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, out):
        o, lse = gemmgen.fused_attention(q, k, v, causal=True, return_lse=True)
        gemmgen.fused_attention(q, k, v, out=out, scale=0.5)
        return o * 2, lse

    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode)
    with mode:
        out = torch.empty_like(q)
        torch.compile(f, backend=backend, fullgraph=True)(q, k, v, out)
    assert len(graphs) == 1
    code = graphs[0].code
    assert "torch.ops.gemmgen.fused_attention.default" in code
    assert "torch.ops.gemmgen.fused_attention_out.default" in code


def _grad_cases():
    q = torch.randn(1, 2, 8, 64, dtype=FP16)
    return q, q.clone(), q.clone()


@pytest.mark.parametrize("which", ["q", "k", "v", "attn_mask"])
def test_fused_attention_takes_inputs_that_require_grad(which):
    """fused_attention is differentiable: inputs that require grad pass its checks (here on to the
    device check of CPU tensors); with out= there is no backward, so they raise naming the input."""
    q, k, v = _grad_cases()
    args = {"q": q, "k": k, "v": v, "attn_mask": torch.zeros(8, 8, dtype=FP16)}
    args[which].requires_grad_()
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention(**args)
    with pytest.raises(gemmgen.InputError, match=f"fused_attention with out= has no backward pass: {which} requires"):
        gemmgen.fused_attention(**args, out=torch.empty_like(q))
    for scope in (torch.no_grad, torch.inference_mode):
        with scope(), pytest.raises(gemmgen.DeviceError):
            gemmgen.fused_attention(**args, out=torch.empty_like(q))


def test_backward_context_refuses_what_it_cannot_differentiate():
    """The autograd forward (setup_context) needs the LSE and, with dropout, the seed; it saves the
    rest and marks LSE non-differentiable."""
    class Ctx:
        def save_for_backward(self, *t):
            self.saved = t

        def mark_non_differentiable(self, *t):
            self.nondiff = t

    q = torch.randn(1, 2, 0, 64, dtype=FP16)  # empty: no kernel selection on a machine without a GPU
    lse = torch.empty(1, 2, 0)
    base = [q, q, q, False, "top_left", None, True, None, 0.0, None, 0, None, False]
    with pytest.raises(gemmgen.InputError, match="needs return_lse=True"):
        torch_op._setup_context(Ctx(), base[:6] + [False] + base[7:], (q, torch.empty(0)))
    with pytest.raises(gemmgen.InputError, match="needs an explicit seed"):
        torch_op._setup_context(Ctx(), base[:8] + [0.1] + base[9:], (q, lse))
    ctx = Ctx()
    torch_op._setup_context(ctx, base, (q, lse))
    assert ctx.saved[4] is lse and ctx.nondiff == (lse,) and ctx.args[-4:] == (False, False, None, 0.0)


def test_backward_fake_and_gqa_expansion():
    q = torch.randn(2, 6, 5, 32, dtype=FP16).transpose(1, 2).transpose(1, 2)
    k = torch.randn(2, 9, 3, 32, dtype=FP16).transpose(1, 2)  # [B, Hkv=3, N=9, d] in BNHD storage
    dq, dk, dv, dbias = torch_op._fake_backward(q, q, k, k, q, None, False, "top_left", None, 0.0, 0, 0, None,
                                                True, False)
    assert dq.shape == q.shape and dk.shape == k.shape and dk.stride() == torch_op.launch.empty_like_layout(k).stride()
    assert dbias.shape == (2, 6, 5, 9)
    e = torch_op.launch.expand_heads(k, 2)
    assert torch.equal(e, k.repeat_interleave(2, dim=1)) and e.stride()[2] > e.stride()[1]


def test_varlen_takes_and_gemm_refuses_inputs_that_require_grad():
    """fused_attention_varlen is differentiable: an input that requires grad passes its checks (here
    on to the device check of CPU tensors); the batched GEMMs have no backward and refuse one."""
    q = torch.randn(8, 2, 64, dtype=FP16, requires_grad=True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention_varlen(q, q.detach(), q.detach(), cu, cu, 8, 8, dropout_p=0.1)
    a = torch.randn(1, 1, 8, 8, dtype=FP16)
    b = a.clone().requires_grad_()
    with pytest.raises(gemmgen.InputError, match="batched_gemm has no backward pass: b requires grad"):
        gemmgen.batched_gemm(a, b)
    with pytest.raises(gemmgen.InputError, match=r"batched_gemm_ptrs has no backward pass: b_list\[0\]"):
        gemmgen.batched_gemm_ptrs([a[0, 0]], [b[0, 0]])
    with torch.no_grad(), pytest.raises(gemmgen.DeviceError):
        gemmgen.batched_gemm(a, b)


def test_the_op_implementations_without_backward_refuse_inputs_that_require_grad():
    """Reached with grad mode on (a direct torch.ops call: no autograd kernel stands in front), the
    op without a backward (out=) raises before any allocation or launch; under no_grad it goes on
    (here, to the device check of a CPU tensor)."""
    q = torch.randn(1, 2, 8, 64, dtype=FP16, requires_grad=True)

    def call():
        return torch_op._fused_attention_out(q, q, q, torch.empty(1, 2, 8, 64, dtype=FP16))

    with pytest.raises(gemmgen.InputError, match="has no backward pass: q, k, v require grad"):
        call()
    with torch.no_grad(), pytest.raises(Exception) as info:
        call()
    assert not isinstance(info.value, gemmgen.InputError)
