"""Packed sequences on the Hopper families on the GPU: every built instance that runs them (fmha_sm90's
persistent forward instances, fmha_bwd_sm90's split-dQ backward ones), forced by name into
NaN-poisoned outputs, against the float64 reference of each sequence alone; then
fused_attention_varlen end to end, which picks fmha_sm90 where every sequence is within its contract
and fa2_sm80 where one is not, and trains on both Hopper families. Lengths 0, 1, 17, 127, 129, 1000 and
4097, Nq != Nk per sequence, a row tile reaching past a sequence's end into the next one, GQA 4:1,
MQA and head-major storage. Deterministic packed backwards (dQ added key tile by key tile in order)
on the split-dQ instances and through fused_attention_varlen, bitwise equal over repeats. Needs
`gemmgen generate --arch sm80 --arch sm90` (sm90 only for the instance test)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.select import calls, registry, selection

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


@pytest.mark.parametrize("name", [n for n in built("fmha_bwd_sm90") if "_sq" in n and "_bias" not in n
                                  and "_dropout" not in n] or ["(none built)"])
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


# Deterministic packed backwards: a sequence without queries whose 400 keys span several 128-key
# tiles between two sequences with queries (packed key tiles that add to no dQ of their own, and
# tiles shared with the neighbours' keys), an empty sequence, one without keys, Nq != Nk both ways
# (17 queries over 4097 keys: one dQ tile added by all 33 key tiles under no mask and bottom-right),
# and one long sequence of several query and key tiles.
DET_LENS_Q = [5, 0, 300, 0, 129, 1, 17, 1000]
DET_LENS_K = [7, 400, 300, 0, 77, 0, 4097, 1200]
DET_LENS = (DET_LENS_Q, DET_LENS_K)
# (causal, alignment, window): no mask, causal in both alignments, and a window for the local instances.
DET_CASES = [(False, "top_left", None), (True, "top_left", None), (True, "bottom_right", None),
             (False, "bottom_right", (100, 7))]
DET_REPEATS = 3


def deterministic_backward_into_poison(cand, q, k, v, do, *, causal, alignment, window=None, softcap=0.0,
                                       lens=DET_LENS):
    """The forward (the registry's pick, with LSE), then `cand`'s backward with deterministic=True
    into NaN-poisoned buffers: dQ, and dK, dV per query head (K and V read at their own heads), as the
    kernel wrote them."""
    causal, window = check_window(window, causal)  # as fused_attention_varlen normalizes them
    lens_q, lens_k = lens
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    with torch.no_grad():
        o, lse = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                causal_alignment=alignment, window=window, softcap=softcap,
                                                return_lse=True)
    assert q.shape[1] == k.shape[1] or cand.kernel.reads_gqa, f"{cand.name} takes K and V with Q's heads"
    dq = torch.full_like(q, float("nan"))
    dk, dv = (torch.full((t.shape[0], q.shape[1], t.shape[2]), float("nan"), dtype=t.dtype, device=t.device)
              for t in (k, v))
    problem = calls.problem_for_bwd_varlen(q, dk, len(lens_q), max(lens_q), max(lens_k), causal,
                                           causal_alignment=alignment, window=window, softcap=softcap > 0,
                                           deterministic=True)
    reason = registry.reject_reason(cand, problem)
    assert reason is None, f"{cand.name} refused {problem.describe()}: {reason}"
    p = launch.params_bwd_varlen(q, k, v, o, do, lse, dq, dk, dv, cu_q, cu_k, max(lens_q), max(lens_k),
                                 causal=causal, scale=None, causal_alignment=alignment, window=window,
                                 softcap=softcap, deterministic=True)
    launch.run_bwd(cand.kernel, p, q.get_device())
    torch.cuda.synchronize()
    return dq, dk, dv


@pytest.mark.parametrize("name", [n for n in built("fmha_bwd_sm90") if "_sq" in n and "_bias" not in n
                                  and "_dropout" not in n] or ["(none built)"])
def test_deterministic_backward_instance_on_packed_sequences(name):
    """fmha_bwd_sm90's split-dQ instances with deterministic=True on packed sequences (DET_LENS),
    the instance's mask (both alignments for causal, a window for local), GQA 4:1 read at K's own
    heads, packed and head-major storage: forward and backward run DET_REPEATS times on the same
    inputs into fresh NaN-poisoned buffers give bitwise equal dQ, dK, dV, which match float64."""
    cand = candidate(name)
    inst = cand.instance
    dtype = launch.TORCH_DTYPES[inst.dtype.value]
    softcap = 20.0 if inst.softcap else 0.0
    cases = [c for c in DET_CASES if mask_of(c[0], c[2]) == inst.mask.value]
    for (causal, alignment, window), layout in zip(cases, ["packed", "head_major"]):
        label = f"{name} deterministic causal={causal}/{alignment} window={window} 8:2 {layout}"
        q, k, v, do = make(8, 2, inst.head_dim, dtype, (name, "det", causal, alignment, window), layout,
                           lens=DET_LENS)
        runs = [deterministic_backward_into_poison(cand, q, k, v, do, causal=causal, alignment=alignment,
                                                   window=window, softcap=softcap)
                for _ in range(DET_REPEATS)]
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        out, _ = per_sequence(*leaves, causal=causal, alignment=alignment, window=window, softcap=softcap,
                              lens=DET_LENS)
        want = torch.autograd.grad(out, leaves, do.double(), materialize_grads=True)
        for g_name, w, first, *again in zip(("dQ", "dK", "dV"), want, *runs):
            got = first if g_name == "dQ" else first.view(first.shape[0], k.shape[1], -1, first.shape[2]).sum(2)
            assert_close(f"{label} {g_name}", got, w, dtype)
            for i, g in enumerate(again, 2):
                assert torch.equal(g, first), f"{label} {g_name}: run {i} differs from run 1"


@pytest.mark.parametrize("d, alignment", [(128, "top_left"), (64, "bottom_right")])
def test_deterministic_training_picks_hopper(d, alignment):
    """fused_attention_varlen(deterministic=True) with autograd on Hopper: the registry picks
    fmha_bwd_sm90 (its split-dQ instances) for the backward where built, and DET_REPEATS training
    steps on the same inputs (causal, GQA 4:1, DET_LENS) give bitwise equal gradients in the inputs'
    layouts, against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper families run on sm_90 only")
    dtype, lens = torch.bfloat16, DET_LENS
    stem = f"fmha_bwd_sm90_bf16_d{d}_causal_"
    split_dq = [n for n in built("fmha_bwd_sm90") if n.startswith(stem) and n.endswith("_sq")]
    if not split_dq:
        pytest.skip(f"no {stem}*_sq instance is built (gemmgen generate --arch sm90)")
    q, k, v, do = make(8, 2, d, dtype, ("det-train", d, alignment), "head_major", lens=lens)
    k_heads = torch.empty((k.shape[0], q.shape[1], k.shape[2]), dtype=dtype, device="cuda")  # as the selection sees K
    bwd = calls.problem_for_bwd_varlen(q, k_heads, len(DET_LENS_Q), max(DET_LENS_Q), max(DET_LENS_K), True,
                                       causal_alignment=alignment, deterministic=True)
    picked = selection.select(bwd)
    assert picked.entry.family == "fmha_bwd_sm90", f"picked {picked.name}; the split-dQ instances' reasons: " + repr(
        {n: registry.reject_reason(candidate(n), bwd) for n in split_dq})
    assert picked.name.endswith("_sq"), f"picked {picked.name}: example 88's loop is not deterministic"
    runs = []
    for _ in range(DET_REPEATS):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = gemmgen.fused_attention_varlen(*leaves, offsets(DET_LENS_Q), offsets(DET_LENS_K), max(DET_LENS_Q),
                                           max(DET_LENS_K), causal=True, causal_alignment=alignment,
                                           deterministic=True)
        o.backward(do)
        runs.append([t.grad for t in leaves])
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_o, _ = per_sequence(*ref, causal=True, alignment=alignment, lens=lens)
    want = torch.autograd.grad(want_o, ref, do.double(), materialize_grads=True)
    assert_close(f"d{d} {alignment} O", o, want_o, dtype)
    for name, w, x, first, *again in zip(("dQ", "dK", "dV"), want, (q, k, v), *runs):
        assert_close(f"d{d} {alignment} deterministic {name}", first, w, dtype)
        assert first.stride() == x.stride(), f"{name} is not in its input's layout"
        for i, g in enumerate(again, 2):
            assert torch.equal(g, first), f"d{d} {alignment} {name}: step {i} differs from step 1"


def test_deterministic_packed_training_compiled_and_captured():
    """deterministic=True on packed sequences through torch.compile(fullgraph=True) and through a CUDA
    graph of the forward and backward: each against float64, and bitwise equal from one compiled call
    (one graph replay) to the next."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper families run on sm_90 only")
    if not [n for n in built("fmha_bwd_sm90") if n.startswith("fmha_bwd_sm90_bf16_d128_causal_") and n.endswith("_sq")]:
        pytest.skip("no fmha_bwd_sm90_bf16_d128_causal_*_sq instance is built (gemmgen generate --arch sm90)")
    dtype, lens = torch.bfloat16, DET_LENS
    q, k, v, do = make(8, 2, 128, dtype, ("det-graph",), "packed", lens=lens)
    cu_q, cu_k, max_q, max_k = offsets(DET_LENS_Q), offsets(DET_LENS_K), max(DET_LENS_Q), max(DET_LENS_K)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_o, _ = per_sequence(*ref, causal=True, alignment="bottom_right", lens=lens)
    want = torch.autograd.grad(want_o, ref, do.double(), materialize_grads=True)

    def attend(q, k, v):
        return gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                              causal_alignment="bottom_right", deterministic=True)

    compiled = torch.compile(attend, fullgraph=True)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        runs.append(torch.autograd.grad(compiled(*leaves), leaves, do))
    for name, w, first, again in zip(("dQ", "dK", "dV"), want, *runs):
        assert_close(f"compiled deterministic {name}", first, w, dtype)
        assert torch.equal(first, again), f"compiled deterministic {name}: the second call differs"

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None if t.grad is None else t.grad.zero_()
        attend(*leaves).backward(do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replays = []
    for _ in range(2):
        for t in leaves:
            t.grad.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.grad.clone() for t in leaves])
    for name, w, first, again in zip(("dQ", "dK", "dV"), want, *replays):
        assert_close(f"captured deterministic {name}", first, w, dtype)
        assert torch.equal(first, again), f"captured deterministic {name}: the second replay differs"
