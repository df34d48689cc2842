"""The backward's Python side without a GPU: torch.ops.gemmgen.fused_attention's autograd
(register_autograd), what the forward saves, GQA expansion and the group sums, the gradients'
layouts, dO that the kernel cannot read as it is, empty sizes, the mask's gradient and double
backward. The CUDA kernels are replaced by float64 torch code behind the same C ABI params (the
test registers CPU implementations of the two ops for its duration), so everything from the autograd
kernel to the params a backward instance receives runs as on the GPU."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.ops import attention, torch_op
from gemmgen.select.reference import causal_offset

FP16 = torch.float16


def ref_forward(q, k, v, causal, alignment, scale, bias=None):
    """float64 O and natural-log LSE; rows that see no key give 0 and -inf."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    s = scale * (q.double() @ k.double().repeat_interleave(g, 1).transpose(-2, -1))
    if bias is not None:
        s = s + bias.double()
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        rows, cols = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        s = s.masked_fill(cols > rows + causal_offset(nq, nk, alignment), float("-inf"))
    seen = (s > float("-inf")).any(-1, keepdim=True)
    w = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(torch.where(seen, s, 0.0), -1), float("-inf"))
    return w @ v.double().repeat_interleave(g, 1), lse


class FakeKernel:
    """A backward "instance" that computes the gradients in float64 from the tensors behind the
    params' pointers (kept by the patched set_bwd_pointers) and checks what the C ABI promises it."""

    calls: list = []
    reads_gqa = False  # abi.INFO_READS_GQA: K and V at their own heads, dK and dV per query head

    def workspace_bytes(self, p):
        return 0

    def run(self, p, stream):
        t = p._tensors
        for name in ("q", "k", "v", "o", "d_o", "lse", "dq", "dk", "dv", "bias", "dbias"):
            if t[name] is not None:  # this call's pointers, not an earlier call's of the same key
                assert getattr(p, name) == t[name].data_ptr(), f"{name}'s pointer"
        q, k, v, d_o, lse = t["q"], t["k"], t["v"], t["d_o"], t["lse"]
        group = q.shape[1] // k.shape[1]
        assert p.heads_kv == k.shape[1] and q.shape[1] == group * k.shape[1]
        assert self.reads_gqa or group == 1, "K and V reach an instance without READS_GQA with Q's heads"
        assert t["dk"].shape[1] == t["dv"].shape[1] == q.shape[1], "dK and dV per query head"
        for name in ("q", "k", "v", "o", "d_o", "dq", "dk", "dv"):
            assert torch_op._kernel_ready(t[name]), f"{name} is not readable by a kernel"
        assert lse.is_contiguous() and lse.dtype == torch.float32
        causal = p.causal_offset != launch.NO_MASK_OFFSET
        leaves = [x.detach().double().repeat_interleave(r, 1).requires_grad_()
                  for x, r in ((q, 1), (k, group), (v, group))]
        bias = t.get("bias")
        b64 = bias.detach().double().requires_grad_() if bias is not None else None
        offset_alignment = "top_left" if p.causal_offset == 0 else "bottom_right"
        with torch.enable_grad():  # the backward runs with grad mode off
            out, ref_lse = ref_forward(*leaves, causal, offset_alignment, p.scale, b64)
            grads = torch.autograd.grad(out, leaves + ([b64] if b64 is not None else []), d_o.double())
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse.double()[finite], ref_lse[finite].detach(), atol=1e-3), "the forward's LSE"
        for name, g in zip(("dq", "dk", "dv"), grads):
            t[name].copy_(g)
        if p.dbias:
            t["dbias"].copy_(grads[3])
        FakeKernel.calls.append(p)


def cpu_forward(q, k, v, causal=False, causal_alignment="top_left", scale=None, return_lse=False, instance=None,
                dropout_p=0.0, seed=None, offset=0, bias=None, deterministic=False, window=None, softcap=0.0):
    """The forward op's outputs from the float64 reference, in q's layout."""
    assert window is None and softcap == 0.0, "these tests run no sliding window or softcap"
    o, lse = ref_forward(q, k, v, causal, causal_alignment, scale, bias)
    out = launch.empty_like_layout(q)
    out.copy_(o)
    return out, (lse.float() if return_lse else torch.empty(0))


