"""Additive masks on fmha_sm90 (`_bias` instances: fused_attention(attn_mask=...) on Hopper) against
the float64 reference: every built `_bias` instance forced by name over odd lengths with Nq != Nk,
both causal alignments, GQA and MQA, scales default, 0.3, 1e-6 and 0 (the bias added to raw scores,
or to scaled ones below 2^-16), a logit softcap where the instance runs one, every mask form (float
masks with -inf entries, bool padding masks, broadcasts over batch, heads and rows, [Nq, Nk] masks,
strided views), rows that see no key (O = 0, LSE = -inf), the registry's picks, the gradients (the
backward of another family on the forward's O and LSE), torch.compile and a CUDA graph. Outputs are
poisoned with NaN first. Needs the `_bias` instances built (`gemmgen generate --arch sm90` builds
those of head dims 64, 128 and 256)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, registry

from test_fused_attention import TOLERANCE, check, make_qkv

pytestmark = pytest.mark.gpu

LENGTHS = [(1, 1), (1, 17), (17, 17), (127, 129), (129, 127), (1000, 4097), (4097, 1000)]
ALIGNMENTS = ("top_left", "bottom_right")


def bias_instances() -> list[str]:
    """The built fmha_sm90 `_bias` instances this GPU runs (none without a GPU: the tests fail there
    by name, so that a run that builds none cannot pass)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted({c.name for c in registry.load()[0] if c.entry.family == "fmha_sm90"
                   and c.entry.params.get("bias") and registry.build_reason(c, cc) is None})


def generator(key) -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.manual_seed(hash(repr(key)) % 2**31)
    return g


def masks(b, h, nq, nk, dtype, key):
    """The mask forms a call may pass (name, mask): float with -inf entries, full and broadcast; bool
    padding (left, per batch entry) and random; a [Nq, Nk] mask; a row broadcast; a strided view."""
    g = generator(key)
    full = torch.randn((b, h, nq, nk), generator=g, device="cuda").to(dtype) * 2
    full = full.masked_fill(torch.rand((b, h, nq, nk), generator=g, device="cuda") < 0.2, float("-inf"))
    pad = torch.arange(nk, device="cuda")[None, :] >= (torch.arange(b, device="cuda")[:, None] * 7) % max(nk, 1)
    padding = pad[:, None, None, :]  # [B, 1, 1, Nk] bool: left padding, each row of a batch entry alike
    keep = torch.rand((b, 1, nq, nk), generator=g, device="cuda") > 0.3
    wide = torch.randn((h, nq, nk + 8), generator=g, device="cuda").to(dtype)[..., 3:nk + 3]  # rows 2 apart
    causal = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)  # bottom-right diagonal
    return [("float", full), ("float-batch-broadcast", full[:1]), ("bool-padding", padding),
            ("bool-random", keep), ("float-2d", full[0, 0]), ("float-rows-strided", wide),
            ("bool-row-broadcast", padding.expand(b, 1, nq, nk)), ("bool-causal-padding", causal & padding)]


def check_bias(q, k, v, mask, *, causal, alignment, scale, instance=None, softcap=0.0):
    """O (into a NaN-poisoned out=) and LSE against the float64 reference of the mask as a bias (and
    of the logit softcap, where given)."""
    check(q, k, v, causal=causal, alignment=alignment, scale=scale, softcap=softcap, attn_mask=mask, instance=instance)


@pytest.mark.parametrize("name", bias_instances() or ["(none built)"])
def test_every_bias_instance(name):
    """Each `_bias` instance forced by name over the lengths, alignments, scales and mask forms (those
    shared by heads or batch entries have their tiles sorted, the others not); the calls it refuses
    (causal with Nq > Nk) left out, the rest counted."""
    if name == "(none built)":
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    cand = next(c for c in registry.load()[0] if c.name == name)
    family = registry.family_named(cand.entry.family)
    dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
    d = int(name.split("_d")[1].split("_")[0])
    causal = "_causal_" in name
    softcap = 30.0 if "_sc_" in name else 0.0  # (a `_sc_bias` instance runs capped calls only)
    ran = 0
    for nq, nk in LENGTHS:
        long = max(nq, nk) > 1000
        b, h, hkv = (1, 2, 1) if long else (2, 4, 2)
        for alignment in ALIGNMENTS:
            for scale in (None, 0.3, 1e-6, 0.0):
                q, k, v = make_qkv(b, h, hkv, nq, nk, d, dtype, (name, nq, nk, alignment, scale))
                if softcap:
                    q, k = q * 3, k * 3  # scores past the cap
                problem = calls.problem_for(q, k, causal, v=v, causal_alignment=alignment, scale=scale, bias=True,
                                            softcap=bool(softcap))
                if registry.functional_reason(family, cand.instance, problem) is not None:
                    continue
                for form, mask in masks(b, h, nq, nk, dtype, (name, nq, nk)):
                    if long and form not in ("float", "bool-padding", "bool-causal-padding"):
                        continue
                    try:
                        check_bias(q, k, v, mask, causal=causal, alignment=alignment, scale=scale, instance=name,
                                   softcap=softcap)
                    except AssertionError as e:
                        raise AssertionError(f"{form} nq={nq} nk={nk} {alignment} scale={scale}: {e}") from None
                    ran += 1
    assert ran >= (45 if causal else 70), ran


