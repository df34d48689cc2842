"""Packed sequences on the Hopper families on the GPU: every built instance that runs them (fmha_sm90's
persistent forward instances, fmha_bwd_sm90's split-dQ backward ones), forced by name into
NaN-poisoned outputs, against the float64 reference of each sequence alone; then
fused_attention_varlen end to end, which picks fmha_sm90 where every sequence is within its contract
and fa2_sm80 where one is not, and trains on both Hopper families. Lengths 0, 1, 17, 127, 129, 1000 and
4097, Nq != Nk per sequence, a row tile reaching past a sequence's end into the next one, GQA 4:1,
MQA and head-major storage. Needs `gemmgen generate --arch sm80 --arch sm90` (sm90 only for the
instance test)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.select import calls, selection

from gemmgen.ops.checks import check_window

from test_attention_bwd_gpu import assert_close, offsets
from test_varlen_fa2_gpu import MASKS as FA2_MASKS, WINDOWS as FA2_WINDOWS
from test_varlen_fa2_gpu import (built, candidate, check_backward_instance, check_lse, forward_into_poison, make,
                                 per_sequence)

pytestmark = pytest.mark.gpu

# Within the contract: every sequence with queries has keys; causal ones at least as many keys as
# queries (the second list). Without a mask also fewer keys than queries.
LENS_Q = [0, 1, 17, 5, 127, 129, 1000, 300, 64]
LENS_K_NONE = [9, 1, 17, 1, 129, 127, 77, 4097, 64]
LENS_K_CAUSAL = [9, 1, 40, 5, 129, 129, 1000, 4097, 64]
CASES = [(False, "top_left", LENS_K_NONE), (True, "top_left", LENS_K_CAUSAL), (True, "bottom_right", LENS_K_CAUSAL)]



# Sliding windows on the local instances: every sequence's diagonal holds a key (LENS_K_CAUSAL), in
# both alignments; sides bounded, unbounded on one side, and a window of the diagonal alone.
WINDOW_CASES = [("top_left", (40, 7)), ("bottom_right", (100, 0)), ("bottom_right", (-1, 30)), ("top_left", (0, 0))]


@pytest.mark.parametrize("name", [n for n in built("fmha_sm90") if "_local_" in n] or ["(none built)"])
def test_local_instance_on_packed_sequences(name):
    """A window within each packed sequence, around its own diagonal (bottom-right: len_k - len_q)."""
    cand = candidate(name)
    inst = cand.instance
    if not inst.runs_varlen:
        pytest.skip(f"{name}: no packed sequences with a window on 256-row tiles")
    dtype = launch.TORCH_DTYPES[inst.dtype.value]
    lens = (LENS_Q, LENS_K_CAUSAL)
    for (alignment, window), (h, hkv, layout) in zip(WINDOW_CASES, [(4, 1, "packed"), (8, 2, "head_major"),
                                                                   (4, 4, "packed"), (2, 2, "head_major")]):
        label = f"{name} window={window}/{alignment} {h}:{hkv} {layout}"
        q, k, v, _ = make(h, hkv, inst.head_dim, dtype, (name, alignment, window, layout), layout, lens=lens)
        o, lse = forward_into_poison(cand, q, k, v, causal=False, alignment=alignment, window=window, lens=lens)
        want_o, want_lse = per_sequence(q, k, v, causal=False, alignment=alignment, window=window, lens=lens)
        assert_close(f"{label} O", o, want_o, dtype)
        check_lse(label, lse, want_lse)
    # The public call's pick for such offsets: this family's local instance (where built, it is the default).
    problem = calls.problem_for_varlen(q, k, v, len(LENS_Q), max(LENS_Q), max(LENS_K_CAUSAL), False,
                                       causal_alignment="bottom_right", window=(100, 0), short_keys=False)
    assert selection.select(problem).entry.family == "fmha_sm90"
    o = gemmgen.fused_attention_varlen(q, k, v, offsets(LENS_Q), offsets(LENS_K_CAUSAL), max(LENS_Q),
                                       max(LENS_K_CAUSAL), causal_alignment="bottom_right", window=(100, 0))
    want_o, _ = per_sequence(q, k, v, causal=False, alignment="bottom_right", window=(100, 0), lens=lens)
    assert_close(f"{name} public call O", o, want_o, dtype)


@pytest.mark.parametrize("name", [n for n in built("fmha_sm90") if "_local_" not in n and "_fp8_" not in n] or ["(none built)"])
def test_instance_on_packed_sequences(name):
    cand = candidate(name)
    inst = cand.instance
    if not inst.runs_varlen:
        pytest.skip(f"{name} is not persistent: no packed sequences")
    dtype = launch.TORCH_DTYPES[inst.dtype.value]
    cases = [c for c in CASES if c[0] == inst.causal]
    for (causal, alignment, lens_k), (h, hkv, layout) in zip(cases * 2, [(4, 1, "packed"), (8, 2, "head_major"),
                                                                       (4, 4, "packed"), (2, 2, "head_major")]):
        lens = (LENS_Q, lens_k)
        label = f"{name} causal={causal}/{alignment} {h}:{hkv} {layout}"
        q, k, v, _ = make(h, hkv, inst.head_dim, dtype, (name, alignment, h, layout), layout, lens=lens)
        scale = 0.3 if h == 8 else None
        softcap = 5.0 if inst.softcap else 0.0  # (`_sc` instances run capped calls only; 5 bites at N(0, 1) scores)
        o, lse = forward_into_poison(cand, q, k, v, causal=causal, alignment=alignment, scale=scale, lens=lens,
                                     softcap=softcap)
        want_o, want_lse = per_sequence(q, k, v, causal=causal, alignment=alignment, scale=scale, lens=lens,
                                        softcap=softcap)
        assert_close(f"{label} O", o, want_o, dtype)
        check_lse(label, lse, want_lse)


@pytest.mark.parametrize("causal, alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_fused_attention_varlen_picks_hopper_within_the_contract(causal, alignment):
    """The public call: fmha_sm90 for offsets within its contract, fa2_sm80 once a sequence falls
    outside it (fewer keys than queries under a causal mask, or none); both against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fmha_sm90 runs on sm_90 only")
    dtype = torch.bfloat16
    for lens_k, family in (((LENS_K_CAUSAL if causal else LENS_K_NONE), "fmha_sm90"),
                           ([9, 1, 17, 0, 129, 127, 77, 4097, 64], "fa2_sm80")):
        lens = (LENS_Q, lens_k)
        q, k, v, _ = make(8, 2, 128, dtype, ("public", causal, alignment, family), "packed", lens=lens)
        cu_q, cu_k = offsets(LENS_Q), offsets(lens_k)
        short = any(lq > 0 and (lk == 0 or (causal and lk < lq)) for lq, lk in zip(*lens))
        problem = calls.problem_for_varlen(q, k, v, len(LENS_Q), max(LENS_Q), max(lens_k), causal,
                                           causal_alignment=alignment, short_keys=short)
        picked = selection.select(problem).entry.family
        if picked != family and family == "fmha_sm90":
            pytest.skip(f"the registry picks {picked}: build fmha_sm90 (gemmgen generate --arch sm90)")
        assert picked == family, f"lengths {lens_k}: picked {picked}, want {family}"
        o, lse = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(lens_k), causal=causal,
                                                causal_alignment=alignment, return_lse=True)
        want_o, want_lse = per_sequence(q, k, v, causal=causal, alignment=alignment, lens=lens)
        assert_close(f"{family} {alignment} O", o, want_o, dtype)
        check_lse(f"{family} {alignment}", lse, want_lse)


