"""gemmgen as torch's flash-attention implementation (gemmgen.integrations.torch_sdpa), on the CPU.

The registration with torch.nn.attention's registry and its activation and restoration run as they
do on a GPU (the CUDA kernels are installed and removed; none runs here). The dispatch itself runs
with the kernels installed for the CPU key instead, through torch's real aten ops and autograd
formulas, with float64 stand-ins for gemmgen's entry points (gemmgen.ops.attention.fused_attention
and fused_attention_varlen, CPU kernels for torch.ops.gemmgen.fused_attention_backward and
fused_attention_varlen_backward). The results are checked against torch's own math
(F.scaled_dot_product_attention, autograd), so a wrong causal alignment, scale, head grouping,
layout, LSE or dropout seed fails here. tests/gpu/test_torch_sdpa_gpu.py runs the real kernels."""
from __future__ import annotations

import inspect
import logging
import math
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import gemmgen
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.integrations import torch_sdpa
from gemmgen.kernels import launch
from gemmgen.ops import attention as gemmgen_attention

from conftest import ROOT

aten = torch.ops.aten
ALL_OPS = [spec.name for spec in torch_sdpa._SPECS]


# ---- float64 stand-ins for gemmgen's kernels -----------------------------------------------------

def keep_mask(shape, p, seed, offset):
    """The stand-ins' dropout mask: a function of (seed, offset), as gemmgen's Philox mask is."""
    gen = torch.Generator().manual_seed(seed * 7919 + offset)
    return torch.rand(shape, generator=gen, dtype=torch.float64) >= p


def causal_cut(nq, nk, alignment):
    """Query i sees keys j <= i + cut."""
    return nk - nq if alignment == "bottom_right" else 0


def probabilities(q, k, causal, alignment, scale):
    """float64 (P [B, H, Nq, Nk], LSE [B, H, Nq]); rows without keys: P = 0, LSE = -inf."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = scale * (q.double() @ kk.transpose(-2, -1))
    if causal:
        nq, nk = s.shape[-2:]
        cut = causal_cut(nq, nk, alignment)
        s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + cut, float("-inf"))
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], 0.0)), 0.0)
    return p, lse, scale


def dense_forward(q, k, v, causal, alignment, scale, dropout_p, seed, offset):
    """(O float64 [B, H, Nq, d], LSE) of gemmgen's fused_attention semantics."""
    p, lse, _ = probabilities(q, k, causal, alignment, scale)
    if dropout_p > 0:
        p = p * keep_mask(p.shape, dropout_p, seed, offset) / (1 - dropout_p)
    vv = v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    return p @ vv, lse


def dense_backward(do, q, k, v, causal, alignment, scale, dropout_p, seed, offset):
    """float64 (dQ, dK, dV) of sum(O * dO), closed form (the stand-in kernels run below autograd)."""
    group = q.shape[1] // k.shape[1]
    p, _, scale = probabilities(q, k, causal, alignment, scale)
    keep = keep_mask(p.shape, dropout_p, seed, offset).double() / (1 - dropout_p) if dropout_p > 0 else 1.0
    do, q64 = do.double(), q.double()
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    dv = (p * keep).transpose(-2, -1) @ do
    dp = (do @ vv.transpose(-2, -1)) * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = scale * ds @ kk, scale * ds.transpose(-2, -1) @ q64

    def fold(t):  # GQA: sum over the query heads of each key/value head
        b, _, n, d = t.shape
        return t.view(b, k.shape[1], group, n, d).sum(2)

    return dq, fold(dk), fold(dv)


class Gemmgen:
    """Records the calls of the stand-ins; `fail` makes the forward raise."""

    def __init__(self):
        self.forward, self.backward, self.varlen, self.varlen_backward = [], [], [], []
        self.fail = None


