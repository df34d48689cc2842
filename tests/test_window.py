"""Sliding windows (local attention) without a GPU: the argument's rules, the reference's mask, the
problem and the registry's reasons, the local instances of fa2_sm80 and fmha_sm90 and their source,
and the C ABI params."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import gemmgen
from gemmgen.generator import render
from gemmgen.generator.families import fa2_sm80, fmha_sm90, mea_sm80
from gemmgen.generator.families.base import DType, Mask
from gemmgen.kernels import abi, launch
from gemmgen.ops.checks import check_window
from gemmgen.ops.reference import attention_reference
from gemmgen.select import device, registry
from gemmgen.select.problem import BwdProblem, Problem

from conftest import make_entry, write_build_dir

H100 = device.synthetic((9, 0), 132, "NVIDIA H100 80GB HBM3")
TC = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")


@pytest.mark.parametrize("window, causal, expected", [
    (None, False, (False, None)),
    ((-1, -1), False, (False, None)),  # unbounded both sides: no mask
    ((-1, 0), False, (True, None)),  # the causal mask, which has instances of its own
    ((-1, -1), True, (True, None)),
    ((16, 0), False, (False, (16, 0))),
    ((16, -1), True, (False, (16, 0))),  # causal bounds the right side at the diagonal
    ([0, 0], False, (False, (0, 0))),
    ((-1, 7), False, (False, (-1, 7))),
])
def test_window_normalized(window, causal, expected):
    assert check_window(window, causal) == expected


@pytest.mark.parametrize("window, causal, words", [
    ((3,), False, "pair of ints"),
    ((1.0, 2), False, "pair of ints"),
    ((True, 2), False, "pair of ints"),
    ("16,0", False, "pair of ints"),
    ((-2, 0), False, "-1 \\(unbounded\\) or in"),
    ((4, 2**31), False, "-1 \\(unbounded\\) or in"),
    ((16, 4), True, "right side must be 0 or -1"),
])
def test_bad_windows_raise(window, causal, words):
    with pytest.raises(gemmgen.InputError, match=words):
        check_window(window, causal)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window, causal", [((3, 2), False), ((0, 0), False), ((-1, 4), False), ((5, -1), False),
                                            ((2, 0), True)])
def test_reference_window_is_the_rule(window, causal, alignment):
    """The reference's window equals the rule written out pair by pair (rows 7 of keys 11 and the
    reverse, so that the offset is non-zero both ways)."""
    for nq, nk in ((7, 11), (11, 7)):
        q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (nq, nk, nk))
        o, lse = attention_reference(q, k, v, causal, alignment, window=window)
        off = 0 if alignment == "top_left" else nk - nq
        left, right = window
        seen = torch.tensor([[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                              and (not causal or j <= i + off) for j in range(nk)] for i in range(nq)])
        bias = torch.zeros(nq, nk, dtype=torch.float64).masked_fill(~seen, float("-inf"))
        ref_o, ref_lse = attention_reference(q, k, v, bias=bias)
        assert torch.allclose(o, ref_o) and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def _problem(**kw) -> Problem:
    base = dict(dtype="bf16", head_dim=128, causal=False, device=H100, batch_heads=32, seqlen_q=2048,
                seqlen_k=2048, window=(256, 0))
    return Problem(**{**base, **kw})


def test_problem_mask_key_and_description():
    p = _problem(causal_alignment="bottom_right")
    assert p.mask == "local" and p.functional_key == "bf16_d128_local_a16"
    assert "sliding window (256, 0), bottom_right" in p.describe()
    assert _problem(window=None).mask == "none" and _problem(window=None, causal=True).mask == "causal"


def test_registry_sends_windows_to_local_instances_only(tmp_path):
    """Local instances run a window; the other masks' instances, the families that serve several
    masks per instance (mea_sm80) and every backward family refuse it, each with its reason."""
    fa2 = [i for i in fa2_sm80.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    sm90 = [i for i in fmha_sm90.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    mea = [i for i in mea_sm80.DEFAULT if i.dtype is DType.BF16 and i.max_head_dim == 128][:1]
    entries = [make_entry(i) for i in fa2 + mea]
    entries += [dataclasses.replace(make_entry(i), gencode=["-gencode=arch=compute_90a,code=sm_90a"]) for i in sm90]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    try:
        good, rejected = registry.candidates(_problem())
        assert {c.name for c in good} == {i.name for i in fa2 + sm90 if i.mask is Mask.LOCAL
                                          and not getattr(i, "softcap", False)}
        reasons = dict(rejected)
        assert any("built for a logit softcap" in r for r in reasons.values())
        assert any("mask none, the problem needs local" in r for r in reasons.values())
        assert any(mea[0].name in label and "has no sliding window" in r for label, r in rejected)
        # fmha_sm90's window needs every row's diagonal key: Nq <= Nk.
        good, rejected = registry.candidates(_problem(seqlen_q=3000))
        assert {c.name for c in good} == {i.name for i in fa2 if i.mask is Mask.LOCAL and not i.softcap}
        assert any("local needs seqlen_q <= seqlen_k" in r for _, r in rejected)
        # The registry's winner on Hopper: fmha_sm90's local instance.
        from gemmgen.select import selection
        assert "fmha_sm90_bf16_d128_local" in selection.select(_problem()).name
        bwd = BwdProblem(**{f.name: getattr(_problem(), f.name) for f in dataclasses.fields(Problem)})
        with pytest.raises(gemmgen.NoInstanceError):
            selection.select(bwd)
    finally:
        registry.set_build_dirs(None)


def test_local_instances_and_their_source():
    fa2_local = [i for i in fa2_sm80.DEFAULT if i.mask is Mask.LOCAL]
    assert {(i.dtype, i.head_dim) for i in fa2_local} == {(dt, d) for dt in fa2_sm80.DTYPES for d in fa2_sm80.HEAD_DIMS}
    text = render.render_text(fa2_local[0], TC)
    assert "constexpr bool kCausal = false;" in text and "constexpr bool kLocal = true;" in text
    assert "run<Traits, kCausal, kLocal, kSoftcap>(" in text and "constexpr bool kSoftcap = false;" in text
    sm90_local = [i for i in fmha_sm90.DEFAULT if i.mask is Mask.LOCAL]
    assert {(i.dtype, i.head_dim) for i in sm90_local} == {(dt, d) for dt in fmha_sm90.DTYPES if dt.itemsize == 2
                                                           for d in fmha_sm90.HEAD_DIMS}  # (fp8: no window)
    assert all(i.persistent and not i.speculates for i in sm90_local)
    text = render.render_text(next(i for i in sm90_local if i.head_dim == 128), TC)
    assert "/*Causal=*/false" in text and "/*Speculate=*/false,\n" in text and "/*Local=*/true,\n" in text
    assert "/*Softcap=*/false,\n" in text and "/*Bias=*/false,\n" in text
    coop = dataclasses.replace(sm90_local[0], schedule=fmha_sm90.Schedule.COOPERATIVE, block_m=128, block_n=64)
    assert "persistent schedule" in fmha_sm90.invalid_reason(coop)


def test_params_carry_the_window():
    """The C ABI fields: local set with both sides, the offset of the alignment; zero otherwise
    (a library built before the fields existed never reads them)."""
    names = [n for n, _ in abi.AttnParams._fields_]
    assert names[names.index("local"):names.index("local") + 3] == ["local", "window_left", "window_right"]
    q = torch.empty(1, 2, 5, 64, dtype=torch.float16)
    k = torch.empty(1, 2, 9, 64, dtype=torch.float16)
    p = launch.params(q, k, k, q, None, causal=False, causal_alignment="bottom_right", scale=None, window=(3, -1))
    assert (p.local, p.window_left, p.window_right, p.causal_offset) == (1, 3, -1, 4)
    p = launch.params(q, k, k, q, None, causal=False, causal_alignment="top_left", scale=None)
    assert (p.local, p.window_left, p.window_right, p.causal_offset) == (0, 0, 0, launch.NO_MASK_OFFSET)


def test_cli_explain_takes_a_window(tmp_path, capsys):
    """`gemmgen explain --window LEFT,RIGHT` explains the local mask's decision; a bad value is an
    InputError naming the option."""
    from gemmgen.cli import app

    sm90 = [i for i in fmha_sm90.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    entries = [dataclasses.replace(make_entry(i), gencode=["-gencode=arch=compute_90a,code=sm_90a"]) for i in sm90]
    build = write_build_dir(tmp_path, entries)
    try:
        assert app.main(["explain", "--shape", "2,16,2048,128", "--window", "255,0", "--cc", "9.0", "--sms", "132",
                         "--build-dir", str(build)]) == 0
        out = capsys.readouterr().out
        assert "sliding window (255, 0)" in out and "fmha_sm90_bf16_d128_local_pingpong" in out
        assert app.main(["explain", "--shape", "2,16,2048,128", "--window", "255", "--cc", "9.0", "--sms", "132",
                         "--build-dir", str(build)]) != 0
        assert "--window '255'" in capsys.readouterr().err
    finally:
        registry.set_build_dirs(None)


def test_cost_model_counts_the_window_tiles():
    """The heuristic's estimate reads only the key tiles a window's row tiles read: a 256-key window
    over 8192 keys (three 128-key tiles per 128-row tile) about 3/64 of the full row, and a window as
    wide as the keys as much."""
    from gemmgen.select import heuristic

    inst = next(i for i in fmha_sm90.DEFAULT if i.mask is Mask.LOCAL and i.head_dim == 128 and i.dtype is DType.BF16)
    full = heuristic.estimate(inst, _problem(seqlen_q=8192, seqlen_k=8192, window=(-1, -1 + 8192)))
    narrow = heuristic.estimate(inst, _problem(seqlen_q=8192, seqlen_k=8192, window=(255, 0)))
    assert 0.04 < narrow.time / full.time < 0.06
    wide = heuristic.estimate(inst, _problem(seqlen_q=8192, seqlen_k=8192, window=(8191, 8191)))
    assert wide.time == full.time


def test_the_ops_normalize_their_window_argument():
    """torch.ops.gemmgen.* called directly (a window is a list through the dispatcher) run the mask
    gemmgen.fused_attention would: the same normalization and errors."""
    from gemmgen.ops import torch_op

    assert torch_op._mask_args(False, [-1, 0]) == (True, None)
    assert torch_op._mask_args(False, [-1, -1]) == (False, None)
    assert torch_op._mask_args(True, [16, -1]) == (False, (16, 0))
    assert torch_op._mask_args(False, None) == (False, None)
    with pytest.raises(gemmgen.InputError, match="right side must be 0 or -1"):
        torch_op._mask_args(True, [16, 8])


def test_decode_family_runs_windows_from_builds_that_read_them(tmp_path):
    """decode_sm80's instances serve no mask, causal and windows (SLIDING_WINDOW); an entry built
    before its kernel read the window fields (no "window" in its params) is refused a window with
    that reason, and still runs calls without one. The split plan counts only the window's keys."""
    from gemmgen.generator.families import decode_sm80
    from gemmgen.select import heuristic

    insts = [i for i in decode_sm80.DEFAULT if i.dtype is DType.BF16 and i.head_dim == 128]
    new = [make_entry(i) for i in insts]
    old = [dataclasses.replace(e, params={k: v for k, v in e.params.items() if k != "window"}) for e in new]
    decode = _problem(seqlen_q=1, seqlen_k=65536, causal_alignment="bottom_right", gqa=4, window=(4095, 0))
    for entries, ok in ((new, True), (old, False)):
        registry.set_build_dirs([write_build_dir(tmp_path / str(ok), entries)])
        try:
            good, rejected = registry.candidates(decode)
            assert bool(good) is ok, rejected
            if not ok:
                assert all("built before its family ran sliding windows" in r for _, r in rejected)
                assert registry.candidates(dataclasses.replace(decode, window=None, causal=True))[0]
        finally:
            registry.set_build_dirs(None)
    full = dataclasses.replace(decode, window=None, causal=True)
    assert heuristic._keys_read(decode) == 4097 and heuristic._keys_read(full) == 65536
    assert heuristic.estimate(insts[0], decode).time < heuristic.estimate(insts[0], full).time / 2


def test_kvcache_params_carry_the_window_around_each_sequences_diagonal():
    """fused_attention_with_kvcache's params: the window's fields, and the diagonal's offset (capacity
    - Nq, which the decode kernel moves to each sequence's own length) whether or not causal."""
    q = torch.empty(2, 3, 8, 64, dtype=torch.float16)  # [B, Nq, H, d]
    cache = torch.empty(2, 100, 2, 64, dtype=torch.float16)
    lens = torch.zeros(2, dtype=torch.int32)
    p = launch.params_kvcache(q, cache, cache, lens, None, q, None, causal=False, scale=None, capacity=100,
                              window=(31, 2))
    assert (p.local, p.window_left, p.window_right, p.causal_offset, p.seqlen_k) == (1, 31, 2, 97, 100)
    p = launch.params_kvcache(q, cache, cache, lens, None, q, None, causal=False, scale=None, capacity=100)
    assert (p.local, p.causal_offset) == (0, launch.NO_MASK_OFFSET)
