"""fa2_bwd_sm80 (the mma.sync backward) on the GPU: every built instance forced by name against float64
autograd on fresh random inputs, gradient buffers poisoned with NaN first: lengths 1, 17, 127, 129,
1000 and 4097 with Nq != Nk, no mask and causal in both alignments, scales negative and zero, GQA 4:1
and MQA read at their own heads, [B, N, H, d] views, and the logit softcap of its `_sc` instances;
then through autograd, the head dims the Hopper backward has no tile for. Needs the family built
(`gemmgen generate --arch sm80` builds its default set)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, registry, selection

from test_attention_bwd_gpu import MASKS, assert_close, make, ref_grads

pytestmark = pytest.mark.gpu

FAMILY = "fa2_bwd_sm80"
LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 17), (17, 1000), (4097, 129)]


def instances(softcap: bool) -> list[str]:
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted(c.name for c in registry.load()[0] if c.entry.family == FAMILY
                  and bool(c.entry.params.get("softcap")) == softcap and registry.build_reason(c, cc) is None)


def candidate(name: str) -> registry.Candidate:
    found = [c for c in registry.load()[0] if c.name == name]
    if not found:
        pytest.skip(f"{name} is not built")
    return found[0]


def run(cand, q, k, v, do, *, causal, alignment, scale=None, softcap=0.0, window=None, deterministic=False):
    """The forward (the registry's pick, with LSE), then `cand`'s backward into NaN-poisoned buffers;
    dK and dV per query head."""
    with torch.no_grad():
        o, lse = gemmgen.fused_attention(q, k, v, causal=causal, causal_alignment=alignment, scale=scale,
                                         softcap=softcap, window=window, return_lse=True)
    group = q.shape[1] // k.shape[1]
    problem = calls.problem_for_bwd(q, launch.expanded_layout(k, group, "meta"), causal, causal_alignment=alignment,
                                    scale=scale, softcap=softcap > 0, window=window, deterministic=deterministic)
    reason = registry.reject_reason(cand, problem)
    assert reason is None, f"{cand.name} refused {problem.describe()}: {reason}"
    dq = torch.full_like(q, float("nan"))
    dk, dv = (launch.empty_like_layout(t, (*t.shape[:1], q.shape[1], *t.shape[2:])).fill_(float("nan"))
              for t in (k, v))
    p = launch.params_bwd(q, k, v, o, do, lse, dq, dk, dv, causal=causal, causal_alignment=alignment, scale=scale,
                          softcap=softcap, window=window, deterministic=deterministic)
    launch.run_bwd(cand.kernel, p, q.get_device())
    torch.cuda.synchronize()
    return dq, dk, dv


@pytest.mark.parametrize("name", instances(False) or ["(none built)"])
def test_instance_lengths_masks_scales(name):
    cand = candidate(name)
    d = cand.instance.head_dim
    dtype = launch.TORCH_DTYPES[cand.instance.dtype.value]
    for nq, nk in LENGTHS:
        for (causal, alignment), scale in zip(MASKS, (None, -0.3, 0.0)):
            key = (name, nq, nk, causal, alignment)
            q, k, v, do = make(2, 2, 2, nq, nk, d, dtype, key)
            got = run(cand, q, k, v, do, causal=causal, alignment=alignment, scale=scale)
            want = ref_grads(q, k, v, do, causal=causal, alignment=alignment, scale=scale)
            for label, g, w in zip(("dQ", "dK", "dV"), got, want):
                assert_close(f"{name} {nq}x{nk} causal={causal}/{alignment} scale={scale} {label}", g, w, dtype)


@pytest.mark.parametrize("name", instances(False) or ["(none built)"])
def test_instance_gqa_and_views(name):
    """K and V read at their own heads (4:1 and MQA) from [B, N, H, d] views."""
    cand = candidate(name)
    d = cand.instance.head_dim
    dtype = launch.TORCH_DTYPES[cand.instance.dtype.value]
    for h, hkv, layout, causal in ((8, 2, "bnhd", True), (4, 1, "bhnd", False)):
        q, k, v, do = make(2, h, hkv, 300, 257, d, dtype, (name, hkv, layout), layout)
        group = h // hkv
        got = run(cand, q, k, v, do, causal=causal, alignment="bottom_right")
        k_all, v_all = (t.repeat_interleave(group, 1) for t in (k, v))
        want = ref_grads(q, k_all, v_all, do, causal=causal, alignment="bottom_right")
        for label, g, w in zip(("dQ", "dK per query head", "dV per query head"), got, want):
            assert_close(f"{name} {h}:{hkv} {layout} {label}", g, w, dtype)


@pytest.mark.parametrize("name", instances(False) or ["(none built)"])
def test_instance_deterministic(name):
    """deterministic=True: the key tiles of each query tile add its dQ one after another in key-tile
    order; three runs bitwise equal and right, with causal (bottom-right, Nq != Nk, GQA 4:1 at its own
    heads), a two-sided window and no mask over many key tiles."""
    cand = candidate(name)
    d = cand.instance.head_dim
    dtype = launch.TORCH_DTYPES[cand.instance.dtype.value]
    for (nq, nk), kw in (((1000, 1300), dict(causal=True, alignment="bottom_right")),
                         ((777, 2049), dict(causal=False, alignment="top_left", window=(200, 100))),
                         ((129, 4097), dict(causal=False, alignment="top_left"))):
        q, k, v, do = make(2, 4, 1 if nq == 1000 else 4, nq, nk, d, dtype, (name, "det", nq, nk))
        first = run(cand, q, k, v, do, deterministic=True, **kw)
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(first, run(cand, q, k, v, do, deterministic=True, **kw)))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        attention_reference(*leaves, kw["causal"], kw["alignment"], window=kw.get("window"))[0].backward(do.double())
        group = q.shape[1] // k.shape[1]
        for label, g, t in zip(("dQ", "dK", "dV"), first, leaves):
            if label != "dQ" and group > 1:  # per query head: summed over each group
                g = g.view(g.shape[0], k.shape[1], group, *g.shape[2:]).sum(2)
            assert_close(f"{name} {nq}x{nk} {kw} deterministic {label}", g, t.grad, dtype)


@pytest.mark.parametrize("name", instances(True) or ["(none built)"])
def test_softcap_instance(name):
    cand = candidate(name)
    d = cand.instance.head_dim
    dtype = launch.TORCH_DTYPES[cand.instance.dtype.value]
    # Rows of a few keys with spiky scores are covered without a cap above: here every case has
    # enough rows that bf16's rounding of O (D = rowsum(dO * O)) averages out of the norm.
    for (nq, nk), (causal, alignment) in zip(((300, 700), (700, 300), (129, 127), (33, 17)), MASKS + MASKS[:1]):
        q, k, v, do = make(2, 2, 2, nq, nk, d, dtype, (name, nq, nk))
        q, k = q * 3, k * 3  # many scores past the cap: tanh's flat part is exercised
        got = run(cand, q, k, v, do, causal=causal, alignment=alignment, softcap=20.0)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        attention_reference(*leaves, causal, alignment, softcap=20.0)[0].backward(do.double())
        for label, g, t in zip(("dQ", "dK", "dV"), got, leaves):
            assert_close(f"{name} {nq}x{nk} causal={causal}/{alignment} {label}", g, t.grad, dtype)


@pytest.mark.parametrize("d", [160, 192, 256])
def test_autograd_head_dims_without_hopper_tiles(d):
    """Through fused_attention's autograd: the registry runs these head dims on this family (on
    Hopper too, where fmha_bwd_sm90 stops at 128), GQA 2:1, causal bottom-right, Nq != Nk."""
    dtype = torch.bfloat16
    q, k, v, do = make(2, 4, 2, 333, 1000, d, dtype, ("autograd", d))
    problem = calls.problem_for_bwd(q, launch.expanded_layout(k, 2, "meta"), True, causal_alignment="bottom_right")
    try:
        picked = selection.select(problem).entry.family
    except gemmgen.NoInstanceError as exc:
        pytest.skip(f"no backward at d{d} is built: {exc}")
    assert picked == FAMILY, f"d{d}: the registry picked {picked}"
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    gemmgen.fused_attention(*leaves, causal=True, causal_alignment="bottom_right").backward(do)
    want = ref_grads(q, k, v, do, causal=True, alignment="bottom_right")
    for label, t, w, x in zip(("dQ", "dK", "dV"), leaves, want, (q, k, v)):
        assert_close(f"d{d} {label}", t.grad, w, dtype)
        assert t.grad.stride() == x.stride()
