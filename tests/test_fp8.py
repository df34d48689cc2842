"""fused_attention on fp8 inputs without a GPU: the argument checks of the fp8 path (each bad input an
InputError naming it, a well-formed call on CPU tensors DeviceError), the descale factors as the
kernel reads them, V's transposed copy, the fake implementation and a torch.compile trace on fake
CUDA tensors, and the fp8 instances of the fmha_sm90 family."""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gemmgen
from gemmgen.generator.families import fmha_sm90 as fam
from gemmgen.generator.families.base import DType, Mask
from gemmgen.kernels import launch
from gemmgen.ops import fp8
from gemmgen.select import device, registry
from gemmgen.select.problem import Problem

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
CPU = torch.device("cpu")
H200 = device.synthetic((9, 0), 132)


def e4m3(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(FP8)


def qkv(b=2, h=4, hkv=2, nq=16, nk=32, d=64):
    return e4m3(b, h, nq, d), e4m3(b, hkv, nk, d), e4m3(b, hkv, nk, d)


def fake_qkv(mode: FakeTensorMode, layout: str = "bhnd", requires_grad: bool = False):
    """fp8 q [2, 4, 17, 64], k and v [2, 2, 19, 64] on a fake CUDA device ([B, N, H, d] storage with
    "bnhd")."""
    with mode:
        if layout == "bnhd":
            q = torch.empty(2, 17, 4, 64, dtype=FP8, device="cuda").transpose(1, 2)
            k, v = (torch.empty(2, 19, 2, 64, dtype=FP8, device="cuda").transpose(1, 2) for _ in range(2))
        else:
            q = torch.empty(2, 4, 17, 64, dtype=FP8, device="cuda")
            k, v = (torch.empty(2, 2, 19, 64, dtype=FP8, device="cuda") for _ in range(2))
        if requires_grad:
            q.requires_grad_()
    return q, k, v


# The checks before the device check, in the order gemmgen.ops.fp8.prepare makes them.
BAD = [
    ("q fp8, k bf16", lambda q, k, v: gemmgen.fused_attention(q, k.to(BF16), v), "q, k, v all in torch.float8_e4m3fn"),
    ("q bf16, k v fp8", lambda q, k, v: gemmgen.fused_attention(q.to(BF16), k, v), "q, k, v all in"),
    ("v float32", lambda q, k, v: gemmgen.fused_attention(q, k, v.float()), "q, k, v all in"),
    ("head_dim 96", lambda q, k, v: gemmgen.fused_attention(*qkv(d=96)), "one of 64, 128, 256; got 96, 96, 96"),
    ("head_dim 32", lambda q, k, v: gemmgen.fused_attention(*qkv(d=32)), "one of 64, 128, 256"),
    ("head dims differ", lambda q, k, v: gemmgen.fused_attention(q, e4m3(2, 2, 32, 128), e4m3(2, 2, 32, 128)),
     "head_dim must be equal across q, k, v"),
    ("batch differs", lambda q, k, v: gemmgen.fused_attention(q, k[:1], v[:1]), "batch must be equal"),
    ("k, v seqlens differ", lambda q, k, v: gemmgen.fused_attention(q, k, v[:, :, :16]), "same seqlen"),
    ("heads 4 over 3", lambda q, k, v: gemmgen.fused_attention(q, e4m3(2, 3, 32, 64), e4m3(2, 3, 32, 64)),
     "dividing q's 4"),
    ("k, v heads differ", lambda q, k, v: gemmgen.fused_attention(q, k, v[:, :1]), "same number of heads"),
    ("3-D q", lambda q, k, v: gemmgen.fused_attention(q[0], k, v), "q must be 4-D"),
    ("causal='yes'", lambda q, k, v: gemmgen.fused_attention(q, k, v, causal="yes"), "causal must be a bool"),
    ("return_lse=1", lambda q, k, v: gemmgen.fused_attention(q, k, v, return_lse=1), "return_lse must be a bool"),
    ("instance=3", lambda q, k, v: gemmgen.fused_attention(q, k, v, instance=3), "instance must be"),
    ("causal_alignment", lambda q, k, v: gemmgen.fused_attention(q, k, v, causal=True, causal_alignment="center"),
     "causal_alignment 'center'"),
    ("scale=nan", lambda q, k, v: gemmgen.fused_attention(q, k, v, scale=math.nan), "scale must be finite"),
    ("scale<0", lambda q, k, v: gemmgen.fused_attention(q, k, v, scale=-0.5), "scales >= 0"),
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in BAD], ids=[i for i, _, _ in BAD])
def test_bad_arguments_raise_input_error(call, match):
    with pytest.raises(gemmgen.InputError, match=match):
        call(*qkv())


