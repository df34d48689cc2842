"""gemmgen behind torch.nn.functional.scaled_dot_product_attention on the GPU
(gemmgen.integrations.torch_sdpa): with the "gemmgen" flash-attention implementation active, SDPA's
flash path (chosen with sdpa_kernel) runs gemmgen's kernels forward and backward, and matches float64
references: fp16 and bf16, causal and not, GQA (enable_gqa), head dims 64 and 128, Nq != Nk, odd
lengths; torch_sdpa.counts() shows gemmgen ran each call. Dropout's mask reaches the backward; a call
gemmgen cannot run falls back to torch's kernel and still matches; deactivation gives torch its
kernels back; torch.compile of a model using SDPA runs gemmgen's; varlen_attn is served too. Needs
the default build (`gemmgen generate --arch sm80 --arch sm90`); a call no built instance serves skips."""
from __future__ import annotations

import inspect
import logging
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gemmgen
from gemmgen.errors import NoInstanceError
from gemmgen.integrations import torch_sdpa
from gemmgen.ops import attention as gemmgen_attention
from test_attention_bwd_gpu import assert_close  # the backward tests' relative-error check and tolerances

pytestmark = pytest.mark.gpu

SDPA = "_scaled_dot_product_flash_attention"
SDPA_BWD = "_scaled_dot_product_flash_attention_backward"
DTYPES = (torch.float16, torch.bfloat16)
# ||X - ref|| / ||ref||: the kernels round P and dS to the input dtype.
LENGTHS = [(17, 17), (129, 129), (17, 129), (129, 17)]


@pytest.fixture
def active():
    """gemmgen active behind SDPA for the test (counts and reasons fresh), then torch's kernels back."""
    torch_sdpa.reset()
    gemmgen.activate()
    yield
    gemmgen.deactivate()
    torch_sdpa.reset()


def randn(shape, dtype, key) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, dtype=dtype, device="cuda", generator=gen)


def make(b, h, hkv, nq, nk, d, dtype, key, layout="bnhd"):
    """q [B, H, Nq, d], k, v [B, Hkv, Nk, d] leaves that require grad, and dO; "bnhd": [B, N, H, d]
    storage (what a model's projection gives)."""
    def one(heads, n, name):
        t = randn((b, n, heads, d) if layout == "bnhd" else (b, heads, n, d), dtype, (key, name))
        return (t.transpose(1, 2) if layout == "bnhd" else t).requires_grad_()

    return one(h, nq, "q"), one(hkv, nk, "k"), one(hkv, nk, "v"), one(h, nq, "do").detach()


def reference(q, k, v, do, *, causal=False, scale=None, keep=None, p=0.0):
    """float64 O and (dQ, dK, dV) of softmax(scale Q K^T + FlashAttention's bottom-right causal mask) V,
    the weights times keep / (1 - p) with dropout; a row that sees no key gives 0."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    group = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = (1 / math.sqrt(q.shape[-1]) if scale is None else scale) * (q64 @ kk.transpose(-2, -1))
    if causal:
        nq, nk = s.shape[-2:]
        rows = torch.arange(nq, device="cuda")[:, None]
        s = s.masked_fill(torch.arange(nk, device="cuda")[None, :] > rows + nk - nq, float("-inf"))
    seen = (s > float("-inf")).any(-1, keepdim=True)
    w = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    if keep is not None:
        w = w * keep / (1 - p)
    o = w @ vv
    o.backward(do.double())
    return o.detach(), [t.grad for t in leaves]


def assert_matches_reference(o, q, k, v, do, dtype, **ref):
    """O and q, k, v's gradients (after o.backward(do)) against the float64 reference(..., **ref)."""
    want_o, want_grads = reference(q, k, v, do, **ref)
    assert_close("O", o, want_o, dtype)
    for name, got, want in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), want_grads):
        assert_close(name, got, want, dtype)


