"""gemmgen.integrations.transformers without a GPU: what the attention function hands
gemmgen.fused_attention (masks, causal alignment, scaling, GQA, position biases), checked against
transformers' own SDPA path with fused_attention replaced by a float64 stand-in on the CPU; models
built from small configs through attn_implementation="gemmgen" (logits, padding, generate()); and
the fallback to transformers' SDPA path for calls gemmgen cannot run. tests/gpu runs the kernels."""
from __future__ import annotations

import logging
import math
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.56")

from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import gemmgen  # noqa: E402
import gemmgen.integrations.transformers as gt  # noqa: E402


def stand_in(q, k, v, *, causal=False, scale=None, dropout_p=0.0, attn_mask=None, calls=None,
             causal_alignment="top_left", window=None, softcap=0.0):
    """fused_attention's contract in float64 on the CPU: GQA, top-left causal, bool or additive mask,
    O = 0 for a row that sees no key. (CPU masks are never marked as windows: top-left, no window.)"""
    assert causal_alignment == "top_left" and window is None
    if calls is not None:
        calls.append(dict(causal=causal, scale=scale, dropout_p=dropout_p, mask=attn_mask, shapes=(q.shape, k.shape)))
    assert dropout_p == 0.0
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    nq, nk = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v).to(q.dtype)


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(gt, "fused_attention", lambda *a, **kw: stand_in(*a, **kw, calls=calls))
    return calls


class Layer(torch.nn.Module):
    def __init__(self, causal=True, groups=1):
        super().__init__()
        self.is_causal, self.num_key_value_groups = causal, groups


def qkv(b=2, h=8, hkv=2, nq=9, nk=9, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g), torch.randn(b, hkv, nk, d, generator=g),
            torch.randn(b, hkv, nk, d, generator=g))


def padding_mask(b, nq, nk, pad):
    """transformers' SDPA mask for left padding of `pad` keys in sequence 0, causal bottom-right."""
    i = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    mask = (j <= i).expand(b, 1, nq, nk).clone()
    mask[0, :, :, :pad] = False
    return mask


CASES = {
    "prefill-causal": dict(),
    "gqa-noncausal-layer": dict(layer=Layer(causal=False, groups=4)),
    "padding-mask": dict(mask=padding_mask(2, 9, 9, 3), rows=slice(3, None)),
    "decode": dict(nq=1, nk=40),
    "static-cache-prefill": dict(nq=9, nk=32),  # keys past Nq unused: top-left causal
    "decode-with-mask": dict(nq=1, nk=40, mask=padding_mask(2, 1, 40, 5)),
    "scaling": dict(scaling=0.3),
    "position-bias": dict(bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_transformers_sdpa_path(case, recorded):
    kw = CASES[case]
    q, k, v = qkv(nq=kw.get("nq", 9), nk=kw.get("nk", 9))
    layer = kw.get("layer", Layer(groups=4))
    extra = {"scaling": kw["scaling"]} if "scaling" in kw else {}
    if kw.get("bias"):
        extra["position_bias"] = torch.randn(1, 8, q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(1))
    mask = kw.get("mask")
    ours, weights = gt.attention_forward(layer, q, k, v, mask, **extra)
    theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, **extra)
    assert weights is None and ours.shape == theirs.shape == (2, q.shape[2], 8, 32)
    if "rows" in kw:  # sequence 0's first query rows see only padding: their output is unspecified
        torch.testing.assert_close(ours[1:], theirs[1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[0, kw["rows"]], theirs[0, kw["rows"]], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    (call,) = recorded
    assert call["causal"] == (case in ("prefill-causal", "static-cache-prefill", "scaling"))
    assert call["shapes"] == (q.shape, k.shape)  # K and V with their own heads: no repeat
    assert call["scale"] == kw.get("scaling")


def tiny(config_cls):
    """A two-layer config of a Llama-, Qwen- (GQA 4:2, head dim 32) or GPT-2-style (MHA) model."""
    if config_cls is GPT2Config:
        return GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=256)
    return config_cls(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config, GPT2Config], ids=["llama", "qwen2", "gpt2"])
def test_models_run_on_gemmgen_through_attn_implementation(config_cls, recorded):
    gt.register()
    torch.manual_seed(0)  # each model its own config: a model keeps a reference to the one it was given
    ours = AutoModelForCausalLM.from_config(tiny(config_cls), attn_implementation="gemmgen").eval()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny(config_cls), attn_implementation="sdpa").eval()
    assert ours.config._attn_implementation == "gemmgen" and ref.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[1], b[1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(a[0, 4:], b[0, 4:], atol=2e-4, rtol=2e-4)
    assert recorded and all(c["mask"] is not None for c in recorded)  # padding: a bool mask per layer
    recorded.clear()
    with torch.no_grad():
        gen_a = ours.generate(ids[1:], max_new_tokens=8, do_sample=False)
        gen_b = ref.generate(ids[1:], max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_a, gen_b)
    assert any(c["shapes"][0][2] == 1 for c in recorded)  # decode steps of one query row


def test_calls_gemmgen_cannot_run_fall_back_with_one_warning(caplog, monkeypatch):
    gt._reasons.clear()
    q, k, v = qkv()  # float32 on the CPU: no gemmgen family runs it
    with caplog.at_level(logging.WARNING, logger="gemmgen.transformers"):
        for _ in range(3):
            out, _ = gt.attention_forward(Layer(groups=4), q, k, v, None)
    theirs, _ = sdpa_attention_forward(Layer(groups=4), q, k, v, None)
    assert torch.equal(out, theirs)
    (reason, count), = gt.fallback_reasons().items()
    assert count == 3 and "dtype" in reason
    assert len([r for r in caplog.records if r.name == "gemmgen.transformers"]) == 1
    # A softcap gemmgen cannot run here goes to the layer's model's eager attention (SDPA's path refuses
    # softcaps); without one, a clear error.
    with pytest.raises(gemmgen.InputError, match="eager attention function"):
        gt.attention_forward(Layer(groups=4), q, k, v, None, softcap=30.0)
    seen = []

    def eager_attention_forward(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs["softcap"])
        return query.transpose(1, 2), None

    monkeypatch.setattr(sys.modules[Layer.__module__], "eager_attention_forward", eager_attention_forward,
                        raising=False)
    out, _ = gt.attention_forward(Layer(groups=4), q, k, v, None, softcap=30.0)
    assert seen == [30.0] and torch.equal(out, q.transpose(1, 2))
