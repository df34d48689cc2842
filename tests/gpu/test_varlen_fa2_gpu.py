"""Variable lengths on the sm80 design's own kernels (fa2_sm80 forward, fa2_bwd_sm80 backward) on the
GPU: every built instance forced by name on packed sequences into NaN-poisoned outputs, against the
float64 reference of each sequence alone. Lengths 0, 1, 17, 127, 129, 1000 and 4097 with Nq != Nk
per sequence; no mask, causal top-left and bottom-right within each sequence (FlashAttention's varlen
causal), sliding windows in both alignments (the forward's local instances, every backward one),
the logit softcap on the `_sc` ones, GQA 4:1 and MQA read at their own heads, head-major storage; then autograd through
fused_attention_varlen. Needs the families built (`gemmgen generate --arch sm80` builds both)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.ops.reference import attention_reference
from gemmgen.ops.checks import check_window
from gemmgen.select import calls, registry, selection

from test_attention_bwd_gpu import assert_close, offsets, packed_randn

pytestmark = pytest.mark.gpu

# Per sequence (len_q, len_k): an empty query side, an empty key side, one row, Nq != Nk both ways,
# and one long sequence that spans many tiles.
LENS_Q = [0, 1, 17, 5, 127, 129, 1000, 300]
LENS_K = [9, 0, 17, 1, 129, 127, 77, 4097]
MASKS = [(False, "top_left", None), (True, "top_left", None), (True, "bottom_right", None)]
WINDOWS = [(True, "top_left", (40, 0)), (False, "bottom_right", (100, 7)), (False, "top_left", (-1, 3))]


def built(family: str) -> list[str]:
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted(c.name for c in registry.load()[0] if c.entry.family == family
                  and registry.build_reason(c, cc) is None)


def candidate(name: str) -> registry.Candidate:
    found = [c for c in registry.load()[0] if c.name == name]
    if not found:
        pytest.skip(f"{name} is not built")
    return found[0]


def make(h, hkv, d, dtype, key, layout="packed", lens=(LENS_Q, LENS_K)):
    """Fresh packed q, dO [Tq, H, d] and k, v [Tk, Hkv, d] of sequences of lengths `lens` (q's, k's)."""
    q, do = (packed_randn(sum(lens[0]), h, d, dtype, (key, n), layout) for n in ("q", "do"))
    k, v = (packed_randn(sum(lens[1]), hkv, d, dtype, (key, n), layout) for n in ("k", "v"))
    return q, k, v, do


def per_sequence(q, k, v, *, causal, alignment, window=None, softcap=0.0, scale=None, lens=(LENS_Q, LENS_K)):
    """float64 packed O and LSE [B, H, max_q] (-inf past each sequence's end) of each sequence alone,
    differentiable in q, k, v."""
    lens_q, lens_k = lens
    oq, ok = offsets(lens_q).tolist(), offsets(lens_k).tolist()
    outs = []
    lse = torch.full((len(lens_q), q.shape[1], max(lens_q)), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(len(lens_q)):
        qs, ks, vs = (t[a:z].transpose(0, 1).unsqueeze(0) for t, a, z in
                      ((q, oq[b], oq[b + 1]), (k, ok[b], ok[b + 1]), (v, ok[b], ok[b + 1])))
        if ks.shape[2] == 0:
            outs.append(qs[0].transpose(0, 1).double() * 0)
            continue
        o, l = attention_reference(qs, ks, vs, causal, alignment, scale, window=window, softcap=softcap)
        outs.append(o[0].transpose(0, 1))
        lse[b, :, :qs.shape[2]] = l[0]
    return torch.cat(outs), lse


def check_lse(name, got, want):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{name}: -inf rows differ"
    fin = torch.isfinite(want)
    err = (got.double()[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    assert err < 2e-3, f"{name}: LSE error {err:.3e}"


def forward_into_poison(cand, q, k, v, *, causal, alignment, window=None, softcap=0.0, scale=None,
                        lens=(LENS_Q, LENS_K)):
    causal, window = check_window(window, causal)  # as fused_attention_varlen normalizes them
    lens_q, lens_k = lens
    masked = causal or window is not None
    short = any(lq > 0 and (lk == 0 or (masked and lk < lq)) for lq, lk in zip(lens_q, lens_k))
    problem = calls.problem_for_varlen(q, k, v, len(lens_q), max(lens_q), max(lens_k), causal,
                                       causal_alignment=alignment, scale=scale, window=window, softcap=softcap > 0,
                                       short_keys=short)
    reason = registry.reject_reason(cand, problem)
    assert reason is None, f"{cand.name} refused {problem.describe()}: {reason}"
    o = torch.full_like(q, float("nan"))
    lse = torch.full((len(lens_q), q.shape[1], max(lens_q)), float("nan"), device=q.device)
    p = launch.params_varlen(q, k, v, o, lse, offsets(lens_q), offsets(lens_k), max(lens_q), max(lens_k),
                             causal=causal, causal_alignment=alignment, scale=scale, window=window, softcap=softcap)
    launch.launch(cand.kernel, p, q.get_device())
    torch.cuda.synchronize()
    return o, lse


@pytest.mark.parametrize("name", built("fa2_sm80") or ["(none built)"])
def test_forward_instance_on_packed_sequences(name):
    cand = candidate(name)
    inst = cand.instance
    dtype = launch.TORCH_DTYPES[inst.dtype.value]
    softcap = 30.0 if inst.softcap else 0.0
    mask = inst.mask.value
    cases = [c for c in MASKS if (c[0] and mask == "causal") or (not c[0] and mask == "none")]
    cases += WINDOWS if mask == "local" else []
    for (causal, alignment, window), (h, hkv) in zip(cases, [(4, 1), (4, 4), (8, 2)]):
        label = f"{name} causal={causal}/{alignment} window={window} {h}:{hkv}"
        q, k, v, _ = make(h, hkv, inst.head_dim, dtype, (name, causal, alignment, window), "head_major" if h == 8
                          else "packed")
        scale = -0.2 if hkv == 4 else None
        o, lse = forward_into_poison(cand, q, k, v, causal=causal, alignment=alignment, window=window,
                                     softcap=softcap, scale=scale)
        want_o, want_lse = per_sequence(q, k, v, causal=causal, alignment=alignment, window=window, softcap=softcap,
                                        scale=scale)
        assert_close(f"{label} O", o, want_o, dtype)
        check_lse(label, lse, want_lse)


def backward_into_poison(cand, q, k, v, do, *, causal, alignment, window=None, softcap=0.0):
    causal, window = check_window(window, causal)
    with torch.no_grad():
        o, lse = gemmgen.fused_attention_varlen(q, k, v, offsets(LENS_Q), offsets(LENS_K), max(LENS_Q), max(LENS_K),
                                                causal=causal, causal_alignment=alignment, window=window,
                                                softcap=softcap, return_lse=True)
    group = q.shape[1] // k.shape[1]
    dq = torch.full_like(q, float("nan"))
    dk, dv = (torch.full((t.shape[0], q.shape[1], t.shape[2]), float("nan"), dtype=t.dtype, device=t.device)
              for t in (k, v))
    problem = calls.problem_for_bwd_varlen(q, dk, len(LENS_Q), max(LENS_Q), max(LENS_K), causal,
                                           causal_alignment=alignment, window=window, softcap=softcap > 0)
    reason = registry.reject_reason(cand, problem)
    assert reason is None, f"{cand.name} refused {problem.describe()}: {reason}"
    p = launch.params_bwd_varlen(q, k, v, o, do, lse, dq, dk, dv, offsets(LENS_Q), offsets(LENS_K), max(LENS_Q),
                                 max(LENS_K), causal=causal, scale=None, causal_alignment=alignment, window=window,
                                 softcap=softcap)
    launch.run_bwd(cand.kernel, p, q.get_device())
    torch.cuda.synchronize()
    if group > 1:  # dK and dV come back per query head
        dk, dv = (t.view(t.shape[0], -1, group, t.shape[2]).sum(2) for t in (dk, dv))
    return dq, dk, dv


def check_backward_instance(name, cases):
    """Backward instance `name` on the packed lengths of this module, each case (causal, alignment,
    window) paired in turn with MHA, MQA and GQA 4:1 (K and V at their own heads, head-major storage
    for the last): dQ, dK, dV into NaN-poisoned buffers against float64 autograd per sequence."""
    cand = candidate(name)
    inst = cand.instance
    dtype = launch.TORCH_DTYPES[inst.dtype.value]
    softcap = 20.0 if inst.softcap else 0.0
    for (causal, alignment, window), (h, hkv) in zip(cases, [(4, 4), (4, 1), (8, 2)] * 2):
        label = f"{name} causal={causal}/{alignment} window={window} {h}:{hkv}"
        q, k, v, do = make(h, hkv, inst.head_dim, dtype, (name, causal, alignment, window), "head_major" if h == 8
                           else "packed")
        got = backward_into_poison(cand, q, k, v, do, causal=causal, alignment=alignment, window=window,
                                   softcap=softcap)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        out, _ = per_sequence(*leaves, causal=causal, alignment=alignment, window=window, softcap=softcap)
        want = torch.autograd.grad(out, leaves, do.double(), materialize_grads=True)
        for g_name, g, w in zip(("dQ", "dK", "dV"), got, want):
            assert_close(f"{label} {g_name}", g, w, dtype)


@pytest.mark.parametrize("name", built("fa2_bwd_sm80") or ["(none built)"])
def test_backward_instance_on_packed_sequences(name):
    check_backward_instance(name, MASKS + WINDOWS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_autograd_bottom_right_gqa_runs_on_the_fa2_families(dtype, alignment):
    """fused_attention_varlen end to end (the registry's picks): causal in both alignments, GQA 4:1,
    gradients in the inputs' layouts; the forward on fa2_sm80 (sequences with fewer keys than
    queries), the backward on fa2_bwd_sm80 or, on Hopper, fmha_bwd_sm90."""
    q, k, v, do = make(8, 2, 128, dtype, ("autograd", alignment, dtype), "head_major")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = gemmgen.fused_attention_varlen(*leaves, offsets(LENS_Q), offsets(LENS_K), max(LENS_Q), max(LENS_K),
                                       causal=True, causal_alignment=alignment)
    o.backward(do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_o, _ = per_sequence(*ref, causal=True, alignment=alignment)
    want = torch.autograd.grad(want_o, ref, do.double(), materialize_grads=True)
    assert_close(f"autograd {alignment} O", o, want_o, dtype)
    for name, g, w, x in zip(("dQ", "dK", "dV"), (t.grad for t in leaves), want, (q, k, v)):
        assert_close(f"autograd {alignment} {name}", g, w, dtype)
        assert g.stride() == x.stride(), f"{name} is not in its input's layout"
    fwd = calls.problem_for_varlen(q, k, v, len(LENS_Q), max(LENS_Q), max(LENS_K), True,
                                   causal_alignment=alignment)
    k_heads = torch.empty((k.shape[0], q.shape[1], k.shape[2]), dtype=dtype, device="cuda")  # as the selection sees K
    bwd = calls.problem_for_bwd_varlen(q, k_heads, len(LENS_Q), max(LENS_Q), max(LENS_K), True,
                                       causal_alignment=alignment)
    assert selection.select(fwd).entry.family == "fa2_sm80", "sequences with fewer keys than queries"
    # On Hopper fmha_bwd_sm90's split-dQ instances run packed backwards where built
    # (test_varlen_fmha_sm90_gpu.py); elsewhere this family does.
    stem = f"fmha_bwd_sm90_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_d128_causal_"
    hopper = torch.cuda.get_device_capability() == (9, 0) and any(
        n.startswith(stem) and n.endswith("_sq") for n in built("fmha_bwd_sm90"))
    assert selection.select(bwd).entry.family == ("fmha_bwd_sm90" if hopper else "fa2_bwd_sm80")