@pytest.fixture
def stand_ins(monkeypatch):
    """gemmgen's entry points replaced by float64 stand-ins, argument names checked against the real ones."""
    rec = Gemmgen()
    real_forward = inspect.signature(gemmgen_attention.fused_attention)
    real_varlen = inspect.signature(gemmgen_attention.fused_attention_varlen)

    def fused_attention(q, k, v, **kw):
        bound = real_forward.bind(q, k, v, **kw)
        bound.apply_defaults()
        a = bound.arguments
        rec.forward.append(a)
        if rec.fail is not None:
            raise rec.fail
        o, lse = dense_forward(q, k, v, a["causal"], a["causal_alignment"], a["scale"], a["dropout_p"],
                               a["seed"], a["offset"])
        out = a["out"] if a["out"] is not None else torch.empty_like(q)
        out.copy_(o)
        return (out, lse.float()) if a["return_lse"] else out

    def fused_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        bound = real_varlen.bind(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        bound.apply_defaults()
        a = bound.arguments
        rec.varlen.append(a)
        if rec.fail is not None:
            raise rec.fail
        o = torch.zeros_like(q)
        lse = torch.full((cu_q.numel() - 1, q.shape[1], max_q), float("-inf"), dtype=torch.float32)
        for b, (sq, sk) in enumerate(sequences(cu_q, cu_k)):
            ob, lb = dense_forward(*bhnd(q[sq], k[sk], v[sk]), a["causal"], a["causal_alignment"], a["scale"], 0.0,
                                   None, 0)
            o[sq] = ob[0].transpose(0, 1).to(o.dtype)
            lse[b, :, :sq.stop - sq.start] = lb[0].float()
        return (o, lse) if a["return_lse"] else o

    def backward(grad_out, q, k, v, out, lse, causal, alignment, scale, dropout_p, seed, offset, bias, bias_grad,
                 deterministic):
        rec.backward.append(dict(causal=causal, alignment=alignment, scale=scale, dropout_p=dropout_p, seed=seed,
                                 offset=offset, lse_shape=tuple(lse.shape), deterministic=deterministic,
                                 layouts=[t.stride() for t in (grad_out, q, k, v, out)]))
        grads = dense_backward(grad_out, q, k, v, causal, alignment, scale, dropout_p, seed, offset)
        return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v))), q.new_empty(0))

    def varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed,
                        offset, causal_alignment="top_left", window=None, softcap=0.0):
        rec.varlen_backward.append(dict(lse=lse.clone(), causal=causal, max_q=max_q, max_k=max_k,
                                        alignment=causal_alignment))
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for sq, sk in sequences(cu_q, cu_k):
            g = dense_backward(*bhnd(grad_out[sq], q[sq], k[sk], v[sk]), causal, causal_alignment, scale, 0.0, None,
                               0)
            for dst, rows, t in zip(grads, (sq, sk, sk), g):
                dst[rows] = t[0].transpose(0, 1).to(dst.dtype)
        return tuple(grads)

    monkeypatch.setattr(gemmgen_attention, "fused_attention", fused_attention)
    monkeypatch.setattr(gemmgen_attention, "fused_attention_varlen", fused_attention_varlen)
    lib = torch.library.Library("gemmgen", "IMPL")
    lib.impl("fused_attention_backward", backward, "CPU")
    lib.impl("fused_attention_varlen_backward", varlen_backward, "CPU")
    yield rec
    lib._destroy()


def sequences(cu_q, cu_k):
    """(query rows, key rows) of each packed sequence, as slices."""
    a, b = cu_q.tolist(), cu_k.tolist()
    return [(slice(a[i], a[i + 1]), slice(b[i], b[i + 1])) for i in range(len(a) - 1)]


def bhnd(*packed):
    """Packed [T, H, d] tensors as [1, H, T, d] views."""
    return tuple(t.unsqueeze(0).transpose(1, 2) for t in packed)


@pytest.fixture
def seeds(monkeypatch):
    """torch's generator replaced: draw_seed returns (1234, 40 + 8 * call) and records its arguments."""
    drawn = []

    def draw_seed(index, draws):
        drawn.append((index, draws))
        return 1234, 40 + 8 * (len(drawn) - 1)

    monkeypatch.setattr(launch, "draw_seed", draw_seed)
    return drawn


@pytest.fixture
def cpu_impl():
    """gemmgen's kernels installed for the CPU dispatch key (torch's registry installs them for CUDA)."""
    torch_sdpa.reset()
    handle = torch_sdpa._install("CPU")
    yield handle
    handle.remove()
    torch_sdpa.reset()


class TorchKernels:
    """CPU kernels standing in for torch's own (none exist for these ops on the CPU): the math
    result, and a record of each call. The SDPA-level forward calls the flash-level op through the
    dispatcher, as torch's CUDA kernel does."""

    def __init__(self):
        self.calls = []
        self.lib = torch.library.Library("aten", "IMPL")
        self.lib.impl("_scaled_dot_product_flash_attention", self.sdpa_forward, "CPU")
        self.lib.impl("_flash_attention_forward", self.flash_forward, "CPU")
        self.lib.impl("_scaled_dot_product_flash_attention_backward", self.backward("sdpa_backward"), "CPU")
        self.lib.impl("_flash_attention_backward", self.backward("flash_backward"), "CPU")

    def sdpa_forward(self, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        self.calls.append("sdpa_forward")
        o, lse, seed, offset, mask = aten._flash_attention_forward(
            *bhnd_views(q, k, v), None, None, q.shape[2], k.shape[2], dropout_p, is_causal, return_debug_mask,
            scale=scale)
        return o.transpose(1, 2), lse, None, None, q.shape[2], k.shape[2], seed, offset, mask

    def flash_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, **kw):
        self.calls.append("flash_forward")
        if cu_q is not None:  # packed: a zero output of the right shape is enough here
            return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), *torch_rng(), torch.empty(0)
        o, lse = dense_forward(*bhnd_views(q, k, v), is_causal, "bottom_right", kw.get("scale"), 0.0, None, 0)
        return o.transpose(1, 2).to(q.dtype), lse.float(), *torch_rng(), torch.empty(0)

    def backward(self, name):
        def kernel(*args, **kwargs):
            self.calls.append(name)
            return tuple(torch.zeros_like(t) for t in args[1:4])
        return kernel

    def close(self):
        self.lib._destroy()


