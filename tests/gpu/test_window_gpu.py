"""Sliding-window (local) attention on the GPU against the float64 reference: every built local
instance (fa2_sm80's, and fmha_sm90's on Hopper) forced by name, and the registry's own pick. Inputs
are fresh random tensors, a different seed per case; outputs are poisoned with NaN first, and NaN
never passes. Needs the local instances built (`gemmgen generate --arch sm80 --arch sm90` builds them
by default)."""
from __future__ import annotations

import pytest
import torch

import gemmgen
from gemmgen.generator.families.base import Mask
from gemmgen.kernels import launch
from gemmgen.ops.reference import attention_reference, causal_offset
from gemmgen.select import calls, registry

from test_attention_bwd_gpu import assert_close as assert_grad_close
from test_attention_bwd_gpu import make as make_grad_inputs
from test_attention_bwd_gpu import ref_grads
from test_fused_attention import TOLERANCE, make_qkv
from test_fused_attention import check as fused_check

pytestmark = pytest.mark.gpu

WINDOWS = [(0, 0), (16, 0), (100, 7), (-1, 33), (256, -1), (5, 5), (1000, 1000)]
LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 1000), (1000, 4097), (4097, 4097)]
ALIGNMENTS = ("top_left", "bottom_right")


def local_instances(head_dims=None) -> list[str]:
    """The built local forward instances without a softcap the GPU runs (their names), head dims in
    `head_dims` if given (none without a GPU: the module's tests are skipped there)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    names = []
    for cand in registry.load()[0]:
        try:
            inst = cand.instance
        except ValueError:
            continue
        if (getattr(inst, "mask", None) is not Mask.LOCAL or registry.family_named(inst.family).KIND != "attention"
                or getattr(inst, "softcap", False) or registry.build_reason(cand, cc) is not None):
            continue  # (a window with a softcap: test_softcap_gpu.py)
        if head_dims is None or inst.head_dim in head_dims:
            names.append(inst.name)
    return sorted(names)


def check(q, k, v, window, alignment="top_left", *, causal=False, instance=None):
    """test_fused_attention's check (NaN-poisoned out=, O and LSE against the float64 reference) with a window."""
    fused_check(q, k, v, causal=causal, alignment=alignment, window=window, instance=instance)


def runs(name: str, nq: int, nk: int) -> bool:
    """fmha_sm90's windows need every row's diagonal key: Nq <= Nk (either alignment)."""
    return not name.startswith("fmha_sm90") or nq <= nk


@pytest.mark.parametrize("name", local_instances() or ["(none built)"])
def test_every_local_instance(name):
    if name == "(none built)":
        pytest.fail("no local instance is built for this GPU")
    dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
    d = int(name.split("_d")[1].split("_")[0])
    for nq, nk in ((127, 129), (129, 127), (300, 300)):
        if not runs(name, nq, nk):
            continue
        for alignment in ALIGNMENTS:
            for window in ((16, 0), (100, 7), (-1, 33)):
                q, k, v = make_qkv(2, 4, 2, nq, nk, d, dtype, (name, nq, nk, alignment, window))
                check(q, k, v, window, alignment, instance=name)


