"""The logit softcap on the GPU (fused_attention(softcap=c): scaled scores s become c * tanh(s / c)
before the mask) against the float64 reference: every built softcap instance forced by name, the
registry's picks, the gradients (or the refusal with grad where no softcap backward is built),
torch.compile and CUDA graphs, and a Gemma-2-style model through the Hugging Face integration against
transformers' eager attention (logits, a training step's gradients, greedy generation). Inputs are fresh random
tensors (scaled up so that the cap bites), outputs poisoned with NaN first. Needs the softcap
instances built (`gemmgen generate --arch sm80` builds fa2_sm80's at head dims 128 and 256)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, registry

from test_fused_attention import TOLERANCE, make_qkv
from test_fused_attention import check as fused_check

pytestmark = pytest.mark.gpu

LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 4097), (4097, 1000)]
ALIGNMENTS = ("top_left", "bottom_right")


def softcap_instances() -> list[str]:
    """The built forward softcap instances the GPU runs (none without a GPU: the tests are skipped
    there; the backward ones run through autograd in test_softcap_gradients)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted({c.name for c in registry.load()[0] if c.entry.params.get("softcap")
                   and not c.entry.params.get("bias")  # (tests/gpu/test_bias_fmha_sm90_gpu.py runs those)
                   and registry.family_named(c.entry.family).KIND == "attention"
                   and registry.build_reason(c, cc) is None})


def spiky(q, k, scale=3.0):
    """q and k scaled so that many scores pass the caps tested (tanh's flat part is exercised)."""
    return q * scale, k * scale


@pytest.mark.parametrize("name", softcap_instances() or ["(none built)"])
def test_every_softcap_instance(name):
    """Each softcap instance forced by name: caps 5, 20, 30 and 50, lengths 1 to 4097 with Nq != Nk,
    both alignments (its mask: none, causal or a window), GQA 4:1 and MQA, scales default, 0.3 and 0;
    the calls the instance refuses (fmha_sm90's causal with Nq > Nk) left out, the rest counted."""
    if name == "(none built)":
        pytest.fail("no softcap instance is built for this GPU")
    cand = next(c for c in registry.load()[0] if c.name == name)
    family = registry.family_named(cand.entry.family)
    ran = 0
    dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
    d = int(name.split("_d")[1].split("_")[0])
    mask = name.split(f"_d{d}_")[1].split("_")[0]
    for nq, nk in LENGTHS:
        for alignment in ALIGNMENTS:
            for cap, scale in ((5.0, None), (30.0, 0.3), (50.0, None), (20.0, 0.0)):
                q, k, v = make_qkv(2, 4, 1 if nq > 1000 else 4, nq, nk, d, dtype, (name, nq, nk, alignment, cap))
                q, k = spiky(q, k)
                kw = dict(causal=mask == "causal", alignment=alignment, scale=scale, softcap=cap, instance=name)
                if mask == "local":
                    kw["window"] = (100, 7)
                problem = calls.problem_for(q, k, mask == "causal", v=v, causal_alignment=alignment, scale=scale,
                                            window=kw.get("window"), softcap=True)
                if registry.functional_reason(family, cand.instance, problem) is not None:
                    continue
                fused_check(q, k, v, **kw)
                ran += 1
    assert ran >= 2 * len(LENGTHS) * 4 - (4 * 2 * 2 if mask == "causal" else 0), ran


def test_registry_picks_softcap_instances_for_softcap_calls_only():
    if not softcap_instances():
        pytest.fail("no softcap instance is built for this GPU")
    q, k, v = make_qkv(1, 8, 2, 300, 700, 128, torch.bfloat16, "pick")
    for causal in (False, True):
        capped = gemmgen.selected_instance(q, k, v, causal=causal, softcap=50.0)
        plain = gemmgen.selected_instance(q, k, v, causal=causal)
        assert capped.endswith("_sc") and not plain.endswith("_sc"), (capped, plain)
        fused_check(*spiky(q, k), v, causal=causal, alignment="bottom_right", softcap=50.0)
    # A [B, N, H, d] view and a window with the cap, through the registry.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    fused_check(*spiky(qt, kt), vt, window=(64, 0), alignment="bottom_right", softcap=20.0)
    # A head dim without a softcap instance: the error names the softcap.
    q64, k64, v64 = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "no tile")
    with pytest.raises(gemmgen.NoInstanceError, match="softcap"):
        gemmgen.fused_attention(q64, k64, v64, softcap=30.0)


def softcap_backward_runs(head_dim: int = 128, local: bool = False) -> bool:
    """Whether a backward instance built for a softcap runs `head_dim` on this GPU (fa2_bwd_sm80's at
    128 and 256 by default, fmha_bwd_sm90's at 128 on Hopper), with a sliding window if `local`
    (fmha_bwd_sm90's local `_sc` instances, and fa2_bwd_sm80's, which run windows too)."""
    cc = torch.cuda.get_device_capability()
    return any(c.entry.params.get("softcap") and registry.family_named(c.entry.family).KIND == "attention_bwd"
               and c.entry.params.get("head_dim") == head_dim
               and (not local or c.entry.params.get("mask") == "local" or c.entry.params.get("window"))
               and registry.build_reason(c, cc) is None for c in registry.load()[0])


