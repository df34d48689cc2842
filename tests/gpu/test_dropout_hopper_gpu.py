"""Dropout on Hopper: fmha_sm90's `_dropout` forward and fmha_bwd_sm90's `_dropout` backward
against references computed apart from the kernels. Every built forward instance, forced by name,
draws exactly the mask tests/philox_mask.py computes on the host (read back with identity V columns)
over odd lengths with Nq != Nk, GQA and MQA, both causal alignments, seeds past 2^32 and odd and
counter-aligned offsets; O (into a NaN-poisoned out=) and LSE against the float64 reference with
that mask; the kept fraction; mea_sm80's mask for the same (seed, offset) where that family is
built; the registry's picks. Every built backward instance, forced by name, gives dQ, dK and dV
(NaN-poisoned first) of the host mask against float64 over the same shapes; training through
autograd (the registry's forward and backward, deterministic too); torch.manual_seed
reproducibility; the refusal past 2^31 weights per head. Needs the `_dropout` instances built
(`gemmgen generate --arch sm90` builds those of head dims 64 and 128 in both families)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.select import calls, registry, selection

from philox_mask import keep_mask as host_keep_mask
from test_attention_bwd_gpu import assert_close, make, ref_grads
from test_fused_attention import TOLERANCE, make_qkv
from test_mea_gpu import keep_mask as kernel_keep_mask
from test_mea_gpu import reference, rel_err

pytestmark = pytest.mark.gpu

P, SEED, OFFSET = 0.2, 2**33 + 5, 1001
# (batch, heads, K/V heads, Nq, Nk, causal alignments run: causal needs Nq <= Nk here)
SHAPES = [(2, 3, 3, 129, 127, ()), (1, 4, 2, 127, 300, ("top_left", "bottom_right")),
          (1, 2, 1, 1, 17, ("top_left", "bottom_right")), (2, 2, 2, 17, 17, ("top_left",)),
          (1, 2, 2, 200, 1000, ("bottom_right",))]


def dropout_instances(family: str = "fmha_sm90") -> list[str]:
    """The built `_dropout` instances of `family` this GPU runs (none without a GPU: the tests fail
    by name there, so that a run that builds none cannot pass)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted({c.name for c in registry.load()[0] if c.entry.family == family
                   and c.entry.params.get("dropout") and registry.build_reason(c, cc) is None})


def facts(name: str) -> tuple[torch.dtype, int, bool]:
    inst = next(c for c in registry.load()[0] if c.name == name).entry.params
    return ({"fp16": torch.float16, "bf16": torch.bfloat16}[inst["dtype"]], inst["head_dim"],
            inst["mask"] == "causal")


def cases(name):
    """(q, k, v, causal, alignment) of every shape this instance runs."""
    dtype, d, causal = facts(name)
    for b, h, hkv, nq, nk, alignments in SHAPES:
        for alignment in (alignments if causal else ("top_left",)):
            q, k, v = make_qkv(b, h, hkv, nq, nk, d, dtype, ("drop", name, nq, nk, alignment))
            yield q, k, v, causal, alignment


def visible(nq, nk, causal, alignment):
    """[Nq, Nk] bool: the weights the mask leaves."""
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool)
    off = 0 if alignment == "top_left" else nk - nq
    return torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + off


@pytest.mark.parametrize("name", dropout_instances() or ["<none built>"])
def test_every_instance_draws_the_host_mask(name):
    if name == "<none built>":
        pytest.fail("no fmha_sm90 `_dropout` instance is built for this GPU")
    # An odd offset, and one that starts every row on a Philox counter where Nk is a multiple of 4.
    for (q, k, v, causal, alignment), offset in ((case, offset) for case in cases(name) for offset in (OFFSET, 4000)):
        b, h, nq, _ = q.shape
        nk = k.shape[2]
        got = kernel_keep_mask(q, k, p=P, seed=SEED, offset=offset, name=name, causal=causal,
                               alignment=alignment).cpu()
        want = host_keep_mask(b, h, nq, nk, P, SEED, offset)
        seen = visible(nq, nk, causal, alignment).expand_as(want)
        wrong = (got != want) & seen
        assert not wrong.any(), (f"{name} {tuple(q.shape)} Nk {nk} {alignment} offset {offset}: "
                                 f"{int(wrong.sum())} weights differ")
        assert not (got & ~seen).any()  # masked weights stay 0
        out = torch.full_like(q, float("nan"))
        o, lse = gemmgen.fused_attention(q, k, v, dropout_p=P, seed=SEED, offset=offset, causal=causal,
                                         causal_alignment=alignment, instance=name, out=out, return_lse=True)
        ref, ref_lse = reference(q, k, v, keep=want.to(q.device), p=P, causal=causal, alignment=alignment)
        assert not torch.isnan(o).any()
        assert rel_err(o, ref) <= TOLERANCE[q.dtype], (name, tuple(q.shape), alignment)
        # LSE is of the weights before dropout.
        assert ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item() <= 1e-3


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction(p):
    names = [n for n in dropout_instances() if not facts(n)[2]]
    if not names:
        pytest.fail("no fmha_sm90 `_dropout` instance without a mask is built for this GPU")
    dtype, d, _ = facts(names[0])
    q, k, _ = make_qkv(2, 4, 4, 1000, 1000, d, dtype, ("frac", p))
    keep = kernel_keep_mask(q, k, p=p, seed=99, offset=0, name=names[0])
    frac = keep.float().mean().item()  # 8M weights
    assert abs(frac - (1 - p)) <= 0.01 * (1 - p), frac