def require_gemmgen(q, k, v, *, causal=False, dropout_p=0.0):
    """Skip unless the build serves the call forward and backward (gemmgen.fused_attention checks
    the backward at a forward whose inputs require grad)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        gemmgen.fused_attention(*leaves, causal=causal, causal_alignment="bottom_right", dropout_p=dropout_p)
    except NoInstanceError as exc:
        pytest.skip(f"no gemmgen instance serves the call: {exc}")


def served(op):
    """How often gemmgen's kernel ran `op` since the last reset, and how often torch's."""
    by = torch_sdpa.counts().get(op, {"gemmgen": 0, "torch": 0})
    return by["gemmgen"], by["torch"]


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda n: f"{n[0]}x{n[1]}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_runs_gemmgen_forward_and_backward(active, dtype, causal, heads, d, lengths):
    nq, nk = lengths
    q, k, v, do = make(2, *heads, nq, nk, d, dtype, ("sdpa", dtype, causal, heads, d, lengths))
    require_gemmgen(q, k, v, causal=causal)
    gqa = heads[0] != heads[1]
    if causal and nq != nk:
        # SDPA's is_causal is top-left; torch sends it to the flash op only when Nq == Nk. The flash
        # op's own is_causal is bottom-right (causal_lower_right relies on it): called directly.
        o = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    o.backward(do)
    assert_matches_reference(o, q, k, v, do, dtype, causal=causal)
    assert served(SDPA) == (1, 0) and served(SDPA_BWD) == (1, 0), torch_sdpa.fallback_reasons()


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_layouts_and_scale(active, layout):
    q, k, v, do = make(1, 4, 4, 100, 130, 64, torch.bfloat16, ("layout", layout), layout=layout)
    require_gemmgen(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, scale=0.2)
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, v)]
    assert o.stride() == torch.ops.aten._scaled_dot_product_flash_attention(*meta, scale=0.2)[0].stride()
    o.backward(do)
    assert_matches_reference(o, q, k, v, do, torch.bfloat16, scale=0.2)
    assert served(SDPA) == (1, 0) and served(SDPA_BWD) == (1, 0), torch_sdpa.fallback_reasons()


def test_dropout_mask_reaches_the_backward(active):
    dtype, p = torch.bfloat16, 0.2
    q, k, v, do = make(1, 2, 2, 100, 130, 64, dtype, "dropout")
    require_gemmgen(q, k, v, dropout_p=p)
    outs = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, False)
    seed, offset = outs[6].tolist()  # gemmgen's philox outputs: on the CPU, read without a sync
    outs[0].backward(do)
    from test_mea_gpu import keep_mask  # the kernel's mask for (seed, offset), read back

    keep = keep_mask(q.detach(), k.detach(), p=p, seed=seed, offset=offset, name=None)
    want_o, want_grads = reference(q, k, v, do, keep=keep, p=p)
    assert_close("O", outs[0], want_o, dtype)
    for name, got, want in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), want_grads):
        assert_close(f"dropout {name}", got, want, dtype)
    # Through SDPA: a fresh mask each call, gemmgen's backward for gemmgen's forward.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        first = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        second = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert not torch.equal(first, second)
    second.backward(do)
    assert served(SDPA) == (3, 0) and served(SDPA_BWD) == (2, 0), torch_sdpa.fallback_reasons()


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_repeated_calls_take_the_remembered_path_and_match(active, monkeypatch, grad):
    """The second and later calls of one metadata run through the remembered path (torch_sdpa's
    _serve_again) with fresh values each time: SDPA's op (GQA, causal) and the [B, N, H, d] flash op,
    O and LSE against float64; with grad, the backward of a remembered forward too."""
    again = []
    real = torch_sdpa._serve_again

    def counting(r, args):
        result = real(r, args)
        again.append(result is not None)
        return result

    monkeypatch.setattr(torch_sdpa, "_serve_again", counting)
    dtype, d = torch.bfloat16, 64
    q0, k0, v0, _ = make(2, 8, 2, 1, 77, d, dtype, "repeat-probe")
    require_gemmgen(q0, k0, v0, causal=True)
    for i in range(3):
        q, k, v, do = make(2, 8, 2, 1, 77, d, dtype, ("repeat", grad, i))
        with torch.set_grad_enabled(grad), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
        if grad:
            o.backward(do)
            assert_matches_reference(o, q, k, v, do, dtype)
        else:
            assert_close("O", o, reference(q, k, v, do)[0], dtype)
    # The [B, N, H, d] op with its LSE, bottom-right causal at Nq != Nk.
    for i in range(3):
        q, k, v, do = make(1, 4, 4, 33, 150, d, dtype, ("repeat-bnhd", grad, i))
        with torch.set_grad_enabled(grad):
            outs = torch.ops.aten._flash_attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), None, None,
                                                           33, 150, 0.0, True, False)
        o = outs[0].transpose(1, 2)
        want_o, _ = reference(q, k, v, do, causal=True)
        assert_close("O", o, want_o, dtype)
        s = (q.detach().double() @ k.detach().double().transpose(-2, -1)) / math.sqrt(d)
        s = s.masked_fill(torch.arange(150, device="cuda")[None, :] > torch.arange(33, device="cuda")[:, None] + 117,
                          float("-inf"))
        assert_close("LSE", outs[1], torch.logsumexp(s, -1), dtype)
    assert again == [True, True, True, True], again  # the first call of each metadata ran the full path
    assert served(SDPA) == (3, 0) and served("_flash_attention_forward") == (3, 0), torch_sdpa.fallback_reasons()


def test_repeated_calls_at_a_head_dim_without_tiles(active):
    """Head dim 80 runs padded inside gemmgen.fused_attention, so its calls are not remembered for a
    direct launch: every call takes the full path and matches."""
    dtype = torch.bfloat16
    for i in range(3):
        q, k, v, do = make(2, 4, 4, 33, 65, 80, dtype, ("pad-repeat", i), layout="bhnd")
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v)
        assert_close("O", o, reference(q, k, v, do)[0], dtype)
    assert not torch_sdpa._repeats._by_key
    assert served(SDPA) == (3, 0), torch_sdpa.fallback_reasons()


def test_a_repeated_call_with_a_misaligned_pointer_takes_the_full_path(active):
    """Alignment is a per-call fact: the remembered path declines a call whose metadata it knows but
    whose q starts off a 16-byte boundary (the full path then reports it and torch's kernel runs it)."""
    dtype = torch.bfloat16
    q, k, v, do = (t.detach() for t in make(1, 4, 4, 40, 40, 64, dtype, "misaligned", layout="bhnd"))
    require_gemmgen(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v)
    (repeat,) = torch_sdpa._repeats._by_key.values()
    base = torch.empty(q.numel() + 8, dtype=dtype, device="cuda")
    shifted = base[4:4 + q.numel()].view(q.shape).copy_(q)  # q's shape and strides, 8 bytes off
    assert torch_sdpa._serve_again(repeat, (shifted, k, v)) is None
    outs = torch_sdpa._serve_again(repeat, (q, k, v))
    assert outs is not None
    assert_close("O", outs[0], reference(q, k, v, do)[0], dtype)


def no_instance(*args, **kwargs):
    raise NoInstanceError("No built instance runs this call (a test's stand-in)")


def test_a_call_gemmgen_cannot_run_falls_back_and_still_matches(active, monkeypatch, caplog):
    monkeypatch.setattr(gemmgen_attention, "fused_attention", no_instance)
    dtype = torch.bfloat16
    q, k, v, do = make(2, 8, 2, 129, 129, 128, dtype, "fallback")
    with caplog.at_level(logging.WARNING, logger="gemmgen.sdpa"), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(do)
    assert_matches_reference(o, q, k, v, do, dtype, causal=True)
    assert served(SDPA) == (0, 2)
    assert len([r for r in caplog.records if r.name == "gemmgen.sdpa"]) == 1
    assert torch_sdpa.fallback_reasons() == [f"aten::{SDPA}: NoInstanceError: No built instance runs this call "
                                             "(a test's stand-in)"]


def test_dropout_fallback_is_torchs_own_computation(active, monkeypatch):
    """A dropout forward gemmgen cannot run goes to torch's kernel, and so does its backward (only
    torch's regenerates that mask): what torch computes without gemmgen, the same mask (O bit for bit;
    torch's backward accumulates dQ with atomics, so the gradients agree to rounding)."""
    monkeypatch.setattr(gemmgen_attention, "fused_attention", no_instance)
    q, k, v, do = make(2, 4, 4, 65, 65, 64, torch.float16, "dropout-fallback")

    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(*leaves, dropout_p=0.3)
        o.backward(do)
        return [o.detach()] + [t.grad for t in leaves]

    routed = step()
    assert served(SDPA) == (0, 1) and served(SDPA_BWD) == (0, 1)
    gemmgen.deactivate()
    plain = step()
    assert torch.equal(routed[0], plain[0])
    for got, want in zip(routed[1:], plain[1:]):  # another mask would be ~100% off
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() <= 1e-3


def test_deactivation_gives_torch_its_kernels_back(active):
    q, k, v, do = make(1, 4, 4, 64, 64, 64, torch.bfloat16, "deactivate")
    require_gemmgen(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v)
        gemmgen.deactivate()
        assert torch.nn.attention.current_flash_attention_impl() is None
        again = F.scaled_dot_product_attention(q, k, v)
        again.backward(do)
    assert served(SDPA) == (1, 0) and served(SDPA_BWD) == (0, 0)
    assert_close("torch's O", again, reference(q, k, v, do)[0], torch.bfloat16)
    assert_close("gemmgen's O", o, reference(q, k, v, do)[0], torch.bfloat16)


def test_torch_compile_of_a_model_using_sdpa(active):
    """A GPT whose attention is F.scaled_dot_product_attention(is_causal=True), compiled with
    fullgraph=True: the compiled forward and backward call the flash ops, gemmgen's kernels serve
    them, and the loss and gradients are the eager model's (bf16: 5% relative norm per parameter)."""
    from test_attention_bwd_gpu import loss_of, make_model, rel_diff, sdpa_attend

    torch._dynamo.reset()
    tokens = torch.randint(0, 256, (2, 129), device="cuda")
    probe = torch.zeros(2, 4, 128, 64, dtype=torch.bfloat16, device="cuda")
    require_gemmgen(probe, probe, probe, causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        model = make_model(sdpa_attend, layers=2)
        eager_loss = loss_of(model, tokens)
        eager_loss.backward()
        eager = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=False)
        torch_sdpa.reset()
        compiled = torch.compile(model, fullgraph=True)
        loss = loss_of(compiled, tokens)
        loss.backward()
    # Two layers: two calls each way (more if the partitioner chose to recompute), none on torch's kernel.
    assert served(SDPA)[0] >= 2 and served(SDPA_BWD)[0] >= 2, torch_sdpa.counts()
    assert served(SDPA)[1] == served(SDPA_BWD)[1] == 0, torch_sdpa.fallback_reasons()
    assert abs(loss.item() - eager_loss.item()) <= 1e-2 * abs(eager_loss.item())
    for a, b in zip(eager, [p.grad for p in model.parameters()]):
        assert rel_diff(a, b) <= 5e-2


def test_varlen_attn_runs_gemmgen(active):
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    dtype, lengths, d = torch.bfloat16, [17, 0, 129, 64], 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, top = sum(lengths), max(lengths)
    q, k, v, do = (randn((total, 4, d), dtype, ("varlen", name)) for name in ("q", "k", "v", "do"))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    try:
        gemmgen.fused_attention_varlen(*leaves, cu, cu, top, top, causal=True)
    except NoInstanceError as exc:
        pytest.skip(f"no gemmgen instance serves packed sequences: {exc}")
    params = inspect.signature(varlen.varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    o = varlen.varlen_attn(*leaves, cu, cu, top, top, **causal)
    if served("_flash_attention_forward") == (0, 0):
        pytest.skip("this torch does not route varlen_attn through aten::_flash_attention_forward")
    o.backward(do)
    for (start, end) in zip(cu.tolist(), cu.tolist()[1:]):
        if start == end:
            continue
        views = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v, do)]
        want_o, want_grads = reference(*views, causal=True)
        assert_close(f"O {start}:{end}", o[start:end], want_o[0].transpose(0, 1), dtype)
        for name, t, want in zip(("dQ", "dK", "dV"), leaves, want_grads):
            assert_close(f"{name} {start}:{end}", t.grad[start:end], want[0].transpose(0, 1), dtype)
    assert served("_flash_attention_forward") == (1, 0), torch_sdpa.fallback_reasons()
    has_backward = hasattr(torch.ops.gemmgen, "fused_attention_varlen_backward")
    assert served("_flash_attention_backward") == ((1, 0) if has_backward else (0, 1))