def capped_reference(q, k, v, cap, *, causal=False, alignment="top_left", window=None):
    """float64 O of the capped attention, differentiable (attention_reference: a row that sees no key
    gives 0, and its masked scores pass no NaN back)."""
    return attention_reference(q, k, v, causal, alignment, window=window, softcap=cap)[0]


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_gradients(dtype, d):
    """dQ, dK, dV of capped attention through autograd against float64, where a softcap backward is
    built at head dim d: masks none and causal in both alignments, and a window where a windowed one
    is built (fa2_bwd_sm80's `_sc` instances run windows); GQA 4:1 as [B, N, H, d] views and MQA; Nq != Nk. Elsewhere inputs that
    require grad raise at the forward."""
    from test_attention_bwd_gpu import assert_close as assert_grad_close
    from test_attention_bwd_gpu import make as make_grad_inputs

    if not softcap_backward_runs(d):
        q, k, v = make_qkv(1, 2, 2, 64, 64, d, dtype, "no backward")
        with pytest.raises(gemmgen.NoInstanceError, match="softcap"):
            gemmgen.fused_attention(q.requires_grad_(), k, v, causal=True, softcap=30.0)
        return
    cases = [((300, 700), dict(), "top_left"), ((700, 300), dict(causal=True), "bottom_right"),
             ((257, 257), dict(causal=True), "top_left")]
    window = ((129, 1000), dict(window=(64, 16)), "bottom_right")
    if softcap_backward_runs(d, local=True):
        cases.append(window)
    else:
        q, k, v = make_qkv(1, 2, 2, 129, 1000, d, dtype, "no window backward")
        with pytest.raises(gemmgen.NoInstanceError):
            gemmgen.fused_attention(q.requires_grad_(), k, v, window=(64, 16), causal_alignment="bottom_right",
                                    softcap=30.0)
    for (nq, nk), kw, alignment in cases:
        for h, hkv, layout in ((8, 2, "bnhd"), (4, 1, "bhnd")):
            key = ("capgrad", nq, nk, repr(kw), h, layout, d)
            q, k, v, do = make_grad_inputs(2, h, hkv, nq, nk, d, dtype, key, layout)
            q, k = spiky(q, k)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = gemmgen.fused_attention(*leaves, causal_alignment=alignment, softcap=30.0, **kw)
            o.backward(do)
            ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
            capped_reference(*ref, 30.0, alignment=alignment, **kw).backward(do.double())
            for label, t, r, x in zip(("dQ", "dK", "dV"), leaves, ref, (q, k, v)):
                assert_grad_close(f"d{d} {nq}x{nk} {kw} {alignment} {h}:{hkv} {label}", t.grad, r.grad, dtype)
                assert t.grad.stride() == x.stride()


def test_softcap_compiled_and_graphed():
    """torch.compile(fullgraph=True) of a capped call (a training step where a softcap backward is
    built) and CUDA graph replay of one, against float64."""
    q, k, v = make_qkv(2, 4, 4, 257, 257, 128, torch.float16, "compiled")
    q, k = spiky(q, k)
    fn = torch.compile(lambda q, k, v: gemmgen.fused_attention(q, k, v, causal=True, softcap=30.0), fullgraph=True)
    ref, _ = attention_reference(q, k, v, True, softcap=30.0)
    o = fn(q, k, v)
    assert (o.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]
    if softcap_backward_runs():
        from test_attention_bwd_gpu import assert_close as assert_grad_close

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        do = torch.randn_like(q)
        fn(*leaves).backward(do)
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        capped_reference(*ref_leaves, 30.0, causal=True).backward(do.double())
        for label, t, r in zip(("dQ", "dK", "dV"), leaves, ref_leaves):
            assert_grad_close(f"compiled {label}", t.grad, r.grad, torch.float16)
    gemmgen.fused_attention(q, k, v, causal=True, softcap=30.0)  # selected outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemmgen.fused_attention(q, k, v, causal=True, softcap=30.0)
    q.copy_(torch.randn_like(q) * 3)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, True, softcap=30.0)
    assert (out.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]


def test_bad_softcaps_raise():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 128, torch.float16, "bad")
    for bad in (-1.0, float("nan"), float("inf"), "30", True):
        with pytest.raises(gemmgen.InputError, match="softcap"):
            gemmgen.fused_attention(q, k, v, softcap=bad)


def test_gemma2_style_model_matches_eager_attention():
    """A small Gemma-2-style model (logit softcap 50, sliding window 32 on every other layer, GQA):
    gemmgen's logits and greedy generation against transformers' eager attention (which SDPA's path
    cannot run: it refuses softcaps)."""
    transformers = pytest.importorskip("transformers", minversion="4.56")
    import gemmgen.integrations.transformers as gt
    from test_transformers_gpu import same_greedy_tokens

    cfg = transformers.Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                    max_position_embeddings=512, sliding_window=32, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=128)
    gt.register()
    gt._reasons.clear()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to("cuda", torch.bfloat16)
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="gemmgen").to("cuda", torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    ours.eval(), ref.eval()
    ids = torch.randint(0, 512, (2, 100), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    with torch.no_grad():
        a, b = ours(ids).logits.float(), ref(ids).logits.float()
        assert (a - b).norm() / b.norm() < 2e-2
        gen_a = ours.generate(ids[:, :40], max_new_tokens=12, do_sample=False)
        res_b = ref.generate(ids[:, :40], max_new_tokens=12, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    same_greedy_tokens(gen_a, res_b, 40)
    # A training step: through gemmgen's softcap backward where one is built, else the eager fallback.
    for model in (ours, ref):
        model.train()
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
    worst = max(((p.grad.float() - r.grad.float()).norm() / r.grad.float().norm()).item()
                for p, r in zip(ours.parameters(), ref.parameters()) if r.grad is not None and r.grad.norm() > 0)
    assert worst < 5e-2, worst
    # Its sliding-window layers train on gemmgen where a windowed softcap backward is built.
    assert gt.fallback_reasons() == {} or not softcap_backward_runs(128, local=True), gt.fallback_reasons()