def test_same_mask_as_mea_sm80():
    from gemmgen.generator.families import mea_sm80
    built = {c.name for c in registry.load()[0] if c.entry.state == "built"}
    ran = 0
    for name in dropout_instances():
        dtype, d, causal = facts(name)
        mea = next((i.name for i in mea_sm80.DEFAULT if i.dtype.value == {torch.float16: "fp16",
                    torch.bfloat16: "bf16"}[dtype] and i.max_head_dim >= d and i.name in built), None)
        if mea is None:
            continue
        for q, k, v, causal, alignment in cases(name):
            ours = kernel_keep_mask(q, k, p=P, seed=SEED, offset=OFFSET, name=name, causal=causal, alignment=alignment)
            theirs = kernel_keep_mask(q, k, p=P, seed=SEED, offset=OFFSET, name=mea, causal=causal,
                                      alignment=alignment)
            assert torch.equal(ours, theirs), (name, mea, tuple(q.shape), alignment)
        ran += 1
    if not ran:
        pytest.skip("no mea_sm80 instance built beside the `_dropout` ones (gemmgen generate --family mea_sm80)")


def test_registry_picks_dropout_instances_for_dropout_calls_only():
    if not dropout_instances():
        pytest.fail("no fmha_sm90 `_dropout` instance is built for this GPU")
    for d in sorted({facts(n)[1] for n in dropout_instances()}):
        q, k, v = make_qkv(2, 8, 2, 300, 700, d, torch.bfloat16, ("pick", d))
        for causal in (False, True):
            dropped = gemmgen.selected_instance(q, k, v, causal=causal, causal_alignment="bottom_right", dropout_p=0.1)
            plain = gemmgen.selected_instance(q, k, v, causal=causal, causal_alignment="bottom_right")
            assert dropped.startswith("fmha_sm90_") and dropped.endswith("_dropout"), dropped
            assert not plain.endswith("_dropout"), plain


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gradients_through_a_dropout_forward(dtype):
    names = [n for n in dropout_instances() if facts(n)[0] == dtype and facts(n)[2]]
    if not names:
        pytest.fail(f"no causal fmha_sm90 `_dropout` instance in {dtype} is built for this GPU")
    for name in names:
        _, d, _ = facts(name)
        q, k, v = make_qkv(1, 4, 2, 100, 130, d, dtype, ("grad", name))
        do = torch.randn_like(q)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = gemmgen.fused_attention(*leaves, causal=True, causal_alignment="bottom_right", dropout_p=P, seed=11,
                                    offset=3, instance=name)
        o.backward(do)
        keep = host_keep_mask(1, 4, 100, 130, P, 11, 3).to(q.device)
        want = ref_grads(q, k, v, do, keep=keep, p=P, causal=True, alignment="bottom_right")
        for label, g, w in zip(("dQ", "dK", "dV"), [t.grad for t in leaves], want):
            assert_close(f"{name} {label}", g, w, dtype)


def test_seed_drawn_from_torch_generator():
    if not dropout_instances():
        pytest.fail("no fmha_sm90 `_dropout` instance is built for this GPU")
    name = dropout_instances()[0]
    dtype, d, causal = facts(name)
    q, k, v = make_qkv(2, 3, 3, 129, 300, d, dtype, "seed")
    torch.manual_seed(3)
    a = gemmgen.fused_attention(q, k, v, dropout_p=0.3, causal=causal, instance=name)
    b = gemmgen.fused_attention(q, k, v, dropout_p=0.3, causal=causal, instance=name)
    torch.manual_seed(3)
    assert torch.equal(a, gemmgen.fused_attention(q, k, v, dropout_p=0.3, causal=causal, instance=name))
    assert not torch.equal(a, b)  # the generator advanced
    assert torch.equal(gemmgen.fused_attention(q, k, v, dropout_p=0.0, causal=causal),
                       gemmgen.fused_attention(q, k, v, causal=causal))


