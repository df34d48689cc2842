"""fused_attention on fp8 inputs (torch.float8_e4m3fn, O in bfloat16) on an sm_90 GPU against the
float64 reference of the dequantized inputs (each stored value times its factor): every built fp8
instance of fmha_sm90 forced by name on the lengths it accepts, the registry's pick, layouts and
GQA/MQA, the descale forms, non-positive factors, empty sizes, torch.compile and CUDA graphs. O is
allocated by the op: the tests fill that allocation with NaN before the kernel runs (the op's
allocator wrapped for the call), and NaN never passes. Needs `gemmgen generate --arch
sm90` (the fp8 instances are in the default set)."""
from __future__ import annotations

import zlib

from unittest import mock

import pytest
import torch

import gemmgen
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.generator.families import fmha_sm90 as fam
from gemmgen.kernels import launch
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, registry, selection

from test_fused_attention import randn

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
# ||O - ref|| / ||ref|| against the float64 attention of the dequantized inputs, where q, k and the
# probabilities P are 8-bit (the measured errors are documented in docs/fp8.md).
FP8_TOLERANCE = 0.05
LSE_TOLERANCE = 1e-2  # max |LSE - ref| where the reference is finite (natural log), or LSE_RTOL of |ref|
# Hopper's fp8 MMAs accumulate Q K^T with about 14 bits of mantissa (not fp32's 24), relative to the
# largest products of a group: with these inputs (scores in the hundreds) the LSE carried errors of
# up to 0.5 at |LSE| near 250 on an H100, so the bound grows with the LSE's size (docs/fp8.md).
LSE_RTOL = 6e-3  # the largest measured: 4.05e-3 of |LSE| (d256 causal, 128x128 tile)
INPUT_SCALE = 4.0  # standard normal values times 4 use more of e4m3's range (largest finite 448)
FACTORS = (0.25, 2.0)  # the range of the random descale factors
NO_FACTORS = (None, None, None)
LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (128, 1000), (1000, 1000), (1000, 17), (4097, 4097),
           (17, 4097), (1, 300)]


def _built() -> list[str]:
    """The built fp8 instances of fmha_sm90."""
    try:
        return sorted(c.name for c in registry.load()[0]
                      if c.entry.family == "fmha_sm90" and c.entry.state == "built"
                      and c.entry.params.get("dtype") == "fp8")
    except Exception:  # no manifest: the tests below skip
        return []


BUILT = _built()


def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if not BUILT:
        pytest.skip("no fmha_sm90 fp8 instance built (gemmgen generate --arch sm90)")


def _entry(name: str):
    return next(c.entry for c in registry.load()[0] if c.name == name)


def _instance(d: int, causal: bool) -> str:
    names = [n for n in BUILT if n.startswith(f"fmha_sm90_fp8_d{d}_{'causal' if causal else 'none'}_")]
    if not names:
        pytest.skip(f"no fmha_sm90 fp8 d{d} {'causal' if causal else 'none'} instance built")
    return names[0]


def e4m3(shape, key) -> torch.Tensor:
    """Standard normal values times INPUT_SCALE, stored in fp8 (a different seed per key)."""
    return (randn(shape, torch.float32, key) * INPUT_SCALE).to(FP8)


def make_fp8(b, h, hkv, nq, nk, d, key):
    return e4m3((b, h, nq, d), (key, "q")), e4m3((b, hkv, nk, d), (key, "k")), e4m3((b, hkv, nk, d), (key, "v"))


def uniform(shape, key, low=FACTORS[0], high=FACTORS[1]) -> torch.Tensor:
    """float32 values uniform in [low, high) on the GPU (a different seed per key)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
    return low + (high - low) * torch.rand(shape, device="cuda", generator=gen)


def factors(b, hkv, key) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v descale factors per (batch, K/V head): float32 [B, Hkv] in FACTORS."""
    return tuple(uniform((b, hkv), (key, name)) for name in ("q_descale", "k_descale", "v_descale"))