def test_strides_multiples_of_16_elements_outside_the_last_dim():
    """Row, head and batch strides must be multiples of 16 fp8 elements (16 bytes) where the dim is
    stepped over; a dim of size 1 is never stepped over."""
    q, k, v = qkv()
    rows = e4m3(2, 4, 16, 72)[..., :64]  # row stride 72
    heads = e4m3(2, 16, 4, 72)[..., :64].transpose(1, 2)  # [B, N, H, d] storage: head stride 72
    batch = e4m3(2 * 4 * 16 * 64 + 8).as_strided((2, 4, 16, 64), (4 * 16 * 64 + 8, 16 * 64, 64, 1))
    for name, bad, call in (("q", rows, lambda t: gemmgen.fused_attention(t, k, v)),
                            ("q", heads, lambda t: gemmgen.fused_attention(t, k, v)),
                            ("q", batch, lambda t: gemmgen.fused_attention(t, k, v)),
                            ("k", e4m3(2, 2, 32, 72)[..., :64], lambda t: gemmgen.fused_attention(q, t, v)),
                            ("v", e4m3(2, 2, 32, 72)[..., :64], lambda t: gemmgen.fused_attention(q, k, t))):
        with pytest.raises(gemmgen.InputError, match=f"{name}'s strides .* must be multiples of 16 elements"):
            call(bad)
    square = e4m3(2, 4, 64, 64).transpose(2, 3)
    with pytest.raises(gemmgen.InputError, match="q must be contiguous in its last dim"):
        gemmgen.fused_attention(square, k, v)
    # Multiples of 8 elements (what 16-bit inputs need) are not enough for fp8.
    with pytest.raises(gemmgen.InputError, match="multiples of 16 elements"):
        gemmgen.fused_attention(e4m3(2, 4, 16, 136)[..., 64:128], k, v)
    # Passing: a row stride of 80, [B, N, H, d] views, a batch of 1 with any batch stride.
    one = e4m3(4 * 16 * 64 + 8)[8:].as_strided((1, 4, 16, 64), (3, 16 * 64, 64, 1))
    for good in (e4m3(2, 4, 16, 80)[..., :64], e4m3(2, 16, 4, 64).transpose(1, 2)):
        with pytest.raises(gemmgen.DeviceError):
            gemmgen.fused_attention(good, k, v)
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention(one, k[:1], v[:1])


UNSUPPORTED = [
    ("dropout_p", dict(dropout_p=0.1)),
    ("attn_mask", dict(attn_mask=torch.zeros(16, 32))),
    ("out", dict(out=torch.empty(2, 4, 16, 64, dtype=BF16))),
    ("window", dict(window=(8, 8))),
    ("softcap", dict(softcap=30.0)),
]


@pytest.mark.parametrize("name, kw", UNSUPPORTED, ids=[n for n, _ in UNSUPPORTED])
def test_arguments_without_an_fp8_form_are_refused_by_name(name, kw):
    with pytest.raises(gemmgen.InputError, match=f"fp8 attention runs without {name} "):
        gemmgen.fused_attention(*qkv(), **kw)
    # Before the shape checks: a call bad in other ways too names the argument.
    with pytest.raises(gemmgen.InputError, match=f"without {name} "):
        gemmgen.fused_attention(*qkv(d=96), **kw)


@pytest.mark.parametrize("kw", [dict(seed=1), dict(offset=3), dict(deterministic=True), dict(window=(-1, -1)),
                                dict(window=(-1, 0)), dict(causal=True, window=(-1, -1))],
                         ids=["seed", "offset", "deterministic", "window-none", "window-causal", "causal-window"])