def bhnd_views(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


def torch_rng():
    """What torch's CUDA kernel returns as (rng_state, unused): device tensors, not gemmgen's."""
    return torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)


@pytest.fixture
def torch_kernels():
    """Stand-ins for torch's own CPU kernels, registered before gemmgen's (so gemmgen falls back on them)."""
    kernels = TorchKernels()
    yield kernels
    kernels.close()


@pytest.fixture
def impl_over_torch(torch_kernels, cpu_impl):
    return torch_kernels


def inputs(b=2, h=4, hkv=2, nq=5, nk=7, d=8, layout="bnhd", grad=True, seed=0):
    """q [B, H, Nq, d], k, v [B, Hkv, Nk, d] float64 and dO; "bnhd": [B, N, H, d] storage, as models
    make them."""
    gen = torch.Generator().manual_seed(seed)

    def make(heads, n):
        if layout == "bnhd":
            t = torch.randn(b, n, heads, d, generator=gen, dtype=torch.float64).transpose(1, 2)
        else:
            t = torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64)
        return t.requires_grad_(grad)

    return make(h, nq), make(hkv, nk), make(hkv, nk), make(h, nq).detach()


def torch_reference(q, k, v, do, *, causal=False, scale=None):
    """torch's math: O, LSE and (dQ, dK, dV), with FlashAttention's bottom-right causal mask."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    nq, nk = q.shape[2], k.shape[2]
    mask = causal_lower_right(nq, nk) if causal else None
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale, enable_gqa=gqa)
    o.backward(do)
    kk = k.detach().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (1 / math.sqrt(q.shape[-1]) if scale is None else scale) * q.detach() @ kk.transpose(-2, -1)
    if causal:
        s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))
    return o.detach(), torch.logsumexp(s, -1), [t.grad for t in leaves]


def meta_strides(op, *args, **kwargs):
    """The strides torch's meta function gives each tensor output of `op`."""
    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a
    outs = op(*map(meta, args), **{n: meta(a) for n, a in kwargs.items()})
    return [o.stride() if isinstance(o, torch.Tensor) else None for o in outs]


def close(got, want, tol=1e-10):
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol), (got - want).abs().max()


# ---- registration, activation, restoration -------------------------------------------------------

def test_importing_gemmgen_registers_without_activating():
    assert "gemmgen" in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() != "gemmgen"
    assert not torch_sdpa.is_active()