@pytest.fixture(params=[False, True], ids=["expanded-kv", "reads-gqa"])
def cpu_ops(monkeypatch, cpu_ops_library, request):
    """CPU implementations of the forward (float64 reference) and the real backward implementation
    with FakeKernel behind it, an instance that takes K and V expanded to Q's heads or one that
    reads them at their own heads; removed afterwards."""
    forward = cpu_forward
    real_set = launch.set_bwd_pointers

    def set_bwd_pointers(p, q, k, v, o, d_o, lse, dq, dk, dv, bias=None, dbias=None):
        real_set(p, q, k, v, o, d_o, lse, dq, dk, dv, bias, dbias)
        p._tensors = dict(q=q, k=k, v=v, o=o, d_o=d_o, lse=lse, dq=dq, dk=dk, dv=dv, bias=bias, dbias=dbias)

    monkeypatch.setattr(launch, "set_bwd_pointers", set_bwd_pointers)
    monkeypatch.setattr(torch_op, "_kernels", {})  # plans of FakeKernel stay in this test
    monkeypatch.setattr(torch_op, "_bwd_kernel", lambda *a, **kw: FakeKernel())
    # The selection stood in: the backward runs at q's own head dim (padding: tests/test_padding.py).
    monkeypatch.setattr(torch_op, "_bwd_head_dim", lambda q, *a, **kw: q.shape[-1])
    FakeKernel.calls = []
    monkeypatch.setattr(FakeKernel, "reads_gqa", request.param)
    cpu_ops_library(fused_attention=forward, fused_attention_backward=torch_op._fused_attention_backward)


def grads_of(q, k, v, do, bias=None, **kw):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    extra = [bias] if bias is not None else []
    o, _ = torch.ops.gemmgen.fused_attention(*leaves, return_lse=True, bias=bias, **kw)
    return torch.autograd.grad(o, leaves + extra, do)


def ref_grads(q, k, v, do, bias=None, causal=False, causal_alignment="top_left", scale=None):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    b64 = [bias.detach().double().requires_grad_()] if bias is not None else []
    o, _ = ref_forward(*leaves, causal, causal_alignment, scale, *b64)
    return torch.autograd.grad(o, leaves + b64, do.double())


@pytest.mark.parametrize("scale", [None, 0.3])
def test_a_backward_padded_to_a_larger_head_dim(cpu_ops, monkeypatch, scale):
    """Where selection weighs a larger head dim faster (gemmgen.ops.padding), the backward runs on
    zero-padded copies of dO, Q, K, V and O at the real head dim's scale, and its gradients come back
    cut to that head dim in the inputs' layouts: GQA, [B, N, H, d] views, causal bottom-right."""
    monkeypatch.setattr(torch_op, "_bwd_head_dim", lambda q, *a, **kw: 32 if q.shape[-1] == 24 else q.shape[-1])
    gen = torch.Generator().manual_seed(24)

    def make(heads, n):
        return torch.randn(2, n, heads, 24, generator=gen, dtype=torch.float64).to(FP16).transpose(1, 2)

    q, k, v, do = make(8, 17), make(2, 29), make(2, 29), make(8, 17)
    got = grads_of(q, k, v, do, causal=True, causal_alignment="bottom_right", scale=scale)
    want = ref_grads(q, k, v, do, causal=True, causal_alignment="bottom_right", scale=scale)
    for name, g, w, x in zip(("dQ", "dK", "dV"), got, want, (q, k, v)):
        assert g.shape == x.shape and g.stride() == x.stride(), f"{name} not in its input's layout"
        assert torch.allclose(g.double(), w, rtol=1e-2, atol=8e-3), name
    (p,) = FakeKernel.calls
    assert p.head_dim == 32 and p.scale == pytest.approx(0.3 if scale is not None else 24 ** -0.5)


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("causal, alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_gradients_layouts_and_group_sums(cpu_ops, h, hkv, layout, causal, alignment):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((h, hkv, layout, causal, alignment)).encode()))
    nq, nk, d = 17, 29, 32

    def make(heads, n):
        t = torch.randn(2, heads, n, d, generator=gen, dtype=torch.float64).to(FP16)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bnhd" else t

    q, k, v, do = make(h, nq), make(hkv, nk), make(hkv, nk), make(h, nq)
    got = grads_of(q, k, v, do, causal=causal, causal_alignment=alignment, scale=0.3)
    want = ref_grads(q, k, v, do, causal=causal, causal_alignment=alignment, scale=0.3)
    for name, g, w, x in zip(("dQ", "dK", "dV"), got, want, (q, k, v)):
        assert g.shape == x.shape and g.stride() == x.stride(), f"{name} not in its input's layout"
        # dK and dV of a KV head sum h / hkv per-head gradients, each rounded to fp16 first: the
        # sum carries that many roundings even where it cancels to a small value.
        atol = 2e-3 * (h // hkv if name != "dQ" else 1)
        assert torch.allclose(g.double(), w, rtol=1e-2, atol=atol), name
    assert len(FakeKernel.calls) == 1 and FakeKernel.calls[0].heads == h


def test_calls_of_one_key_share_a_plan_with_their_own_pointers(cpu_ops):
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):  # the second call copies the first's params and sets its own pointers
        q, k, v, do = (torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64).to(FP16) for _ in range(4))
        got = grads_of(q, k, v, do, causal=True)
        for name, g, w in zip(("dQ", "dK", "dV"), got, ref_grads(q, k, v, do, causal=True)):
            assert torch.allclose(g.double(), w, rtol=1e-2, atol=2e-3), name
    assert len(FakeKernel.calls) == 2
    assert [key[0] for key in torch_op._kernels] == ["bwd plan"]