def test_arguments_that_change_nothing_without_dropout_or_backward_pass(kw):
    """A seed or offset without dropout, deterministic (of a backward fp8 has not), and windows that
    normalize to no window or causal (-1, -1) and (-1, 0), as the 16-bit path takes them."""
    with pytest.raises(gemmgen.DeviceError, match="fp8 attention needs a CUDA GPU"):
        gemmgen.fused_attention(*qkv(), **kw)


def test_those_arguments_at_their_defaults_pass():
    with pytest.raises(gemmgen.DeviceError, match="fp8 attention needs a CUDA GPU"):
        gemmgen.fused_attention(*qkv(), dropout_p=0.0, seed=None, offset=0, attn_mask=None, out=None,
                                deterministic=False, window=None, softcap=0.0)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, causal_alignment="bottom_right"),
                                dict(scale=0.0), dict(scale=2), dict(return_lse=True), dict(instance="x"),
                                dict(q_descale=0.5, k_descale=torch.ones(2, 1), v_descale=torch.ones(1))],
                         ids=["plain", "causal", "bottom-right", "scale-0", "scale-int", "lse", "instance",
                              "descales"])
def test_well_formed_calls_on_cpu_tensors_raise_device_error(kw):
    with pytest.raises(gemmgen.DeviceError, match="fp8 attention needs a CUDA GPU"):
        gemmgen.fused_attention(*qkv(), **kw)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(h=8, hkv=1, d=256))
    with pytest.raises(gemmgen.DeviceError):
        gemmgen.fused_attention(q, k, v, **kw)


def test_descale_on_16_bit_inputs_is_refused():
    q, k, v = (t.to(BF16) for t in qkv())
    for kw in (dict(q_descale=0.5), dict(k_descale=torch.ones(2, 2)), dict(v_descale=1.0)):
        with pytest.raises(gemmgen.InputError, match="apply to fp8 inputs .* q, k, v are torch.bfloat16"):
            gemmgen.fused_attention(q, k, v, **kw)
    q16, k16, v16 = (t.half() for t in (q, k, v))
    with pytest.raises(gemmgen.InputError, match="torch.float16"):
        gemmgen.fused_attention(q16, k16, v16, q_descale=1.0)
    with pytest.raises(gemmgen.DeviceError):  # None is every descale's default
        gemmgen.fused_attention(q, k, v, q_descale=None, k_descale=None, v_descale=None)


@pytest.mark.parametrize("value, match", [(0.0, "must be > 0"), (-1.0, "must be > 0"), (math.nan, "must be finite"),
                                          (math.inf, "must be finite"), (True, "must be a float"),
                                          ("1", "must be a float"), (10**400, "finite float"),
                                          (1e39, "a finite float32")],
                         ids=["zero", "negative", "nan", "inf", "bool", "str", "huge-int", "past-float32"])
def test_descale_number_checks(value, match):
    with pytest.raises(gemmgen.InputError, match=f"k_descale .*{match}"):
        fp8.descale("k_descale", value, 2, 2, CPU)


@pytest.mark.parametrize("value, match", [
    (torch.ones(2, 2, dtype=torch.float64), "q_descale must be a float32 tensor; got torch.float64"),
    (torch.ones(2, 2, dtype=BF16), "float32 tensor"),
    (torch.ones(2, 2, dtype=torch.int32), "float32 tensor"),
    (torch.ones(3), r"shape \(3,\) does not broadcast to \[B, Hkv\] = \[2, 2\]"),
    (torch.ones(2, 3), "does not broadcast"),
    (torch.ones(4, 2), "does not broadcast"),
    (torch.ones(2, 2, 1), r"must broadcast to \[B, Hkv\] = \[2, 2\]; got shape \(2, 2, 1\)"),
    (torch.ones(1, 1, 1), "must broadcast to"),
], ids=["float64", "bf16", "int32", "[3]", "[2,3]", "[4,2]", "[2,2,1]", "[1,1,1]"])
def test_descale_tensor_checks(value, match):
    with pytest.raises(gemmgen.InputError, match=match):
        fp8.descale("q_descale", value, 2, 2, CPU)