def test_importing_gemmgen_before_torch_registers_once_torch_loads():
    code = ("import sys, gemmgen\n"
            "assert 'torch' not in sys.modules, 'importing gemmgen imported torch'\n"
            "import torch\n"
            "print(torch.nn.attention.list_flash_attention_impls())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "'gemmgen'" in proc.stdout


def cuda_kernel(op_name):
    """A description of the CUDA kernel an op runs now ("none" on a torch built without CUDA)."""
    try:
        return repr(torch.library.get_kernel(f"aten::{op_name}", "CUDA"))
    except RuntimeError:
        return "none"


@pytest.mark.parametrize("switch", ["torch", "gemmgen"])
def test_activation_installs_and_restoration_removes_the_cuda_kernels(switch):
    before = {op: cuda_kernel(op) for op in ALL_OPS}
    if switch == "torch":
        torch.nn.attention.activate_flash_attention_impl("gemmgen")
    else:
        gemmgen.activate()
    try:
        assert torch.nn.attention.current_flash_attention_impl() == "gemmgen"
        assert torch_sdpa.is_active()
        for op in ALL_OPS:
            if hasattr(aten, op):
                assert "torch_sdpa.py" in cuda_kernel(op), op
    finally:
        if switch == "torch" and hasattr(torch.nn.attention, "restore_flash_attention_impl"):
            torch.nn.attention.restore_flash_attention_impl()
        else:  # torch 2.10's registry has no restore function
            gemmgen.deactivate()
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert not torch_sdpa.is_active()
    assert {op: cuda_kernel(op) for op in ALL_OPS} == before


def test_deactivate_without_activation_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        gemmgen.deactivate()
    assert not caplog.records
    assert not torch_sdpa.is_active()


def test_activating_again_keeps_one_installation():
    gemmgen.activate()
    first = torch_sdpa._active
    gemmgen.activate()
    try:
        # Installed afresh (the first installation removed), or kept where the registry skips
        # activating the active implementation again.
        assert torch_sdpa._active is first or first.library is None
        assert "torch_sdpa.py" in cuda_kernel("_flash_attention_forward")
    finally:
        gemmgen.deactivate()
    assert not torch_sdpa.is_active()


def test_deactivate_on_a_registry_without_restore(monkeypatch):
    """Registries of torch 2.10 had no restore function: deactivate removes the kernels itself and
    clears the registry's note, so a later activation installs them again."""
    before = cuda_kernel("_flash_attention_forward")
    gemmgen.activate()
    monkeypatch.delattr(torch.nn.attention, "restore_flash_attention_impl", raising=False)
    gemmgen.deactivate()
    assert not torch_sdpa.is_active()
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert cuda_kernel("_flash_attention_forward") == before


@pytest.mark.parametrize("missing", [(torch.nn.attention, "register_flash_attention_impl"),
                                     (torch.nn.attention, "activate_flash_attention_impl"),
                                     (torch.library, "get_kernel")],
                         ids=lambda m: m[1])
def test_a_torch_without_the_api_gets_a_clear_error(monkeypatch, missing):
    monkeypatch.delattr(*missing)
    assert torch_sdpa.register() is False
    gemmgen.integrations._register_with_torch()  # what importing gemmgen runs: never raises
    pattern = rf"torch 2\.10 or newer.*{re.escape(torch.__version__)}.*{missing[1]}"
    with pytest.raises(torch_sdpa.UnsupportedTorchError, match=pattern):
        gemmgen.activate()
    with pytest.raises(gemmgen.GemmgenError):
        torch_sdpa._install()
    assert not torch_sdpa.is_active()


# ---- SDPA's flash op: argument mapping against torch's math ---------------------------------------

@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # torch's math gives 0 rows
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(5, 5), (5, 7), (7, 5), (1, 9)], ids=lambda n: f"{n[0]}x{n[1]}")
def test_sdpa_forward_and_backward_match_torch(stand_ins, cpu_impl, causal, heads, lengths):
    q, k, v, do = inputs(h=heads[0], hkv=heads[1], nq=lengths[0], nk=lengths[1])
    scale = 0.3
    outs = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    o, lse = outs[0], outs[1]
    assert outs[4:6] == (q.shape[2], k.shape[2])
    o.backward(do)
    want_o, want_lse, want_grads = torch_reference(q, k, v, do, causal=causal, scale=scale)
    close(o, want_o)
    close(lse, want_lse.float(), tol=1e-6)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    for got, want in zip((q.grad, k.grad, v.grad), want_grads):
        close(got, want)
    fwd, = stand_ins.forward
    assert fwd["causal"] is causal and fwd["causal_alignment"] == "bottom_right"  # FlashAttention's
    assert fwd["scale"] == scale and fwd["return_lse"] and fwd["dropout_p"] == 0.0 and fwd["seed"] is None
    bwd, = stand_ins.backward
    assert bwd["alignment"] == "bottom_right" and bwd["lse_shape"] == tuple(q.shape[:3])
    assert torch_sdpa.counts() == {"_scaled_dot_product_flash_attention": {"gemmgen": 1, "torch": 0},
                                   "_scaled_dot_product_flash_attention_backward": {"gemmgen": 1, "torch": 0}}
    assert torch_sdpa.fallback_reasons() == []


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_sdpa_outputs_take_the_layouts_of_torchs_meta_function(stand_ins, cpu_impl, layout):
    q, k, v, do = inputs(b=1, layout=layout, grad=False)
    op = aten._scaled_dot_product_flash_attention.default
    outs = op(q, k, v, 0.0, True, scale=None)
    want = meta_strides(op, q, k, v, 0.0, True)
    assert [outs[0].stride(), outs[1].stride()] == want[:2]
    assert stand_ins.forward[0]["out"] is not None  # written in place: no copy
    # The backward's gradients too, for dO and O in another layout than Q.
    do = do.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bhnd" else do.contiguous()
    bop = aten._scaled_dot_product_flash_attention_backward.default
    args = (do, q, k, v, outs[0], outs[1], None, None, q.shape[2], k.shape[2], 0.0, True, outs[6], outs[7])
    grads = bop(*args, scale=None)
    assert [g.stride() for g in grads] == meta_strides(bop, *args, scale=None)


def test_default_scale_and_deterministic_flag(stand_ins, cpu_impl):
    q, k, v, do = inputs()
    o = aten._scaled_dot_product_flash_attention(q, k, v)[0]
    torch.use_deterministic_algorithms(True)
    try:
        o.backward(do)
    finally:
        torch.use_deterministic_algorithms(False)
    assert stand_ins.forward[0]["scale"] is None and stand_ins.backward[0]["scale"] is None
    assert stand_ins.backward[0]["deterministic"] is True
    close(o, torch_reference(q, k, v, do)[0])


