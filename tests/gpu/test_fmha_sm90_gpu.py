"""The fmha_sm90 family (CUTLASS's Hopper FMHA) on an sm_90 GPU against the float64 reference: every
built instance (but the sliding-window ones: test_window_gpu.py) forced by name on the lengths it accepts, then one instance per dtype through
layouts, strides, GQA, scales and big batch counts. Needs `gemmgen generate --arch sm90`."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.select import calls, registry
from gemmgen.errors import NoInstanceError
from gemmgen.generator.families import fmha_sm90 as fam

from test_fused_attention import check, make_qkv, randn

pytestmark = pytest.mark.gpu


def _built() -> list[str]:
    """The built 16-bit instances of the no-mask and causal masks without a softcap, an additive mask
    or dropout (tests/gpu/test_window_gpu.py runs the sliding-window ones, tests/gpu/test_fp8_gpu.py
    the fp8 ones, tests/gpu/test_softcap_gpu.py the `_sc` ones, tests/gpu/test_bias_fmha_sm90_gpu.py
    the `_bias` ones, tests/gpu/test_dropout_hopper_gpu.py the `_dropout` ones)."""
    try:
        return sorted(c.name for c in registry.load()[0]
                      if c.entry.family == "fmha_sm90" and c.entry.state == "built"
                      and c.entry.params.get("mask") != "local" and c.entry.params.get("dtype") != "fp8"
                      and not c.entry.params.get("softcap") and not c.entry.params.get("bias")
                      and not c.entry.params.get("dropout"))
    except Exception:  # no manifest: the tests below skip
        return []


BUILT = _built()
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# In the last row tile of a head, the persistent schedule's consumer groups with no rows skip their
# math (17 and 4097 rows leave whole 64-row groups empty at block_m 128, 192 and 256; 1000 at 192).
LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (128, 1000), (1000, 1000), (1000, 17), (4097, 4097),
           (1, 300), (17, 4097), (1000, 4097), (200, 256)]


def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if not BUILT:
        pytest.skip("no fmha_sm90 instance built (gemmgen generate --arch sm90)")


def _entry(name: str):
    return next(c.entry for c in registry.load()[0] if c.name == name)


@pytest.mark.parametrize("name", BUILT or ["none"])
def test_every_instance(name):
    _sm90()
    p = _entry(name).params
    dtype, d, causal = DTYPES[p["dtype"]], p["head_dim"], p["mask"] == "causal"
    ran = 0
    for nq, nk in LENGTHS:
        q, k, v = make_qkv(1 if max(nq, nk) > 1000 else 2, 3, 3, nq, nk, d, dtype, (name, nq, nk))
        # Causal instances run both alignments: bottom-right (chunked prefill) where Nq < Nk.
        for alignment in ("top_left", "bottom_right") if causal else ("top_left",):
            problem = calls.problem_for(q, k, causal, v=v, causal_alignment=alignment)
            if registry.functional_reason(fam, fam.INSTANCE.from_params(p), problem) is not None:
                continue  # a call the instance refuses: the registry never sends it there
            check(q, k, v, causal=causal, alignment=alignment, instance=name)
            ran += 1
    assert ran >= (14 if causal else 10)
    # More row tiles (8 x 64 for block_m 128) than the H200's 132 SMs: each CTA of the persistent
    # schedule runs several, cycling its Q and K/V buffers.
    q, k, v = make_qkv(4, 16, 16, 1000, 1000, d, dtype, (name, "many tiles"))
    check(q, k, v, causal=causal, instance=name)


@pytest.mark.parametrize("name", BUILT or ["none"])
def test_row_maxima_that_grow(name):
    """Keys scaled by a ramp, so that each row's maximum keeps rising over the key tiles: at the
    default scale by a little per tile (the `_lr` softmax then takes probabilities of up to 2^8
    against a lagging maximum, and rescales O once it lags by more), at scale 1 by more than 2^8 at
    most tiles (a rescale at most tiles)."""
    _sm90()
    p = _entry(name).params
    dtype, d, causal = DTYPES[p["dtype"]], p["head_dim"], p["mask"] == "causal"
    q, k, v = make_qkv(1, 2, 2, 300, 1000, d, dtype, (name, "grow"))
    ramp = torch.linspace(0.5, 4.0, k.shape[2], device="cuda")[:, None]
    k = (k.float() * ramp).to(dtype)
    for scale in (None, 1.0):
        check(q, k, v, causal=causal, scale=scale, instance=name)


def _instance(dtype: str, d: int, causal: bool) -> str:
    names = [n for n in BUILT if n.startswith(f"fmha_sm90_{dtype}_d{d}_{'causal' if causal else 'none'}_")]
    if not names:
        pytest.skip(f"no fmha_sm90 {dtype} d{d} instance built")
    return names[0]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_bnhd_and_strided_views(dtype, causal):
    _sm90()
    name = _instance(dtype, 128, causal)
    t = DTYPES[dtype]
    q, k, v = (randn((2, n, 4, 128), t, ("bnhd", n, dtype)).transpose(1, 2) for n in (200, 256, 256))
    o = check(q, k, v, causal=causal, instance=name)
    assert o.stride() == q.stride()
    qq = randn((2, 3, 136, 256), t, ("slice-q", dtype))[..., :128]
    kv = randn((2, 264, 3, 256), t, ("slice-kv", dtype))
    check(qq, kv[..., :128].transpose(1, 2), kv[..., 128:].transpose(1, 2), causal=causal, instance=name)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_gqa_mqa(hkv, causal):
    _sm90()
    q, k, v = make_qkv(2, 8, hkv, 136, 300, 128, torch.bfloat16, ("gqa90", hkv, causal))
    check(q, k, v, causal=causal, instance=_instance("bf16", 128, causal))


@pytest.mark.parametrize("scale", [0.3, 0.0, 2.0])
def test_scale(scale):
    _sm90()
    q, k, v = make_qkv(2, 3, 3, 136, 200, 64, torch.float16, ("scale90", scale))
    check(q, k, v, causal=True, scale=scale, instance=_instance("fp16", 64, True))


def test_batch_beyond_grid_limit():
    _sm90()
    q, k, v = make_qkv(70000, 1, 1, 8, 8, 64, torch.bfloat16, "bigbatch90")
    check(q, k, v, instance=_instance("bf16", 64, False))


def test_refused_calls_go_elsewhere():
    """A negative scale, or causal with Nq > Nk (rows that see no key under bottom-right, or every key
    under top-left), never selects fmha_sm90, and forcing it is an error naming the reason."""
    _sm90()
    q, k, v = make_qkv(1, 2, 2, 128, 64, 128, torch.bfloat16, "refused")
    for kw in (dict(scale=-0.5), dict(causal=True, causal_alignment="bottom_right"), dict(causal=True)):
        causal = kw.get("causal", False)
        problem = calls.problem_for(q, k, causal, v=v, causal_alignment=kw.get("causal_alignment", "top_left"),
                                     scale=kw.get("scale"))
        good = [c.name for c in registry.candidates(problem)[0]]
        assert not any(n.startswith("fmha_sm90") for n in good)
        with pytest.raises(NoInstanceError):
            gemmgen.fused_attention(q, k, v, instance=_instance("bf16", 128, causal), **kw)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_tuner_timing_relaunches_params(graph):
    """The tuner launches one prepared params object many times, per call and replayed from a CUDA
    graph. fmha_sm90 always writes LSE: launch() must not leave a per-call scratch buffer in the
    caller's params, or later calls (and graph replays) write LSE into freed memory."""
    _sm90()
    from gemmgen.select import tuner
    from gemmgen.select.shapes import Shape

    shape = Shape(2, 4, 300, 300, 64, causal=False, dtype="fp16")
    cands = [c for c in registry.candidates(tuner.problem_of(shape, 0))[0] if c.entry.family == "fmha_sm90"]
    if not cands:
        pytest.skip("no fmha_sm90 fp16 d64 instance built")
    result = tuner.measure(cands[:2], shape, index=0, reps=3, graph=graph)
    torch.cuda.synchronize()
    assert result and all(m.ok for m in result), [(m.name, m.reason) for m in result]
    q, k, v = make_qkv(2, 4, 4, 300, 300, 64, torch.float16, "relaunch")
    o = torch.full_like(q, float("nan"))
    p = launch.params(q, k, v, o, None, causal=False, causal_alignment="top_left", scale=None)
    launch.launch(cands[0].kernel, p, 0)
    assert not p.lse  # the scratch buffer went to a copy
    launch.launch(cands[0].kernel, p, 0)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