def test_descale_tensor_on_another_device():
    with pytest.raises(gemmgen.InputError, match="v_descale must be on q's device meta"):
        fp8.descale("v_descale", torch.ones(2, 2), 2, 2, torch.device("meta"))


def test_descale_forms():
    """None stays None; a float becomes a [B, Hkv] float32 tensor of it; a tensor is broadcast to
    [B, Hkv] and made contiguous (one already so is passed as it is)."""
    assert fp8.descale("q_descale", None, 2, 3, CPU) is None
    for value in (0.25, 3, 1e-3):
        t = fp8.descale("q_descale", value, 2, 3, CPU)
        assert t.dtype == torch.float32 and t.shape == (2, 3) and t.device == CPU and t.is_contiguous()
        assert torch.equal(t, torch.full((2, 3), float(value)))
    per_head = torch.tensor([0.5, 1.0, 2.0])
    per_batch = torch.tensor([[0.5], [4.0]])
    full = torch.rand(2, 3) + 0.25
    same = torch.full((2, 3), 0.75)
    for value, want in ((torch.tensor(0.75), same), (torch.tensor([0.75]), same), (per_head, per_head.expand(2, 3)),
                        (per_batch, per_batch.expand(2, 3)), (full, full)):
        t = fp8.descale("k_descale", value, 2, 3, CPU)
        assert t.dtype == torch.float32 and t.shape == (2, 3) and t.is_contiguous() and torch.equal(t, want)
    assert fp8.descale("v_descale", full, 2, 3, CPU).data_ptr() == full.data_ptr()
    # A non-positive tensor entry is no error here: those heads give NaN rows (the kernel's loud failure).
    assert torch.equal(fp8.descale("q_descale", torch.zeros(3), 2, 3, CPU), torch.zeros(2, 3))
    assert fp8.descale("q_descale", torch.ones(0, 3), 0, 3, CPU).shape == (0, 3)



def test_is_fp8_and_head_dims():
    q, k, v = qkv()
    assert fp8.is_fp8(q, k, v) and fp8.is_fp8(q.to(BF16), k.to(BF16), v)
    assert not fp8.is_fp8(q.to(BF16), k.to(BF16), v.to(BF16)) and not fp8.is_fp8(None, 1.0, "q")
    assert not fp8.is_fp8(q.view(torch.uint8))
    assert fp8.head_dims() == fam.FP8_HEAD_DIMS == (64, 128, 256)
    assert launch.PROBLEM_DTYPES[FP8] == "fp8" and FP8 not in launch.DTYPE_NAMES


def test_inputs_that_require_grad_are_refused():
    """No backward: with grad mode on, fp8 inputs that require grad raise (on fake CUDA tensors, past
    the device check); under no_grad the call goes on."""
    for layout in ("bhnd", "bnhd"):
        mode = FakeTensorMode()
        q, k, v = fake_qkv(mode, layout, requires_grad=True)
        with mode, pytest.raises(gemmgen.InputError, match="fp8 attention has no backward"):
            gemmgen.fused_attention(q, k, v)
        with mode, pytest.raises(gemmgen.InputError, match="no backward"):
            gemmgen.fused_attention(q.detach(), k, v.detach().requires_grad_(), causal=True)
        with mode, torch.no_grad():
            assert gemmgen.fused_attention(q, k, v).dtype == BF16


def test_descale_checks_on_fake_cuda_tensors():
    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode)
    with mode, pytest.raises(gemmgen.InputError, match="q_descale must be on q's device cuda:0; got cpu"):
        gemmgen.fused_attention(q, k, v, q_descale=torch.ones(2, 2))
    with mode:
        bad = torch.ones(2, 4, device="cuda")  # query heads, not K/V heads
    with mode, pytest.raises(gemmgen.InputError, match=r"k_descale of shape \(2, 4\) does not broadcast"):
        gemmgen.fused_attention(q, k, v, k_descale=bad)
    with mode, pytest.raises(gemmgen.InputError, match="v_descale must be > 0"):
        gemmgen.fused_attention(q, k, v, v_descale=-2.0)


@pytest.mark.parametrize("layout, strides", [("bhnd", (4 * 17 * 64, 17 * 64, 64, 1)),
                                             ("bnhd", (17 * 4 * 64, 64, 4 * 64, 1))])