# ---- dropout: the forward's seed reaches the backward --------------------------------------------

def test_dropout_seed_and_offset_travel_from_forward_to_backward(stand_ins, cpu_impl, seeds, monkeypatch):
    checked = []
    monkeypatch.setattr(torch_sdpa, "_backward_serves", lambda *a: checked.append(a))
    q, k, v, do = inputs()
    p = 0.3
    outs = aten._scaled_dot_product_flash_attention(q, k, v, p, False)
    b, h, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    assert seeds == [(-1, b * h * nq * nk)]  # one draw per attention weight, on q's device
    assert len(checked) == 1  # inputs that require grad: a backward instance must exist
    state, tag = outs[6], outs[7]
    assert state.device.type == "cpu" and state.dtype == torch.uint64 and state.tolist() == [1234, 40]
    assert torch_sdpa._philox_of_gemmgen(state, tag) == (1234, 40)
    assert torch_sdpa._philox_of_gemmgen(state, torch.zeros((), dtype=torch.uint64)) is None
    outs[0].backward(do)
    assert stand_ins.forward[0]["seed"] == 1234 and stand_ins.forward[0]["offset"] == 40
    bwd, = stand_ins.backward
    assert (bwd["seed"], bwd["offset"], bwd["dropout_p"]) == (1234, 40, p)
    # Against autograd of the masked math (the mask the stand-ins draw from that seed).
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    keep = keep_mask((b, h, nq, nk), p, 1234, 40)
    w = torch.softmax(8 ** -0.5 * leaves[0] @ leaves[1].repeat_interleave(2, 1).transpose(-2, -1), -1)
    want = (w * keep / (1 - p)) @ leaves[2].repeat_interleave(2, 1)
    want.backward(do)
    close(outs[0], want.detach())
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        close(got, leaf.grad)


def test_flash_level_dropout_with_grad_checks_the_backward(stand_ins, cpu_impl, seeds, monkeypatch):
    checked = []
    monkeypatch.setattr(torch_sdpa, "_backward_serves", lambda *a: checked.append(a))
    q, k, v, _ = inputs()
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, H, d] views that require grad
    aten._flash_attention_forward(qs, ks, vs, None, None, q.shape[2], k.shape[2], 0.2, False, False)
    assert len(checked) == 1 and checked[0][0].shape == q.shape  # gemmgen's [B, H, N, d] views


def test_dropout_without_grad_checks_no_backward(stand_ins, cpu_impl, seeds, monkeypatch):
    monkeypatch.setattr(torch_sdpa, "_backward_serves", lambda *a: pytest.fail("checked a backward"))
    q, k, v, _ = inputs(grad=False)
    aten._scaled_dot_product_flash_attention(q, k, v, 0.2, False)
    assert len(seeds) == 1


def test_dropout_forward_falls_back_when_no_backward_serves_it(stand_ins, impl_over_torch, seeds, monkeypatch):
    def no_backward(*args):
        with torch_sdpa._backward_check():
            raise NoInstanceError("no backward instance with dropout is built\n  fmha_bwd: ...")

    monkeypatch.setattr(torch_sdpa, "_backward_serves", no_backward)
    q, k, v, _ = inputs()
    aten._scaled_dot_product_flash_attention(q, k, v, 0.2, False)
    assert impl_over_torch.calls == ["sdpa_forward", "flash_forward"]
    reason, = torch_sdpa.fallback_reasons()
    assert "no gemmgen backward serves the call" in reason and "no backward instance with dropout" in reason


def test_a_dropout_call_that_falls_back_rewinds_the_generator(stand_ins, impl_over_torch, seeds, monkeypatch):
    """torch's kernel then draws the mask it would have drawn without gemmgen."""
    rewound = []
    generator = types.SimpleNamespace(set_offset=rewound.append)
    monkeypatch.setattr(torch.cuda, "default_generators", [generator])  # q.get_device() is -1 here
    stand_ins.fail = InputError("q's data pointer is not 16-byte aligned")  # not remembered
    q, k, v, _ = inputs(grad=False)
    aten._scaled_dot_product_flash_attention(q, k, v, 0.2, False)
    assert rewound == [40] and impl_over_torch.calls == ["sdpa_forward", "flash_forward"]
    stand_ins.fail = None
    aten._scaled_dot_product_flash_attention(q, k, v, 0.2, False)
    assert rewound == [40] and stand_ins.forward[-1]["offset"] == 48  # served: that draw stands
    assert torch_sdpa.counts()["_scaled_dot_product_flash_attention"] == {"gemmgen": 1, "torch": 1}