@pytest.mark.parametrize("nq, nk", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("family", ["fa2_sm80", "fmha_sm90"])
def test_lengths_and_windows(family, window, nq, nk):
    names = [n for n in local_instances((64, 128)) if n.startswith(family)]
    if not names:
        pytest.skip(f"no {family} local instance built for this GPU")
    for name in names:
        if not runs(name, nq, nk):
            continue
        dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
        d = int(name.split("_d")[1].split("_")[0])
        b, h = (1, 2) if max(nq, nk) > 1000 else (2, 3)
        for alignment in ALIGNMENTS:
            q, k, v = make_qkv(b, h, h, nq, nk, d, dtype, (name, window, nq, nk, alignment))
            check(q, k, v, window, alignment, instance=name)


def test_registry_picks_a_local_instance_gqa_and_bnhd_views():
    """No instance forced: the registry picks a local instance (fmha_sm90's on Hopper where Nq <= Nk),
    for GQA 4:1 and MQA inputs read as [B, N, H, d] views; causal with a left window too."""
    hopper = torch.cuda.get_device_capability()[0] == 9
    for hkv in (2, 1):
        q = torch.randn(2, 777, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k, v = (torch.randn(2, 1031, hkv, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                for _ in range(2))
        for window, causal in (((64, 64), False), ((200, -1), True)):
            name = gemmgen.selected_instance(q, k, v, window=window, causal=causal, causal_alignment="bottom_right")
            assert "_local_" in name and (not hopper or name.startswith("fmha_sm90")), name
            check(q, k, v, window, "bottom_right", causal=causal)


def window_bias(nq, nk, window, alignment):
    """The window as an additive float64 mask [Nq, Nk] (0 visible, -inf hidden): the reference's rule."""
    off = causal_offset(nq, nk, alignment)
    rows = torch.arange(nq, device="cuda")[:, None]
    cols = torch.arange(nk, device="cuda")[None, :]
    left, right = window
    hidden = torch.zeros(nq, nk, dtype=torch.bool, device="cuda")
    if left >= 0:
        hidden |= cols < rows + off - left
    if right >= 0:
        hidden |= cols > rows + off + right
    return torch.zeros(nq, nk, dtype=torch.float64, device="cuda").masked_fill(hidden, float("-inf"))


def local_backward_instances() -> list[str]:
    """The built backward instances that run sliding windows without a softcap on this GPU (their
    names; the softcap ones: test_softcap_gpu.py): fmha_bwd_sm90's local ones, and fa2_bwd_sm80's,
    whose every instance reads the window (its params' "window" mark)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted({c.name for c in registry.load()[0]
                   if (c.entry.params.get("mask") == "local" or c.entry.params.get("window"))
                   and not c.entry.params.get("softcap")
                   and registry.family_named(c.entry.family).KIND == "attention_bwd"
                   and registry.build_reason(c, cc) is None})


BWD_LENGTHS = [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 1000), (200, 1000), (1000, 200)]


@pytest.mark.parametrize("name", local_backward_instances() or ["(none built)"])
def test_every_local_backward_instance(name):
    """Each built local backward instance forced by name: the forward (the registry's, with LSE),
    then the instance's dQ, dK, dV into NaN-poisoned buffers against float64 autograd, for seven
    windows, lengths 1 to 4097 with Nq != Nk, both alignments."""
    if name == "(none built)":
        pytest.fail("no backward instance that runs windows is built (fa2_bwd_sm80 is built by default)")
    cand = next(c for c in registry.load()[0] if c.name == name)
    dtype = launch.TORCH_DTYPES[cand.instance.dtype.value]
    d = cand.instance.head_dim
    cases = [(nq, nk, w) for nq, nk in BWD_LENGTHS for w in WINDOWS] + [(4097, 4097, (256, 0)), (4097, 4097, (64, 64))]
    for nq, nk, window in cases:
        for alignment in ALIGNMENTS:
            q, k, v, do = make_grad_inputs(2, 3, 3, nq, nk, d, dtype, (name, nq, nk, window, alignment))
            with torch.no_grad():
                o, lse = gemmgen.fused_attention(q, k, v, causal_alignment=alignment, window=window, return_lse=True)
            problem = calls.problem_for_bwd(q, k, False, causal_alignment=alignment, window=window)
            assert registry.reject_reason(cand, problem) is None, registry.reject_reason(cand, problem)
            dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
            p = launch.params_bwd(q, k, v, o, do, lse, dq, dk, dv, causal=False, causal_alignment=alignment,
                                  scale=None, window=window)
            launch.run_bwd(cand.kernel, p, q.get_device())
            torch.cuda.synchronize()
            want = ref_grads(q, k, v, do, bias=window_bias(nq, nk, window, alignment))
            for label, g, w in zip(("dQ", "dK", "dV"), (dq, dk, dv), want):
                assert_grad_close(f"{name} {nq}x{nk} {window} {alignment} {label}", g, w, dtype)


def local_backward_runs() -> bool:
    return torch.cuda.is_available() and bool(local_backward_instances())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("h, hkv, layout", [(4, 4, "bhnd"), (8, 2, "bnhd"), (4, 1, "bhnd")],
                         ids=["mha", "gqa4-bnhd", "mqa"])
def test_window_autograd(dtype, h, hkv, layout):
    """gemmgen.fused_attention(window=...) with inputs that require grad: dQ, dK, dV through autograd
    against float64, head dims 64 and 128 (and 32, padded to 64), causal windows and two-sided ones,
    both alignments, Nq != Nk; gradients come back in the inputs' layouts."""
    if not local_backward_runs():
        pytest.skip("no local backward instance runs on this GPU (test_window_backward_refusal covers it)")
    for d in (32, 64, 128):
        for (nq, nk), window, causal in (((300, 1000), (100, 7), False), ((1000, 300), (64, 0), True),
                                         ((257, 257), (16, 16), False), ((129, 4097), (-1, 33), False)):
            for alignment in ALIGNMENTS:
                key = ("autograd", dtype, h, hkv, layout, d, nq, nk, window, alignment)
                q, k, v, do = make_grad_inputs(2, h, hkv, nq, nk, d, dtype, key, layout)
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                o = gemmgen.fused_attention(*leaves, causal=causal, causal_alignment=alignment, window=window)
                o.backward(do)
                right = 0 if causal else window[1]
                want = ref_grads(q, k, v, do, bias=window_bias(nq, nk, (window[0], right), alignment))
                for label, t, w, x in zip(("dQ", "dK", "dV"), leaves, want, (q, k, v)):
                    assert_grad_close(f"d{d} {h}:{hkv} {layout} {nq}x{nk} {window} {alignment} {label}",
                                      t.grad, w, dtype)
                    assert t.grad.stride() == x.stride(), f"{label} is not in its input's layout"


def test_window_backward_refusal():
    """Where no backward runs a window (GPUs without fmha_bwd_sm90's local instances), inputs that
    require grad raise NoInstanceError at the forward, naming the mask; inference still runs."""
    if local_backward_runs():
        pytest.skip("a local backward runs on this GPU (test_window_autograd covers it)")
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    with pytest.raises(gemmgen.NoInstanceError, match="local"):
        gemmgen.fused_attention(q, k, v, window=(8, 8))
    with torch.no_grad():
        gemmgen.fused_attention(q, k, v, window=(8, 8))  # inference runs


def test_compiled_and_graphed():
    """torch.compile(fullgraph=True) and CUDA graph replay of a windowed call, against the reference."""
    q, k, v = (torch.randn(2, 4, 513, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    fn = torch.compile(lambda q, k, v: gemmgen.fused_attention(q, k, v, window=(32, 0)), fullgraph=True)
    ref, _ = attention_reference(q, k, v, window=(32, 0))
    o = fn(q, k, v)
    assert (o.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]
    gemmgen.fused_attention(q, k, v, window=(32, 0))  # selected outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemmgen.fused_attention(q, k, v, window=(32, 0))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, window=(32, 0))
    assert (out.double() - ref).norm() / ref.norm() <= TOLERANCE[torch.float16]


def decode_instances() -> list[str]:
    """The built decode_sm80 instances that read the window fields (their manifest params say so)."""
    if not torch.cuda.is_available():
        return []
    cc = torch.cuda.get_device_capability()
    return sorted({c.name for c in registry.load()[0] if c.entry.family == "decode_sm80"
                   and c.entry.params.get("window") and registry.build_reason(c, cc) is None})


@pytest.mark.parametrize("name", decode_instances() or ["(none built)"])
def test_decode_instances_run_windows(name):
    """decode_sm80 (decode-like dense calls: few query rows, GQA packed) forced by name: windows on
    both sides and one-sided, query rows 1 to 16 against 1 to 4097 keys, both alignments, GQA 4:1 and
    MHA, each call's split count as the registry plans it."""
    if name == "(none built)":
        pytest.fail("no decode_sm80 instance that reads the window fields is built for this GPU")
    dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
    d = int(name.split("_d")[1].split("_")[0])
    for nq, nk in ((1, 1), (1, 17), (1, 4097), (4, 1000), (16, 4097), (17, 300)):
        for window in ((255, 0), (16, 7), (-1, 3), (100, -1)):
            for alignment in ALIGNMENTS:
                for h, hkv in ((8, 2), (4, 4)):
                    q, k, v = make_qkv(2, h, hkv, nq, nk, d, dtype, (name, nq, nk, window, alignment, h))
                    check(q, k, v, window, alignment, instance=name)


def test_registry_gives_window_decode_steps_to_the_decode_family():
    """One query row against a long key range under a window: the decode family's pick."""
    q = torch.randn(4, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(4, 8, 8192, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    name = gemmgen.selected_instance(q, k, v, causal=True, causal_alignment="bottom_right", window=(4095, 0))
    assert name.startswith("decode_sm80"), name
    check(q, k, v, (4095, 0), "bottom_right", causal=True)