def test_fake_implementation(layout, strides):
    """O in bfloat16 with q's layout, LSE float32 [B, H, Nq] (an empty tensor without return_lse).
    The descale forms that need no copy (a broadcast one is copied, which a CPU build of torch cannot
    do on fake CUDA tensors: test_descale_forms covers those)."""
    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode, layout)
    with mode:
        forms = [None, 0.5, torch.ones(2, 2, device="cuda")]
        for form in forms:
            o, lse = gemmgen.fused_attention(q, k, v, causal=True, return_lse=True, q_descale=form, k_descale=form,
                                             v_descale=form)
            assert o.shape == q.shape and o.stride() == strides and o.dtype == BF16 and o.device.type == "cuda"
            assert lse.shape == (2, 4, 17) and lse.dtype == torch.float32
        o = gemmgen.fused_attention(q, k, v)
        _, no_lse = torch.ops.gemmgen.fused_attention_fp8(q, k, v)
    assert isinstance(o, torch.Tensor) and o.dtype == BF16 and no_lse.numel() == 0


def test_compiles_into_one_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, q_descale, k_descale):
        o, lse = gemmgen.fused_attention(q, k, v, causal=True, return_lse=True, q_descale=q_descale,
                                         k_descale=k_descale, v_descale=0.5)
        return o.float() * 2, lse

    mode = FakeTensorMode()
    q, k, v = fake_qkv(mode)
    with mode:
        o, lse = torch.compile(f, backend=backend, fullgraph=True)(q, k, v, torch.ones(2, 2, device="cuda"),
                                                                   torch.ones(2, 2, device="cuda"))
    assert len(graphs) == 1 and o.dtype == torch.float32 and lse.shape == (2, 4, 17)
    assert "torch.ops.gemmgen.fused_attention_fp8.default" in graphs[0].code


def _fp8_instances() -> list:
    return [inst for inst in fam.SPACE if inst.dtype is DType.FP8]


def test_fp8_instances_of_the_family():
    """Every fp8 instance: the persistent schedule with our softmax, an fp8 head dim, no mask or
    causal, no packed sequences; named `_fp8_`, built by default at one tile per head dim and mask."""
    insts = _fp8_instances()
    assert insts
    for inst in insts:
        assert inst.persistent and inst.lazy_rescale, inst.name
        assert inst.head_dim in fam.FP8_HEAD_DIMS and inst.mask in fam.FP8_MASKS, inst.name
        assert not inst.runs_varlen and "varlen" not in inst.params(), inst.name
        stem = f"fmha_sm90_fp8_d{inst.head_dim}_{inst.mask.value}_pingpong_"
        assert "fp8" in inst.name and inst.name.startswith(stem), inst.name
        assert inst.name.endswith("_lr") or "_lr_" in inst.name
        assert inst.params()["dtype"] == "fp8" and fam.INSTANCE.from_params(inst.params()) == inst
        # Q and K/V tiles in one byte per element, O's buffers (where it has them) in bf16, and 256
        # bytes of factor slots.
        bf16 = fam.FmhaSm90Instance(DType.BF16, inst.head_dim, inst.mask, inst.schedule, inst.block_m,
                                    inst.block_n, inst.stages, inst.lazy_rescale, inst.q_buffers)
        buffers = not inst.direct_store
        assert bf16._smem_bytes(inst.stages, buffers) - inst.smem_bytes == (
            inst.q_buffers * inst.block_m + inst.stages * inst.block_n) * inst.head_dim - 256
    assert {(i.head_dim, i.mask) for i in insts} == {(d, m) for d in fam.FP8_HEAD_DIMS for m in fam.FP8_MASKS}
    preferred = [i for i in fam.PREFERRED_DEFAULT if i.dtype is DType.FP8]
    assert sorted((i.head_dim, i.mask.value) for i in preferred) == sorted(
        (d, m.value) for d in fam.FP8_HEAD_DIMS for m in fam.FP8_MASKS)
    assert all((i.schedule, i.block_m, i.block_n, i.q_buffers) == fam.FP8_TILE[i.head_dim, i.causal] for i in preferred)
    assert [i for i in fam.DEFAULT if i.dtype is DType.FP8] == preferred