def test_dropout_backward_of_torchs_forward_runs_on_torch(stand_ins, impl_over_torch):
    q, k, v, do = inputs(grad=False)
    o, lse = q.detach().clone(), torch.zeros(q.shape[:3])
    grads = aten._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, None, None, q.shape[2],
                                                               k.shape[2], 0.2, False, *torch_rng())
    assert impl_over_torch.calls == ["sdpa_backward"] and not stand_ins.backward
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert "only its backward regenerates that mask" in torch_sdpa.fallback_reasons()[0]
    # Without dropout any backward serves: gemmgen's runs on torch's forward outputs.
    aten._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, None, None, q.shape[2], k.shape[2],
                                                      0.0, False, *torch_rng())
    assert len(stand_ins.backward) == 1


def test_dropout_backward_that_gemmgen_cannot_run_raises(stand_ins, cpu_impl, seeds, monkeypatch):
    monkeypatch.setattr(torch_sdpa, "_backward_serves", lambda *a: None)
    q, k, v, do = inputs()
    outs = aten._scaled_dot_product_flash_attention(q, k, v, 0.2, False)
    lib = torch.library.Library("gemmgen", "IMPL")

    def failing(*args):
        raise NoInstanceError("no backward instance")

    lib.impl("fused_attention_backward", failing, "CPU")
    try:
        with pytest.raises(RuntimeError, match="only gemmgen's backward regenerates that mask"):
            outs[0].backward(do)
    finally:
        lib._destroy()


# ---- fallback: torch's kernel, one log line per reason --------------------------------------------

def test_a_call_gemmgen_cannot_run_falls_back_and_logs_once(stand_ins, impl_over_torch, caplog):
    q, k, v, _ = inputs(grad=False)
    stand_ins.fail = NoInstanceError("No built instance runs this problem\n  fa2_sm80_x: head dim")
    with caplog.at_level(logging.WARNING, logger="gemmgen.sdpa"):
        first = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    # torch's SDPA kernel ran twice, its nested flash-level call straight on torch's kernel.
    assert impl_over_torch.calls == ["sdpa_forward", "flash_forward"] * 2
    assert len(stand_ins.forward) == 1  # the failure is remembered for calls like this one
    close(first[0], torch_reference(q, k, v, q, causal=True)[0])
    records = [r for r in caplog.records if r.name == "gemmgen.sdpa"]
    assert len(records) == 1 and "NoInstanceError: No built instance runs this problem" in records[0].getMessage()
    assert torch_sdpa.fallback_reasons() == [
        "aten::_scaled_dot_product_flash_attention: NoInstanceError: No built instance runs this problem"]
    assert torch_sdpa.counts()["_scaled_dot_product_flash_attention"] == {"gemmgen": 0, "torch": 2}
    assert "_flash_attention_forward" not in torch_sdpa.counts()
    # Another reason is logged once more; an input error is not remembered (it is cheap to find).
    stand_ins.fail = InputError("q's data pointer is not 16-byte aligned")
    with caplog.at_level(logging.WARNING, logger="gemmgen.sdpa"):
        for _ in range(2):
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False)
    assert len([r for r in caplog.records if r.name == "gemmgen.sdpa"]) == 2
    assert len(stand_ins.forward) == 3
    assert len(torch_sdpa.fallback_reasons()) == 2


def test_a_registry_refresh_forgets_remembered_failures(stand_ins, impl_over_torch):
    q, k, v, _ = inputs(grad=False)
    stand_ins.fail = NoInstanceError("No built instance")
    aten._scaled_dot_product_flash_attention(q, k, v)
    stand_ins.fail = None
    gemmgen.refresh()  # a new build: try gemmgen again
    aten._scaled_dot_product_flash_attention(q, k, v)
    assert torch_sdpa.counts()["_scaled_dot_product_flash_attention"] == {"gemmgen": 1, "torch": 1}


def test_remembered_forwards_are_forgotten_on_refresh_and_family_changes(monkeypatch):
    """The repeated-call path (GPU-tested in tests/gpu/test_torch_sdpa_gpu.py) keeps what a key's
    first call decided only while the build and the family list stay as they were."""
    repeats = torch_sdpa._Repeats()
    entry = torch_sdpa._Repeat(False, ((1, 2, 3, 8), (48, 8, 16, 1)), None, True, None, print, print, print)
    repeats.add(("op", 1), entry)
    assert repeats.get(("op", 1)) is entry and repeats.get(("op", 2)) is None
    gemmgen.refresh()  # a new build
    assert repeats.get(("op", 1)) is None
    repeats.add(("op", 1), entry)
    version = torch_sdpa._space().version()
    monkeypatch.setattr(torch_sdpa._space(), "version", lambda: version + 1)  # the family list changed
    assert repeats.get(("op", 1)) is None
    repeats.add(("op", 1), entry)
    assert repeats.get(("op", 1)) is entry