def test_rows_without_keys_are_zero():
    """A row whose mask hides every key gives O = 0 and LSE = -inf (a bool row of False, a float
    row of -inf, whole row tiles), also where the first key tiles of a row are hidden and later ones
    are not."""
    if not bias_instances():
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    q, k, v = make_qkv(2, 4, 4, 300, 700, 128, torch.bfloat16, "empty-rows")
    keep = torch.ones((2, 1, 300, 700), dtype=torch.bool, device="cuda")
    keep[:, :, 5] = False  # no key
    keep[:, :, 6, :600] = False  # keys in the last tiles only
    keep[1, :, 7, 1:] = False  # key 0 only
    keep[:, :, 64:128, :256] = False  # a row group's first key tiles hidden, the later ones seen
    keep[:, :, 128:256] = False  # whole row tiles without a key (their key tiles skipped)
    keep[0, :, 256:, 300:] = False  # the last key tiles hidden to the last rows (listed, not seen)
    name = gemmgen.selected_instance(q, k, v, attn_mask=keep)
    assert name.startswith("fmha_sm90_") and name.endswith("_bias"), name
    check_bias(q, k, v, keep, causal=False, alignment="top_left", scale=None)
    o = gemmgen.fused_attention(q, k, v, attn_mask=keep)
    assert (o[:, :, 5] == 0).all()


def test_a_mask_changed_in_place_between_calls():
    """A bool mask's kernel copy is kept per mask version: calls after an in-place change (a row
    hidden, then a slice refilled) see the new mask, calls between changes the kept copy."""
    if not bias_instances():
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    q, k, v = make_qkv(2, 4, 2, 129, 300, 128, torch.bfloat16, "in-place")
    mask = torch.rand((2, 1, 129, 300), device="cuda") > 0.3
    for change in (None, lambda m: m[:, :, 7].fill_(False), lambda m: m[1, :, 64:].copy_(~m[1, :, 64:])):
        if change is not None:
            change(mask)
        for _ in range(2):
            check_bias(q, k, v, mask, causal=False, alignment="top_left", scale=None)


def test_registry_picks_bias_instances_for_masked_calls_only():
    if not bias_instances():
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    for d in (64, 128, 256):
        q, k, v = make_qkv(1, 8, 2, 300, 700, d, torch.bfloat16, ("pick", d))
        mask = torch.rand(300, 700, device="cuda") > 0.1
        for causal in (False, True):
            masked = gemmgen.selected_instance(q, k, v, causal=causal, causal_alignment="bottom_right",
                                               attn_mask=mask)
            plain = gemmgen.selected_instance(q, k, v, causal=causal, causal_alignment="bottom_right")
            assert masked.startswith("fmha_sm90_") and masked.endswith("_bias"), masked
            assert not plain.endswith("_bias"), plain
            check_bias(q, k, v, mask, causal=causal, alignment="bottom_right", scale=None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gradients_through_a_masked_forward(dtype):
    """Training with a mask: the forward on a `_bias` instance, the backward (a family that runs
    masks) from its O and LSE; dQ, dK, dV and the float mask's gradient against float64 autograd."""
    if not bias_instances():
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 129, 200, 128, dtype, ("grad", dtype)))
    mask = (torch.randn((1, 4, 129, 200), device="cuda") * 0.5).to(dtype)
    mask[:, :, 3, :150] = float("-inf")  # row 3: its first key tile hidden, later keys seen
    mask.requires_grad_()
    assert gemmgen.selected_instance(q, k, v, attn_mask=mask).endswith("_bias")
    o = gemmgen.fused_attention(q, k, v, attn_mask=mask)
    do = torch.randn_like(o)
    o.backward(do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, mask)]
    ref, _ = attention_reference(*leaves[:3], False, "top_left", None, bias=leaves[3])
    ref.backward(do.double())
    for name, got, want in zip(("dQ", "dK", "dV", "dMask"), (q.grad, k.grad, v.grad, mask.grad), leaves):
        want = want.grad
        finite = torch.isfinite(want)
        err = (got.double()[finite] - want[finite]).norm() / want[finite].norm()
        assert err <= 3 * TOLERANCE[dtype], f"{name}: relative error {err:.3e}"


def test_compile_and_graph_replay():
    """torch.compile(fullgraph=True) and a CUDA graph replaying a masked call with new inputs."""
    if not bias_instances():
        pytest.fail("no fmha_sm90 `_bias` instance is built for this GPU")
    q, k, v = make_qkv(2, 4, 4, 257, 300, 64, torch.float16, "graph")
    mask = torch.rand((2, 1, 257, 300), device="cuda") > 0.2

    def f(q, k, v, mask):
        return gemmgen.fused_attention(q, k, v, attn_mask=mask, causal=True, causal_alignment="bottom_right")

    compiled = torch.compile(f, fullgraph=True)
    bias = torch.zeros((), dtype=torch.float64, device="cuda").masked_fill(~mask, float("-inf"))
    ref, _ = attention_reference(q, k, v, True, "bottom_right", None, bias=bias)
    got = compiled(q, k, v, mask)
    assert (got.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]

    static = [t.clone() for t in (q, k, v)]
    f(*static, mask)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*static, mask)
    fresh = make_qkv(2, 4, 4, 257, 300, 64, torch.float16, "graph-2")
    for s, t in zip(static, fresh):
        s.copy_(t)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(*fresh, True, "bottom_right", None, bias=bias)
    assert (out.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]
    # The mask changed in place between replays: the replay converts it again.
    mask[:, :, 100:].copy_(torch.rand((2, 1, 157, 300), device="cuda") > 0.6)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    bias = torch.zeros((), dtype=torch.float64, device="cuda").masked_fill(~mask, float("-inf"))
    ref, _ = attention_reference(*fresh, True, "bottom_right", None, bias=bias)
    assert torch.isfinite(out).all(), "every element written (a row the mask hides whole is 0)"
    assert (out.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]