def test_causal_varlen_attn_with_different_lengths_runs_bottom_right(active):
    """Causal packed sequences whose query and key lengths differ (separate cum_seq tensors): torch's
    mask is bottom-right within each sequence, and gemmgen serves it so (fa2_sm80, fa2_bwd_sm80)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    dtype, d = torch.bfloat16, 64
    lens_q, lens_k = [17, 0, 64, 5], [40, 3, 129, 5]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (lens_q, lens_k))
    q, do = (randn((sum(lens_q), 4, d), dtype, ("varlen-br", name)) for name in ("q", "do"))
    k, v = (randn((sum(lens_k), 4, d), dtype, ("varlen-br", name)) for name in ("k", "v"))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    params = inspect.signature(varlen.varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    o = varlen.varlen_attn(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), **causal)
    if served("_flash_attention_forward") == (0, 0):
        pytest.skip("this torch does not route varlen_attn through aten::_flash_attention_forward")
    o.backward(do)
    for sq, sk in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
        if sq[0] == sq[1] or sk[0] == sk[1]:
            continue
        views = [t[a:b].transpose(0, 1).unsqueeze(0) for t, (a, b) in zip((q, k, v, do), (sq, sk, sk, sq))]
        want_o, want_grads = reference(*views, causal=True)
        assert_close(f"O {sq}", o[sq[0]:sq[1]], want_o[0].transpose(0, 1), dtype)
        for name, t, rows, want in zip(("dQ", "dK", "dV"), leaves, (sq, sk, sk), want_grads):
            assert_close(f"{name} {rows}", t.grad[rows[0]:rows[1]], want[0].transpose(0, 1), dtype)
    assert served("_flash_attention_forward") == (1, 0), torch_sdpa.fallback_reasons()