def test_cpu_calls_are_not_remembered(stand_ins, cpu_impl):
    q, k, v, _ = inputs(grad=False)
    for _ in range(2):
        aten._scaled_dot_product_flash_attention(q, k, v)
    assert not torch_sdpa._repeats._by_key
    assert len(stand_ins.forward) == 2  # both calls went through gemmgen.fused_attention


def test_unsupported_arguments_fall_back(stand_ins, impl_over_torch):
    q, k, v, _ = inputs(grad=False)
    aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True)  # return_debug_mask
    qs, ks, vs = bhnd_views(q, k, v)
    aten._flash_attention_forward(qs, ks, vs, None, None, q.shape[2], k.shape[2], 0.0, False, False,
                                  window_size_left=2, window_size_right=0)
    assert not stand_ins.forward
    reasons = torch_sdpa.fallback_reasons()
    assert "return_debug_mask=True" in reasons[0] and "sliding window" in reasons[1]


def test_a_torch_kernel_that_is_missing_is_named(stand_ins, cpu_impl):
    q, k, v, _ = inputs(grad=False)
    stand_ins.fail = NoInstanceError("No built instance")
    with pytest.raises(RuntimeError, match="no CPU kernel of its own"):
        aten._scaled_dot_product_flash_attention(q, k, v)


# ---- the flash-level ops: [B, N, H, d] and packed sequences ---------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_forward_and_backward_take_bnhd(stand_ins, cpu_impl, causal):
    q, k, v, do = inputs(grad=False, nq=6, nk=9)
    qs, ks, vs, dos = (t.transpose(1, 2) for t in (q, k, v, do))  # [B, N, H, d]: contiguous here
    fwd = aten._flash_attention_forward.default
    outs = fwd(qs, ks, vs, None, None, 6, 9, 0.0, causal, False, scale=0.25)
    want_o, want_lse, want_grads = torch_reference(q, k, v, do, causal=causal, scale=0.25)
    close(outs[0], want_o.transpose(1, 2))
    close(outs[1], want_lse.float(), tol=1e-6)
    assert outs[0].stride() == meta_strides(fwd, qs, ks, vs, None, None, 6, 9, 0.0, causal, False)[0]
    bwd = aten._flash_attention_backward.default
    grads = bwd(dos, qs, ks, vs, outs[0], outs[1], None, None, 6, 9, 0.0, causal, outs[2], outs[3], scale=0.25)
    for got, want in zip(grads, want_grads):
        close(got, want.transpose(1, 2))
    assert [g.stride() for g in grads] == [t.stride() for t in (qs, ks, vs)]


def packed(lengths_q, lengths_k, h=4, hkv=2, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q, k, v, do = (torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
                   for n, heads in ((tq, h), (tk, hkv), (tk, hkv), (tq, h)))
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lengths_q, lengths_k)]
    return q, k, v, do, cu[0], cu[1]


def packed_reference(q, k, v, do, cu_q, cu_k, causal):
    """Each sequence alone through torch's math: O, LSE [H, Tq], grads."""
    o, grads = torch.zeros_like(q), [torch.zeros_like(t) for t in (q, k, v)]
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for sq, sk in sequences(cu_q, cu_k):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        ob, lb, gb = torch_reference(*bhnd(q[sq], k[sk], v[sk], do[sq]), causal=causal)
        o[sq], lse[:, sq] = ob[0].transpose(0, 1), lb[0]
        for dst, rows, g in zip(grads, (sq, sk, sk), gb):
            dst[rows] = g[0].transpose(0, 1)
    return o, lse, grads


def varlen_attn():
    return pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")


def varlen_options(function, *, gqa=False, causal=False):
    """The keyword arguments asking `function` (varlen_attn, varlen_attn_out) for GQA and a causal
    mask, in this torch's spelling; skips where it has none."""
    params = inspect.signature(function).parameters
    options = {}
    if gqa:
        if "enable_gqa" not in params:
            pytest.skip("this torch's varlen_attn has no enable_gqa")
        options["enable_gqa"] = True
    if causal:
        if "window_size" in params:
            options["window_size"] = (-1, 0)
        elif "is_causal" in params:
            options["is_causal"] = True
        else:
            pytest.skip("this torch's varlen_attn has no causal mask")
    return options