def test_grad_out_the_kernel_cannot_read_is_copied(cpu_ops):
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=FP16) for _ in range(3))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o, _ = torch.ops.gemmgen.fused_attention(*leaves, return_lse=True)
    o.float().sum().backward()  # dO is an expanded tensor of ones (strides 0)
    want = ref_grads(q, k, v, torch.ones_like(q))
    for g, w in zip((q.grad, k.grad, v.grad), want):
        assert torch.allclose(g.double(), w, rtol=1e-2, atol=2e-3)


def test_empty_sizes_give_zero_gradients_without_a_kernel(cpu_ops):
    for nq, nk in ((0, 5), (5, 0)):
        q, do = torch.randn(1, 2, nq, 16, dtype=FP16), torch.randn(1, 2, nq, 16, dtype=FP16)
        k, v = torch.randn(1, 2, nk, 16, dtype=FP16), torch.randn(1, 2, nk, 16, dtype=FP16)
        for g in grads_of(q, k, v, do, causal=True):
            assert torch.equal(g, torch.zeros_like(g))
    assert FakeKernel.calls == []


def test_mask_gradient(cpu_ops):
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 8, 16, generator=gen).to(FP16) for _ in range(4))
    bias = torch.randn(1, 2, 8, 8, generator=gen).to(FP16).requires_grad_()
    got = grads_of(q, k, v, do, bias=bias, causal=True)
    want = ref_grads(q, k, v, do, bias=bias, causal=True)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, rtol=1e-2, atol=2e-3)
    assert FakeKernel.calls[-1].dbias != 0


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_eager_training_calls_run_the_ops_pieces(cpu_ops, monkeypatch, h, hkv):
    """gemmgen.fused_attention on tensors that require grad, in plain eager mode, records the op's
    forward and backward implementations in a torch.autograd.Function (no dispatcher): the same
    gradients, checks and saved tensors as the op."""
    monkeypatch.setattr(torch_op, "_fused_attention", cpu_forward)
    monkeypatch.setattr(attention, "_check_device", lambda *args: None)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((h, hkv)).encode()))
    q, do = (torch.randn(2, h, 19, 32, generator=gen).to(FP16) for _ in range(2))
    k, v = (torch.randn(2, hkv, 23, 32, generator=gen).to(FP16) for _ in range(2))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = gemmgen.fused_attention(*leaves, causal=True, causal_alignment="bottom_right", scale=0.3)
    assert type(o.grad_fn).__name__ == "_EagerTrainingBackward"
    got = torch.autograd.grad(o, leaves, do, retain_graph=True)
    want = ref_grads(q, k, v, do, causal=True, causal_alignment="bottom_right", scale=0.3)
    for name, g, w in zip(("dQ", "dK", "dV"), got, want):
        atol = 2e-3 * (h // hkv if name != "dQ" else 1)
        assert torch.allclose(g.double(), w, rtol=1e-2, atol=atol), name
    with pytest.raises(gemmgen.InputError, match="double backward"):
        torch.autograd.grad(o, leaves, do, create_graph=True)
    monkeypatch.setattr(torch_op, "run_fused_attention", cpu_forward)
    with torch.no_grad():  # nothing to record: the implementation itself
        assert gemmgen.fused_attention(*leaves).grad_fn is None


def test_lse_has_no_gradient_and_double_backward_raises(cpu_ops):
    q, k, v, do = (torch.randn(1, 2, 8, 16, dtype=FP16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o, lse = torch.ops.gemmgen.fused_attention(*leaves, return_lse=True)
    assert o.requires_grad and not lse.requires_grad
    with pytest.raises(gemmgen.InputError, match="double backward"):
        torch.autograd.grad(o, leaves, do, create_graph=True)


def test_the_forward_needs_its_lse_when_inputs_require_grad(cpu_ops):
    q = torch.randn(1, 2, 8, 16, dtype=FP16, requires_grad=True)
    with pytest.raises(gemmgen.InputError, match="needs return_lse=True"):
        torch.ops.gemmgen.fused_attention(q, q, q)
    with torch.no_grad():
        torch.ops.gemmgen.fused_attention(q, q, q)  # inference needs no LSE


# Selection of backward instances: the engine's attention_bwd kind, on a build without libraries.

def test_backward_selection_and_explain(tmp_path):
    from conftest import make_entry, run_cli, write_build_dir
    from gemmgen.generator.families import fa2_sm80, mea_bwd_sm80
    from gemmgen.select import device, registry, selection
    from gemmgen.select.problem import BwdProblem, Problem

    fwd = [i for i in fa2_sm80.DEFAULT if i.dtype.value == "bf16" and i.head_dim == 128]
    root = write_build_dir(tmp_path, [make_entry(i) for i in (*mea_bwd_sm80.DEFAULT, *fwd)])
    h100 = device.synthetic((9, 0), 132)
    registry.set_build_dirs([root])
    try:
        bwd = selection.decide(BwdProblem("bf16", 96, True, h100, batch_heads=32, seqlen_q=1000, seqlen_k=1000))
        assert bwd.winner.entry.family == "mea_bwd_sm80" and bwd.kind.name == "attention_bwd"
        assert {c.entry.family for c in bwd.candidates} == {"mea_bwd_sm80"}
        assert "head_dim 96 above this instance's bound 64" in dict(bwd.rejected).values()
        assert not any("fa2_sm80" in label for label, _ in bwd.rejected)  # forward families are not listed
        fwd_decision = selection.decide(Problem("bf16", 128, True, h100, batch_heads=32, seqlen_q=1000, seqlen_k=1000))
        assert fwd_decision.winner.entry.family == "fa2_sm80"
        assert not any("bwd" in label for label, _ in fwd_decision.rejected)
        assert BwdProblem("bf16", 96, True, h100).functional_key.startswith("bwd_")
        with pytest.raises(gemmgen.NoInstanceError, match="dBias"):
            selection.select(BwdProblem("bf16", 64, False, h100, seqlen_k=97, bias=True, bias_grad=True))
    finally:
        registry.set_build_dirs(None)
    proc = run_cli("explain", "--shape", "2,16,1000,96,causal", "--backward", "--cc", "9.0", "--sms", "132",
                   "--build-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "backward of bf16 head_dim=96 causal" in proc.stdout and "mea_bwd_sm80_bf16_k128" in proc.stdout
    proc = run_cli("explain", "--shape", "2,16,1000,96", "--deterministic", "--cc", "9.0", "--sms", "132")
    assert proc.returncode != 0 and "--deterministic describes a backward" in proc.stderr


def test_backward_profile_and_autotune_entry_points():
    """`gemmgen profile --backward` and autotune(backward=True) exist and reach the GPU check."""
    import inspect

    from conftest import run_cli
    from gemmgen.cli import profile

    assert "backward" in inspect.signature(gemmgen.autotune).parameters
    assert isinstance(profile.KINDS["attention_bwd"], profile.Backward)
    proc = run_cli("profile", "--arch", "sm80", "--shapes", "2,4,256,64,causal", "--backward")
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
    assert "--backward" in run_cli("profile", "--help").stdout


def test_broadcast_inputs_reach_the_kernel_dense(cpu_ops):
    """The forward reads inputs broadcast over batch or heads (stride 0); the backward hands the
    kernel dense copies and returns gradients of the inputs' shapes."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 8, 16, generator=gen).to(FP16).expand(3, 2, 8, 16)
    k = torch.randn(3, 1, 9, 16, generator=gen).to(FP16).expand(3, 2, 9, 16)
    v, do = torch.randn(3, 2, 9, 16, generator=gen).to(FP16), torch.randn(3, 2, 8, 16, generator=gen).to(FP16)
    got = grads_of(q, k, v, do, causal=True)
    want = ref_grads(q, k, v, do, causal=True)
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.shape == x.shape and torch.allclose(g.double(), w, rtol=1e-2, atol=2e-3)