def mask_of(causal, window) -> str:
    causal, window = check_window(window, causal)  # as fused_attention_varlen normalizes them
    return "local" if window is not None else "causal" if causal else "none"


@pytest.mark.parametrize("name", [n for n in built("fmha_bwd_sm90") if "_sq" in n] or ["(none built)"])
def test_backward_instance_on_packed_sequences(name):
    """fmha_bwd_sm90's split-dQ instances on packed sequences (one batch entry over the packed
    tensors, each key masked to its own sequence's rows): test_varlen_fa2_gpu's lengths (sequences
    without queries or keys, fewer keys than queries), the instance's mask in both alignments,
    windows on the local ones, GQA read at K's own heads, head-major storage."""
    inst = candidate(name).instance
    cases = [c for c in FA2_MASKS + FA2_WINDOWS if mask_of(c[0], c[2]) == inst.mask.value]
    check_backward_instance(name, cases * 2)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_training_picks_hopper_both_ways(alignment):
    """fused_attention_varlen with autograd on Hopper: fmha_sm90 forward and fmha_bwd_sm90 backward
    (causal, GQA 4:1), gradients against float64 in the inputs' layouts."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper families run on sm_90 only")
    dtype, lens = torch.bfloat16, (LENS_Q, LENS_K_CAUSAL)
    q, k, v, do = make(8, 2, 128, dtype, ("train", alignment), "head_major", lens=lens)
    k_heads = torch.empty((k.shape[0], q.shape[1], k.shape[2]), dtype=dtype, device="cuda")  # as the selection sees K
    bwd = calls.problem_for_bwd_varlen(q, k_heads, len(LENS_Q), max(LENS_Q), max(LENS_K_CAUSAL), True,
                                       causal_alignment=alignment)
    picked = selection.select(bwd).entry.family
    if picked != "fmha_bwd_sm90":
        pytest.skip(f"the registry picks {picked}: build fmha_bwd_sm90 (gemmgen generate --arch sm90)")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = gemmgen.fused_attention_varlen(*leaves, offsets(LENS_Q), offsets(LENS_K_CAUSAL), max(LENS_Q),
                                       max(LENS_K_CAUSAL), causal=True, causal_alignment=alignment)
    o.backward(do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_o, _ = per_sequence(*ref, causal=True, alignment=alignment, lens=lens)
    want = torch.autograd.grad(want_o, ref, do.double(), materialize_grads=True)
    assert_close(f"{alignment} O", o, want_o, dtype)
    for name, g, w, x in zip(("dQ", "dK", "dV"), (t.grad for t in leaves), want, (q, k, v)):
        assert_close(f"{alignment} {name}", g, w, dtype)
        assert g.stride() == x.stride(), f"{name} is not in its input's layout"
