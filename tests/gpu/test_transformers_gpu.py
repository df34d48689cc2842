"""Hugging Face models on gemmgen's kernels: small Llama-, Qwen2- (GQA 8:2) and GPT-2-style (MHA)
models built from configs (random weights, nothing downloaded), bf16 on the GPU, through
attn_implementation="gemmgen" against the same weights on "sdpa": logits (with and without left
padding), the gradients of a training step, and greedy generate() with the model's KV cache. Every
attention call must run on gemmgen (no fallback reason)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="4.56")

from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config  # noqa: E402

import gemmgen.integrations.transformers as gt  # noqa: E402
from gemmgen.select import registry  # noqa: E402

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def config(kind: str):
    if kind == "gpt2":
        return GPT2Config(vocab_size=1024, n_embd=512, n_layer=2, n_head=8, n_positions=512, attn_pdrop=0.0,
                          resid_pdrop=0.0, embd_pdrop=0.0)
    cls = LlamaConfig if kind == "llama" else Qwen2Config
    return cls(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=512)


def pair(kind: str):
    """The same random weights on gemmgen and on transformers' SDPA path, bf16 on the GPU."""
    gt.register()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config(kind), attn_implementation="sdpa").to("cuda", BF16)
    ours = AutoModelForCausalLM.from_config(config(kind), attn_implementation="gemmgen").to("cuda", BF16)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "gemmgen" and ref.config._attn_implementation == "sdpa"
    return ours, ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same_greedy_tokens(ours: torch.Tensor, ref, start: int) -> None:
    """The same generated tokens past `start`; bf16 rounding may flip a step only where SDPA's own
    top two logits all but tie (ref: generate()'s output with scores)."""
    for row in range(ours.shape[0]):
        differ = (ours[row, start:] != ref.sequences[row, start:]).nonzero()
        if len(differ):
            step = differ[0].item()
            top = ref.scores[step][row].float().topk(2).values
            assert (top[0] - top[1]).item() < 0.05, f"sequence {row} differs at step {step}, margin {top[0] - top[1]:.3f}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_logits_gradients_and_generation_match_sdpa(kind):
    gt._reasons.clear()
    ours, ref = pair(kind)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 1024, (2, 300), device="cuda", generator=g)
    with torch.no_grad():
        assert rel(ours(ids).logits, ref(ids).logits) < 2e-2
        mask = torch.ones_like(ids)
        mask[0, :37] = 0  # left padding: a bool mask per layer
        a, b = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
        assert rel(a[1], b[1]) < 2e-2 and rel(a[0, 37:], b[0, 37:]) < 2e-2
    for model in (ours, ref):
        model.train()
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
    worst = max(rel(p.grad, q.grad) for p, q in zip(ours.parameters(), ref.parameters()) if q.grad is not None)
    assert worst < 5e-2, f"largest relative gradient difference {worst:.3e}"
    for model in (ours, ref):
        model.eval()
    prompt = ids[:, :64]
    with torch.no_grad():
        out_a = ours.generate(prompt, max_new_tokens=24, do_sample=False)
        res_b = ref.generate(prompt, max_new_tokens=24, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    same_greedy_tokens(out_a, res_b, 64)
    assert gt.fallback_reasons() == {}, gt.fallback_reasons()


def test_sliding_window_layers_run_the_window(monkeypatch):
    """A Mistral-style model with a sliding window shorter than the sequence: logits and greedy
    generation match SDPA's, inference calls run fused_attention(window=(w - 1, 0)) (the mask matched
    the window's pattern), and a training step's gradients match, through the window where a backward
    runs it (Hopper's local backward instances), else through the mask."""
    from transformers import MistralConfig

    gt.register()
    calls = []
    real = gt.fused_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gt, "fused_attention", spy)
    gt._reasons.clear()
    cfg = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=1024, sliding_window=48)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(MistralConfig(**cfg), attn_implementation="sdpa").to("cuda", BF16)
    ours = AutoModelForCausalLM.from_config(MistralConfig(**cfg), attn_implementation="gemmgen").to("cuda", BF16)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 1024, (2, 300), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    with torch.no_grad():
        assert rel(ours(ids).logits, ref(ids).logits) < 2e-2
    assert calls and all(w == (47, 0) for w in calls), calls
    calls.clear()
    for model in (ours, ref):
        model.train()
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
    worst = max(rel(p.grad, q.grad) for p, q in zip(ours.parameters(), ref.parameters()) if q.grad is not None)
    assert worst < 5e-2 and calls
    cc = torch.cuda.get_device_capability()
    window_backward = any(c.entry.params.get("mask") == "local" and c.entry.family == "fmha_bwd_sm90"
                          and registry.build_reason(c, cc) is None for c in registry.load()[0])
    if window_backward:
        assert all(w == (47, 0) for w in calls), calls
    else:  # each layer tries the window, then runs the mask
        assert calls[1::2] == [None] * (len(calls) // 2), calls
    for model in (ours, ref):
        model.eval()
    with torch.no_grad():
        out_a = ours.generate(ids[:, :100], max_new_tokens=16, do_sample=False)
        res_b = ref.generate(ids[:, :100], max_new_tokens=16, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    same_greedy_tokens(out_a, res_b, 100)
    assert gt.fallback_reasons() == {}, gt.fallback_reasons()