def test_fp8_dtype():
    assert DType("fp8") is DType.FP8
    assert DType.FP8.cpp == "cutlass::float_e4m3_t" and DType.FP8.itemsize == 1


def test_fp8_validity_rule():
    """Off the persistent schedule or without our softmax, at another head dim or with a sliding
    window, an fp8 instance is invalid, saying why."""
    base = next(i for i in _fp8_instances() if i.head_dim == 128 and i.mask is Mask.NONE)
    tma = fam.FmhaSm90Instance(DType.FP8, 64, Mask.NONE, fam.Schedule.TMA, 64, 128, 4, lazy_rescale=True)
    coop = fam.FmhaSm90Instance(DType.FP8, 128, Mask.NONE, fam.Schedule.COOPERATIVE, 128, 128, 5, lazy_rescale=True)
    cutlass_softmax = fam.FmhaSm90Instance(DType.FP8, base.head_dim, base.mask, base.schedule, base.block_m,
                                           base.block_n, base.stages, False, base.q_buffers)
    for inst in (tma, coop, cutlass_softmax):
        assert "persistent schedule" in fam.invalid_reason(inst)
    for d, mask in ((96, Mask.NONE), (32, Mask.CAUSAL), (128, Mask.LOCAL)):
        inst = fam.FmhaSm90Instance(DType.FP8, d, mask, base.schedule, base.block_m, base.block_n, base.stages,
                                    True, base.q_buffers)
        assert "fp8 runs head dims 64, 128, 256 with masks none, causal" in fam.invalid_reason(inst)


def _problem(**kw) -> Problem:
    return Problem(**{"dtype": "fp8", "head_dim": 128, "causal": False, "device": H200, "batch_heads": 32,
                      "seqlen_q": 1024, "seqlen_k": 1024, **kw})


def test_what_an_fp8_instance_runs():
    """An fp8 problem goes to fp8 instances only, and those run no 16-bit problem, no packed
    sequences and, causal, Nq <= Nk only (either alignment)."""
    none = next(i for i in fam.PREFERRED_DEFAULT if i.dtype is DType.FP8 and i.head_dim == 128 and not i.causal)
    causal = next(i for i in fam.PREFERRED_DEFAULT if i.dtype is DType.FP8 and i.head_dim == 128 and i.causal)
    bf16 = next(i for i in fam.PREFERRED_DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128 and not i.causal)
    assert registry.functional_reason(fam, none, _problem()) is None
    assert "dtype bf16, the problem is fp8" in registry.functional_reason(fam, bf16, _problem())
    assert "dtype fp8, the problem is bf16" in registry.functional_reason(fam, none, _problem(dtype="bf16"))
    assert "head_dim" in registry.functional_reason(fam, none, _problem(head_dim=64))
    assert registry.functional_reason(fam, none, _problem(varlen=True)) is not None
    assert registry.functional_reason(fam, none, _problem(gqa=4, layout="bnhd")) is None
    for alignment in ("top_left", "bottom_right"):
        assert registry.functional_reason(fam, causal, _problem(causal=True, causal_alignment=alignment,
                                                                seqlen_q=300)) is None
        assert "seqlen_q <= seqlen_k" in registry.functional_reason(
            fam, causal, _problem(causal=True, causal_alignment=alignment, seqlen_q=1100))
    assert "scales >= 0" in registry.functional_reason(fam, none, _problem(negative_scale=True))


def test_explain_and_selected_instance_check_the_fp8_call():
    """They describe the fp8 call: its argument checks, then the device's."""
    q, k, v = qkv()
    for ask in (gemmgen.explain, gemmgen.selected_instance):
        with pytest.raises(gemmgen.InputError, match="fp8 attention runs without softcap"):
            ask(q, k, v, softcap=3.0)
        with pytest.raises(gemmgen.InputError, match="head_dim must be equal across q, k, v and one of 64, 128, 256"):
            ask(*qkv(d=96))
        with pytest.raises(gemmgen.DeviceError, match="fp8 attention needs a CUDA GPU"):
            ask(q, k, v, causal=True)