@pytest.mark.parametrize("lengths", [([3, 0, 5], [4, 2, 6]), ([1, 4], [1, 4])], ids=["ragged", "square"])
def test_varlen_attn_forward_and_backward(stand_ins, cpu_impl, lengths):
    module = varlen_attn()
    q, k, v, do, cu_q, cu_k = packed(*lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    max_q, max_k = max(lengths[0]), max(lengths[1])
    o, lse = module.varlen_attn(*leaves, cu_q, cu_k, max_q, max_k, return_aux=module.AuxRequest(lse=True),
                                **varlen_options(module.varlen_attn, gqa=True))
    o.backward(do)
    want_o, want_lse, want_grads = packed_reference(q, k, v, do, cu_q, cu_k, causal=False)
    close(o, want_o)
    close(lse, want_lse.float(), tol=1e-6)
    for leaf, want in zip(leaves, want_grads):
        close(leaf.grad, want)
    # The backward got gemmgen's LSE layout back: [B, H, max_q], -inf past each sequence's end.
    rec, = stand_ins.varlen_backward
    assert rec["lse"].shape == (len(lengths[0]), q.shape[1], max_q)
    for b, n in enumerate(lengths[0]):
        assert torch.isfinite(rec["lse"][b, :, :n]).all() and torch.isneginf(rec["lse"][b, :, n:]).all()
    assert torch_sdpa.counts()["_flash_attention_forward"]["gemmgen"] == 1
    assert torch_sdpa.counts()["_flash_attention_backward"]["gemmgen"] == 1


def test_causal_varlen_aligns_each_sequence_bottom_right(stand_ins, cpu_impl):
    """FlashAttention's causal mask within each packed sequence is bottom-right: gemmgen runs it so
    (causal_alignment="bottom_right") where the query and key offsets are separate tensors, and
    top-left, the same mask, where one tensor serves both; the backward gets the same alignment."""
    module = varlen_attn()
    causal = varlen_options(module.varlen_attn, gqa=True, causal=True)
    q, k, v, do, cu, _ = packed([3, 5], [3, 5])
    o = module.varlen_attn(q, k, v, cu, cu, 5, 5, **causal)  # one cum_seq tensor
    close(o, packed_reference(q, k, v, do, cu, cu, causal=True)[0])
    assert stand_ins.varlen[-1]["causal"] is True and stand_ins.varlen[-1]["causal_alignment"] == "top_left"
    q2, k2, v2, do2, cu_q, cu_k = packed([3, 0, 5], [4, 2, 9])
    leaves = [t.clone().requires_grad_() for t in (q2, k2, v2)]
    o = module.varlen_attn(*leaves, cu_q, cu_k, 5, 9, **causal)
    o.backward(do2)
    want_o, _, want_grads = packed_reference(q2, k2, v2, do2, cu_q, cu_k, causal=True)
    close(o, want_o)
    for leaf, want in zip(leaves, want_grads):
        close(leaf.grad, want)
    assert stand_ins.varlen[-1]["causal_alignment"] == "bottom_right"
    assert stand_ins.varlen_backward[-1]["alignment"] == "bottom_right"
    assert torch_sdpa.fallback_reasons() == []


def test_varlen_attn_out_writes_into_out(stand_ins, cpu_impl):
    module = varlen_attn()
    if not hasattr(module, "varlen_attn_out"):
        pytest.skip("this torch has no varlen_attn_out")
    q, k, v, do, cu_q, cu_k = packed([3, 5], [4, 6])
    out = torch.empty_like(q)
    result = module.varlen_attn_out(out, q, k, v, cu_q, cu_k, 5, 6, **varlen_options(module.varlen_attn_out, gqa=True))
    close(out, packed_reference(q, k, v, do, cu_q, cu_k, causal=False)[0])
    assert result is out or result.data_ptr() == out.data_ptr()
    assert torch_sdpa.counts()["_flash_attention_forward_no_dropout_inplace"]["gemmgen"] == 1


# ---- torch.compile: the kernels' outputs agree with the meta functions it traces with -------------

def test_torch_compile_runs_the_overridden_ops(stand_ins, cpu_impl):
    """Inductor calls the ops as fallback kernels and asserts each output's size and strides against
    torch's meta function: the projection gives [B, N, H, d] views, as in a transformer."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(32, 96, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)

    def attention(x):
        q, k, v = (t.transpose(1, 2) for t in proj(x).view(2, 6, 3, 4, 8).unbind(2))
        o = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return o.transpose(1, 2).reshape(2, 6, 32)

    compiled = torch.compile(attention, fullgraph=True)
    got = compiled(x)
    got.square().sum().backward()
    got_grad, proj.weight.grad = proj.weight.grad, None
    want = attention(x)
    want.square().sum().backward()
    close(got, want)
    close(got_grad, proj.weight.grad)
    assert torch_sdpa.counts()["_scaled_dot_product_flash_attention"] == {"gemmgen": 2, "torch": 0}
    assert torch_sdpa.counts()["_scaled_dot_product_flash_attention_backward"] == {"gemmgen": 2, "torch": 0}