def dequantized(q, k, v, scales=NO_FACTORS) -> list[torch.Tensor]:
    """q, k, v in float64 times their factors (None: 1; a float or a tensor broadcasting to
    [B, Hkv]); query head h takes the factor of K/V head h // (H / Hkv)."""
    b, h, hkv = q.shape[0], q.shape[1], k.shape[1]
    out = []
    for t, f in zip((q, k, v), scales):
        t64 = t.double()
        if f is not None:
            f = torch.as_tensor(f, dtype=torch.float64, device=t.device).expand(b, hkv)
            if t.shape[1] != hkv:
                f = f.repeat_interleave(h // hkv, dim=1)
            t64 = t64 * f[:, :, None, None]
        out.append(t64)
    return out


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    ref_norm = ref.norm().item()
    return (o.double() - ref).norm().item() / ref_norm if ref_norm else o.double().norm().item()


def attend(q, k, v, scales=NO_FACTORS, *, poison=float("nan"), **kwargs):
    """(O, LSE) of one call, O allocated filled with `poison` (the op's allocation of O wrapped for
    the call; asserted to be the block returned)."""
    made = []
    real = launch.empty_like_layout

    def poisoned(like, shape=None, dtype=None):
        out = real(like, shape, dtype)
        if dtype == BF16 and not made:  # O (the op's first bf16 allocation)
            out.fill_(poison)
            made.append(out.data_ptr())
        return out

    with mock.patch.object(launch, "empty_like_layout", poisoned):
        o, lse = gemmgen.fused_attention(q, k, v, return_lse=True, q_descale=scales[0], k_descale=scales[1],
                                         v_descale=scales[2], **kwargs)
    torch.cuda.synchronize()
    assert o.dtype == BF16 and o.shape == q.shape and o.stride() == real(q, dtype=BF16).stride()
    if o.numel():
        assert made and o.data_ptr() == made[0], "O is not the poisoned allocation"
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()
    return o, lse


def check(q, k, v, scales=NO_FACTORS, *, causal=False, alignment="top_left", scale=None, lse_rtol=LSE_RTOL,
          **kwargs):
    """Run on a NaN-poisoned O and compare O and LSE with the float64 reference of the dequantized
    inputs; LSE to LSE_TOLERANCE, or `lse_rtol` of its magnitude where that is more. Returns O."""
    o, lse = attend(q, k, v, scales, causal=causal, causal_alignment=alignment, scale=scale, **kwargs)
    ref_o, ref_lse = attention_reference(*dequantized(q, k, v, scales), causal, alignment, scale)
    assert not torch.isnan(o).any(), "unwritten or NaN output elements"
    err = rel_err(o, ref_o)
    assert err <= FP8_TOLERANCE, f"relative error {err:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "LSE must be -inf exactly where no key is seen"
    assert torch.equal(o[empty], torch.zeros_like(o[empty])), "rows that see no key must be 0"
    finite = ~empty
    lse_err = (lse.double() - ref_lse).abs()[finite]
    bound = (lse_rtol * ref_lse.abs()[finite]).clamp_min(LSE_TOLERANCE)
    worst = (lse_err / ref_lse.abs()[finite].clamp_min(1.0)).max().item() if lse_err.numel() else 0.0
    assert lse_err.numel() == 0 or (lse_err <= bound).all(), \
        f"LSE error {lse_err.max().item():.3e} (relative to max(|LSE|, 1): {worst:.2e})"
    return o


@pytest.mark.parametrize("name", BUILT or ["none"])
def test_every_instance(name):
    _sm90()
    p = _entry(name).params
    d, causal = p["head_dim"], p["mask"] == "causal"
    ran = 0
    for nq, nk in LENGTHS:
        b = 1 if max(nq, nk) > 1000 else 2
        q, k, v = make_fp8(b, 4, 2, nq, nk, d, (name, nq, nk))
        scales = factors(b, 2, (name, nq, nk))
        # Causal instances run both alignments: bottom-right (chunked prefill) where Nq < Nk.
        for alignment in ("top_left", "bottom_right") if causal else ("top_left",):
            problem = calls.problem_for(q, k, causal, v=v, causal_alignment=alignment)
            if registry.functional_reason(fam, fam.INSTANCE.from_params(p), problem) is not None:
                continue  # a call the instance refuses (causal with Nq > Nk): the registry never sends it there
            check(q, k, v, scales, causal=causal, alignment=alignment, instance=name)
            ran += 1
    assert ran >= (16 if causal else 10)
    # More row tiles than the GPU's SMs: each CTA of the persistent schedule runs several, cycling
    # its Q and K/V buffers (and each tile reads its own head's factors).
    q, k, v = make_fp8(4, 16, 16, 1000, 1000, d, (name, "many tiles"))
    check(q, k, v, factors(4, 16, (name, "many tiles")), causal=causal, instance=name)


@pytest.mark.parametrize("name", BUILT or ["none"])
def test_row_maxima_that_grow(name):
    """Keys scaled by a ramp before they are stored, so that each row's maximum keeps rising over the
    key tiles: at the default scale by several powers of 2 per tile at most heads (the `_lr` softmax
    rescales O), at a 16th of it by a fraction of one (probabilities of up to 2^8 against a lagging
    maximum, in the 8-bit P)."""
    _sm90()
    p = _entry(name).params
    d, causal = p["head_dim"], p["mask"] == "causal"
    q, _, v = make_fp8(1, 4, 2, 300, 1000, d, (name, "grow"))
    ramp = torch.linspace(0.5, 4.0, 1000, device="cuda")[:, None]
    k = (randn((1, 2, 1000, d), torch.float32, (name, "grow", "k")) * INPUT_SCALE * ramp).to(FP8)
    scales = factors(1, 2, (name, "grow"))
    for scale in (None, d ** -0.5 / 16):
        check(q, k, v, scales, causal=causal, scale=scale, instance=name)


@pytest.mark.parametrize("d", fam.FP8_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_registry_picks_an_fp8_instance(d, causal):
    _sm90()
    _instance(d, causal)
    q, k, v = make_fp8(2, 4, 2, 300, 513, d, ("pick", d, causal))
    for alignment in ("top_left", "bottom_right") if causal else ("top_left",):
        problem = calls.problem_for(q, k, causal, v=v, causal_alignment=alignment)
        name = selection.select(problem).name
        assert "_fp8_" in name
        # The public questions give the same answer.
        assert gemmgen.selected_instance(q, k, v, causal=causal, causal_alignment=alignment) == name
        assert gemmgen.explain(q, k, v, causal=causal, causal_alignment=alignment).winner.name == name
        check(q, k, v, factors(2, 2, ("pick", d, causal)), causal=causal, alignment=alignment)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_bnhd_storage_gqa_mqa(hkv, causal):
    """[B, N, H, d] storage passed as transpose(1, 2) views, 8 query heads on 2 or 1 K/V heads: O
    comes back in q's layout."""
    _sm90()
    _instance(128, causal)
    key = ("bnhd", hkv, causal)
    q = e4m3((2, 200, 8, 128), (key, "q")).transpose(1, 2)
    k, v = (e4m3((2, 256, hkv, 128), (key, name)).transpose(1, 2) for name in ("k", "v"))
    for alignment in ("top_left", "bottom_right") if causal else ("top_left",):
        o = check(q, k, v, factors(2, hkv, key), causal=causal, alignment=alignment)
        assert o.stride() == q.stride() and o.stride(2) == 8 * 128


def test_strided_views():
    """q a slice of a wider last dim (row stride 2d, O then packed in q's dim order), K and V halves
    of one [B, N, Hkv, 2d] buffer."""
    _sm90()
    _instance(64, False)
    q = e4m3((2, 4, 129, 128), "slice-q")[..., :64]
    kv = e4m3((2, 300, 2, 128), "slice-kv")
    k, v = kv[..., :64].transpose(1, 2), kv[..., 64:].transpose(1, 2)
    o = check(q, k, v, factors(2, 2, "slice"))
    assert o.is_contiguous()


def test_inputs_quantized_per_head():
    """The caller's usual quantization: float inputs, each (batch, K/V head) group stored at the
    factor amax / 448 (q over the query heads of its K/V head), then attended to with those
    factors."""
    _sm90()
    _instance(128, True)
    b, h, hkv, n, d = 2, 8, 2, 1000, 128
    group = h // hkv
    x = [randn((b, heads, n, d), torch.float32, ("quantized", name)) for heads, name in ((h, "q"), (hkv, "k"),
                                                                                         (hkv, "v"))]
    stored, scales = [], []
    for t in x:
        grouped = t.reshape(b, hkv, -1)  # q's query heads of one K/V head are adjacent
        s = grouped.abs().amax(dim=-1) / 448.0
        rep = group if t.shape[1] == h else 1
        stored.append((t / s.repeat_interleave(rep, dim=1)[:, :, None, None]).to(FP8))
        scales.append(s.float().contiguous())
    for causal in (False, True):
        check(*stored, tuple(scales), causal=causal)


FORMS = ["none", "float", "scalar-tensor", "per-kv-head", "per-batch-and-kv-head", "per-batch", "mixed"]


@pytest.mark.parametrize("form", FORMS)
def test_descale_forms(form):
    """Each form of the factors (None, a float, a tensor broadcasting to [B, Hkv]) against the
    reference of the inputs dequantized by the same factors, at the default scale and 0.3."""
    _sm90()
    _instance(128, False)
    b, hkv = 2, 2
    q, k, v = make_fp8(b, 4, hkv, 1024, 1024, 128, ("forms", form))
    shapes = {"scalar-tensor": (), "per-kv-head": (hkv,), "per-batch-and-kv-head": (b, hkv), "per-batch": (b, 1)}
    if form == "none":
        scales = NO_FACTORS
    elif form == "float":
        scales = (0.5, 1.75, 0.3)
    elif form == "mixed":
        scales = (0.5, None, uniform((hkv,), ("forms", "mixed")))
    else:
        scales = tuple(uniform(shapes[form], ("forms", form, i)) for i in range(3))
    for scale in (None, 0.3):
        check(q, k, v, scales, scale=scale)


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_non_positive_factors_give_nan_rows(causal):
    """A q_descale * k_descale product that is not positive (a 0 or a negative entry) turns that
    (batch, K/V head)'s query heads into NaN rows, written by the kernel (O poisoned with inf
    here); the other heads are right."""
    _sm90()
    name = _instance(128, causal)
    b, h, hkv = 2, 8, 4
    group = h // hkv
    q, k, v = make_fp8(b, h, hkv, 300, 300, 128, ("nan rows", causal))
    qd, kd, vd = factors(b, hkv, ("nan rows", causal))
    qd[1, 0] = 0.0
    kd[0, 3] = -0.5
    o, lse = attend(q, k, v, (qd, kd, vd), poison=float("inf"), causal=causal, instance=name)
    bad = torch.zeros(b, h, dtype=torch.bool, device=o.device)
    bad[1, :group] = True
    bad[0, 3 * group:] = True
    assert torch.isnan(o[bad]).all()
    good = o[~bad]
    assert torch.isfinite(good).all()
    ref_o, ref_lse = attention_reference(*dequantized(q, k, v, (qd, kd, vd)), causal)
    err = rel_err(good, ref_o[~bad])
    assert err <= FP8_TOLERANCE, f"relative error {err:.3e}"
    lse_ref = ref_lse[~bad]
    assert (lse[~bad].double() - lse_ref).abs().max().item() <= max(LSE_TOLERANCE, LSE_RTOL * lse_ref.abs().max().item())


def test_empty_sizes():
    """No keys: O exactly 0 and LSE -inf (causal too); no batch or no queries: an empty O. Neither
    launches a kernel."""
    q, k, v = make_fp8(2, 4, 2, 17, 0, 64, "empty")
    for causal in (False, True):
        o, lse = gemmgen.fused_attention(q, k, v, causal=causal, return_lse=True, q_descale=0.5,
                                         v_descale=torch.ones(2, device="cuda"))
        assert o.dtype == BF16 and o.shape == q.shape
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all() and lse.shape == (2, 4, 17)
    for shape in ((0, 4, 2, 17, 17, 64), (2, 4, 2, 0, 17, 128)):
        q, k, v = make_fp8(*shape, ("empty", shape))
        o, lse = gemmgen.fused_attention(q, k, v, return_lse=True)
        assert o.dtype == BF16 and o.shape == q.shape and o.numel() == 0 and lse.shape == q.shape[:3]


def test_torch_compile_matches_eager():
    """torch.compile(fullgraph=True) of a function calling fused_attention on fp8 inputs (the factors
    as tensors and as a float) gives eager's O exactly."""
    _sm90()
    _instance(128, True)
    q, k, v = make_fp8(2, 4, 2, 300, 300, 128, "compile")
    qd, kd, _ = factors(2, 2, "compile")

    def f(q, k, v, qd, kd):
        o, lse = gemmgen.fused_attention(q, k, v, causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                                         v_descale=0.5)
        return o, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    o, lse = compiled(q, k, v, qd, kd)
    want_o, want_lse = f(q, k, v, qd, kd)
    assert o.dtype == BF16 and torch.equal(o, want_o) and torch.equal(lse, want_lse)
    q2, k2, v2 = make_fp8(2, 4, 2, 300, 300, 128, "compile-2")
    assert torch.equal(compiled(q2, k2, v2, kd, qd)[0], f(q2, k2, v2, kd, qd)[0])


def test_cuda_graph_replays_with_new_inputs():
    """A captured call (V's transposed copy and the broadcast factors' copies inside the graph)
    replayed after new values are copied into its inputs and factors gives an eager call's O."""
    _sm90()
    _instance(128, False)
    q, k, v = make_fp8(2, 4, 2, 300, 300, 128, "graph")
    qd, kd, vd = uniform((2, 2), "graph-q"), uniform((2,), "graph-k"), uniform((), "graph-v")
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # selection and loading outside the capture
        gemmgen.fused_attention(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = gemmgen.fused_attention(q, k, v, **kw)
    new = (*make_fp8(2, 4, 2, 300, 300, 128, "graph-2"), uniform((2, 2), "graph-q2"), uniform((2,), "graph-k2"),
           uniform((), "graph-v2"))
    for t, values in zip((q, k, v, qd, kd, vd), new):
        t.copy_(values)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, gemmgen.fused_attention(q, k, v, **kw))
    ref_o, _ = attention_reference(*dequantized(q, k, v, (qd, kd, vd)))
    assert rel_err(o, ref_o) <= FP8_TOLERANCE


def test_inputs_that_require_grad_raise():
    """No backward: fp8 inputs that require grad raise InputError; under no_grad the call runs."""
    _sm90()
    _instance(64, False)
    q, k, v = make_fp8(1, 2, 2, 64, 64, 64, "grad")
    want = gemmgen.fused_attention(q, k, v)
    for which in range(3):
        args = [q, k, v]
        args[which] = args[which].detach().requires_grad_()
        with pytest.raises(InputError, match="fp8 attention has no backward"):
            gemmgen.fused_attention(*args)
        with torch.no_grad():
            assert torch.equal(gemmgen.fused_attention(*args), want)


def test_refused_calls_raise():
    """Causal with Nq > Nk (rows that see no key under bottom-right, or every key under top-left)
    has no fp8 instance: forcing one names the reason; a 16-bit instance refuses fp8 inputs."""
    _sm90()
    name = _instance(128, True)
    q, k, v = make_fp8(1, 2, 2, 128, 64, 128, "refused")
    for alignment in ("top_left", "bottom_right"):
        with pytest.raises(NoInstanceError, match="seqlen_q <= seqlen_k"):
            gemmgen.fused_attention(q, k, v, causal=True, causal_alignment=alignment, instance=name)
    sixteen = [c.name for c in registry.load()[0] if c.entry.family == "fmha_sm90" and c.entry.state == "built"
               and c.entry.params.get("dtype") == "bf16" and c.entry.params.get("head_dim") == 128
               and c.entry.params.get("mask") == "none"]
    if sixteen:
        with pytest.raises(NoInstanceError, match="dtype bf16, the problem is fp8"):
            gemmgen.fused_attention(q, k, v, instance=sixteen[0])