def test_more_than_two_to_the_31_weights_per_head_are_refused():
    if not dropout_instances():
        pytest.fail("no fmha_sm90 `_dropout` instance is built for this GPU")
    name = dropout_instances()[0]
    dtype, d, causal = facts(name)
    q = torch.zeros(1, 1, 46341, d, dtype=dtype, device="cuda")  # 46341^2 > 2^31
    with pytest.raises(gemmgen.NoInstanceError, match="2\\^31"):
        gemmgen.fused_attention(q, q, q, dropout_p=0.1, causal=causal, instance=name)


# The backward (fmha_bwd_sm90 `_dropout`).
@pytest.mark.parametrize("name", dropout_instances("fmha_bwd_sm90") or ["<none built>"])
def test_every_backward_instance_uses_the_host_mask(name):
    if name == "<none built>":
        pytest.fail("no fmha_bwd_sm90 `_dropout` instance is built for this GPU")
    cand = next(c for c in registry.load()[0] if c.name == name)
    dtype, d, causal = facts(name)
    for b, h, hkv, nq, nk, alignments in SHAPES:
        for alignment in (alignments if causal else ("top_left",)):
            for offset in (OFFSET, 4000):
                q, k, v, do = make(b, h, hkv, nq, nk, d, dtype, ("bwd-drop", name, nq, nk, alignment))
                with torch.no_grad():
                    o, lse = gemmgen.fused_attention(q, k, v, causal=causal, causal_alignment=alignment,
                                                     dropout_p=P, seed=SEED, offset=offset, return_lse=True)
                dq = torch.full_like(q, float("nan"))
                dk, dv = (torch.full((b, h, nk, d), float("nan"), dtype=dtype, device="cuda") for _ in range(2))
                p = launch.params_bwd(q, k, v, o, do, lse, dq, dk, dv, causal=causal, causal_alignment=alignment,
                                      scale=None, dropout_p=P, seed=SEED, offset=offset)
                launch.run_bwd(cand.kernel, p, q.get_device())
                keep = host_keep_mask(b, h, nq, nk, P, SEED, offset).to(q.device)
                want = ref_grads(q, k, v, do, keep=keep, p=P, causal=causal, alignment=alignment)
                g = h // hkv  # dK and dV come back per query head: summed over each group
                got = (dq, dk.unflatten(1, (hkv, g)).sum(2), dv.unflatten(1, (hkv, g)).sum(2))
                for label, gt, w in zip(("dQ", "dK", "dV"), got, want):
                    assert_close(f"{name} {label} {(b, h, hkv, nq, nk)} {alignment} offset {offset}", gt, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_training_runs_both_hopper_families(dtype, deterministic):
    if not dropout_instances("fmha_bwd_sm90"):
        pytest.fail("no fmha_bwd_sm90 `_dropout` instance is built for this GPU")
    for d in sorted({facts(n)[1] for n in dropout_instances("fmha_bwd_sm90")}):
        q, k, v, do = make(2, 4, 2, 300, 300, d, dtype, ("train", d))
        problem = calls.problem_for_bwd(q, launch.expanded_layout(k, 2, "meta"), True, dropout=True,
                                        deterministic=deterministic)
        assert selection.select(problem).name.startswith("fmha_bwd_sm90_"), selection.select(problem).name
        assert gemmgen.selected_instance(q, k, v, causal=True, dropout_p=P).endswith("_dropout")
        grads = []
        for _ in range(2):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = gemmgen.fused_attention(*leaves, causal=True, dropout_p=P, seed=7, offset=12,
                                        deterministic=deterministic)
            o.backward(do)
            grads.append([t.grad for t in leaves])
        keep = host_keep_mask(2, 4, 300, 300, P, 7, 12).to(q.device)
        want = ref_grads(q, k, v, do, keep=keep, p=P, causal=True)
        for label, g, w in zip(("dQ", "dK", "dV"), grads[0], want):
            assert_close(f"d{d} {label}", g, w, dtype)
        if deterministic:
            assert all(torch.equal(a, b) for a, b in zip(*grads))
