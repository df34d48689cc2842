"""fused_attention on the GPU against the float64 reference (needs the default set built into ./build:
`gemmgen generate --arch sm80`). Inputs are fresh random tensors, a different seed per case; outputs
are poisoned with NaN first, and NaN never passes."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import gemmgen
from gemmgen.ops.reference import attention_reference
from gemmgen.select import registry
from gemmgen.generator.space import supported_head_dims

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # ||O - ref|| / ||ref||
LSE_TOLERANCE = 1e-3  # relative, where the reference is finite
MASKS = [(False, "top_left"), (True, "top_left"), (True, "bottom_right")]
MASK_IDS = ["none", "causal-top-left", "causal-bottom-right"]
LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 17), (127, 129), (129, 127), (1000, 1000), (1000, 17),
           (17, 1000), (4097, 4097), (4097, 1000), (1000, 4097)]


def randn(shape, dtype, key) -> torch.Tensor:
    """Standard normal values on the GPU from a seed derived from `key` (a different one per case)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, dtype=dtype, device="cuda", generator=gen)


def make_qkv(b, h, hkv, nq, nk, d, dtype, key):
    return (randn((b, h, nq, d), dtype, (key, "q")), randn((b, hkv, nk, d), dtype, (key, "k")),
            randn((b, hkv, nk, d), dtype, (key, "v")))


def check(q, k, v, *, causal=False, alignment="top_left", scale=None, window=None, softcap=0.0, attn_mask=None,
          **kwargs):
    """Run with a NaN-poisoned out= buffer and compare O and LSE with the float64 reference (of the
    sliding window, the logit softcap and the attention mask too, where given)."""
    out = torch.full_like(q, float("nan"))
    o, lse = gemmgen.fused_attention(q, k, v, causal=causal, causal_alignment=alignment, scale=scale,
                                     return_lse=True, out=out, window=window, softcap=softcap, attn_mask=attn_mask,
                                     **kwargs)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()
    bias = None if attn_mask is None else attn_mask.double() if attn_mask.dtype != torch.bool else \
        torch.zeros((), dtype=torch.float64, device=q.device).masked_fill(~attn_mask, float("-inf"))
    ref_o, ref_lse = attention_reference(q, k, v, causal, alignment, scale, window=window, softcap=softcap, bias=bias)
    assert not torch.isnan(o).any(), "unwritten or NaN output elements"
    ref_norm = ref_o.norm().item()
    err = (o.double() - ref_o).norm().item() / ref_norm if ref_norm else o.double().norm().item()
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "LSE must be -inf exactly where no key is seen"
    assert torch.equal(o[empty], torch.zeros_like(o[empty])), "rows that see no key must be 0"
    finite = ~empty
    lse_err = ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[finite]
    assert lse_err.numel() == 0 or lse_err.max().item() <= LSE_TOLERANCE
    return o


# The head dims of the default families' tiles, and three that only mea_sm80's bounded instances
# serve (built by `--family mea_sm80`, else compiled on demand).
HEAD_DIMS = sorted({32, 64, 96, 128, 160, 192, 256, 40, 80, 200} & set(supported_head_dims()))


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_head_dim_dtype_mask(head_dim, dtype, mask):
    causal, alignment = mask
    for nq, nk in ((129, 127), (127, 129)):
        q, k, v = make_qkv(2, 3, 3, nq, nk, head_dim, dtype, (head_dim, dtype, mask, nq))
        check(q, k, v, causal=causal, alignment=alignment)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.bfloat16, 128)], ids=["fp16-d64", "bf16-d128"])
@pytest.mark.parametrize("nq, nk", LENGTHS)
def test_lengths(nq, nk, dtype, head_dim, mask):
    b, h = (1, 2) if max(nq, nk) > 1000 else (2, 3)
    q, k, v = make_qkv(b, h, h, nq, nk, head_dim, dtype, ("len", nq, nk, dtype, mask))
    check(q, k, v, causal=mask[0], alignment=mask[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_bnhd_storage_and_layout_of_o(dtype):
    """[B, N, H, d] storage passed as transpose(1, 2) views; O comes back in the same storage order."""
    q, k, v = (randn((2, n, 4, 64), dtype, ("bnhd", n, dtype)).transpose(1, 2) for n in (129, 200, 200))
    o = gemmgen.fused_attention(q, k, v, causal=True)
    assert o.shape == q.shape and o.stride() == q.stride()
    check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_strided_views(dtype):
    """Slices of a wider last dim (row stride 2d), and K/V as [B, N, H, 2d] slices."""
    d = 64
    q = randn((2, 3, 129, 2 * d), dtype, ("slice-q", dtype))[..., :d]
    kv = randn((2, 127, 3, 2 * d), dtype, ("slice-kv", dtype))
    k, v = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    o = check(q, k, v, causal=True, alignment="bottom_right")
    assert o.is_contiguous()  # q is not dense: O gets q's dim order, packed
    o = gemmgen.fused_attention(q, k, v)
    assert o.is_contiguous()


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_gqa_mqa(hkv, mask):
    q, k, v = make_qkv(2, 8, hkv, 129, 300, 128, torch.bfloat16, ("gqa", hkv, mask))
    check(q, k, v, causal=mask[0], alignment=mask[1])


@pytest.mark.parametrize("scale", [0.3, -0.7, 0.0, 2.0])
def test_scale(scale):
    q, k, v = make_qkv(2, 3, 3, 129, 127, 64, torch.float16, ("scale", scale))
    check(q, k, v, causal=True, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fully_masked_rows(dtype):
    """Bottom-right causal with Nq > Nk: the first Nq - Nk rows see no key: O exactly 0, LSE -inf."""
    q, k, v = make_qkv(2, 3, 3, 129, 17, 64, dtype, ("masked", dtype))
    o = check(q, k, v, causal=True, alignment="bottom_right")
    assert torch.equal(o[:, :, :112], torch.zeros_like(o[:, :, :112]))
    _, lse = gemmgen.fused_attention(q, k, v, causal=True, causal_alignment="bottom_right", return_lse=True)
    assert torch.isneginf(lse[:, :, :112]).all() and torch.isfinite(lse[:, :, 112:]).all()


def test_batch_heads_above_grid_limit():
    q, k, v = make_qkv(300, 250, 250, 3, 5, 32, torch.float16, "grid")  # 75000 > 65535 (grid.y)
    check(q, k, v, causal=True)


def test_empty_sizes():
    q, k, v = make_qkv(2, 3, 3, 17, 0, 64, torch.float16, "empty")
    o, lse = gemmgen.fused_attention(q, k, v, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    q, k, v = make_qkv(0, 3, 3, 17, 17, 64, torch.float16, "empty-b")
    assert gemmgen.fused_attention(q, k, v).shape == q.shape


def test_side_stream_and_cuda_graph():
    q, k, v = make_qkv(2, 4, 4, 257, 257, 64, torch.float16, "graph")
    want = gemmgen.fused_attention(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_side = gemmgen.fused_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(on_side, want)
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemmgen.fused_attention(q, k, v, causal=True, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("shape", [(2, 8, 2, 33, 65, 64), (1, 32, 8, 1, 256, 128), (3, 4, 4, 129, 127, 128)],
                         ids=["gqa-odd", "decode-shaped", "mha-odd"])
def test_repeated_calls_of_one_signature(shape):
    """Calls of one signature back to back (the eager fast path reuses the first call's checks and
    launch params): fresh data and a fresh O every time, with and without LSE and out=, each
    against the reference; a view of the same signature whose data pointer is misaligned raises."""
    b, h, hkv, nq, nk, d = shape
    for step in range(3):
        q, k, v = make_qkv(b, h, hkv, nq, nk, d, torch.bfloat16, ("repeat", shape, step))
        check(q, k, v, causal=True, alignment="bottom_right")
        o, lse = gemmgen.fused_attention(q, k, v, causal=True, causal_alignment="bottom_right", return_lse=True)
        ref_o, ref_lse = attention_reference(q, k, v, True, "bottom_right", None)
        assert not torch.isnan(o).any()
        err = (o.double() - ref_o).norm().item() / max(ref_o.norm().item(), 1e-30)
        assert err <= TOLERANCE[q.dtype], f"step {step}: relative error {err:.3e}"
        finite = ~torch.isneginf(ref_lse)
        assert ((lse.double() - ref_lse).abs()[finite] / ref_lse.abs()[finite].clamp_min(1.0)).max() <= LSE_TOLERANCE
        assert torch.equal(gemmgen.fused_attention(q, k, v, causal=True, causal_alignment="bottom_right"), o)
    store = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    with pytest.raises(gemmgen.InputError, match="q's data pointer is not 16-byte aligned"):
        gemmgen.fused_attention(store[1:q.numel() + 1].view(q.shape), k, v, causal=True,
                                causal_alignment="bottom_right")


def test_calls_without_backward_refuse_inputs_that_require_grad():
    """fused_attention(out=) has no backward: it refuses inputs that require grad at the forward (the
    public function and the torch op called directly) instead of leaving their gradients None, and
    runs under no_grad."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "grad"))
    with pytest.raises(gemmgen.InputError, match="out= has no backward pass: q, k, v require grad"):
        gemmgen.fused_attention(q, k, v, out=torch.empty_like(q))
    with pytest.raises(gemmgen.InputError, match="no backward pass: q, k, v require grad"):
        torch.ops.gemmgen.fused_attention_out(q, k, v, torch.empty_like(q))
    assert q.grad is None
    with torch.no_grad():
        check(q.detach(), k, v)
    check(q.detach(), k.detach(), v.detach())


def test_selection_and_forced_instance():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16, "select")
    name = gemmgen.selected_instance(q, k, v, causal=True)
    # Any family may win (which are built decides); the winner must be one that can run the call.
    from gemmgen.select import calls, registry
    assert name in {c.name for c in registry.candidates(calls.problem_for(q, k, True, v=v))[0]}
    assert name.startswith(("fa2_sm80_fp16_d64_causal_", "fmha_sm90_fp16_d64_causal_", "mea_sm80_fp16_",
                            "decode_sm80_fp16_d64_"))
    check(q, k, v, causal=True, instance=name)
    with pytest.raises(gemmgen.InputError, match="no instance named"):
        gemmgen.fused_attention(q, k, v, instance="no_such_instance")


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = make_qkv(1, 2, 2, 33, 33, 96, torch.bfloat16, "default-scale")
    default = gemmgen.fused_attention(q, k, v)
    explicit = gemmgen.fused_attention(q, k, v, scale=1 / math.sqrt(96))
    assert torch.equal(default, explicit)


def test_every_built_instance():
    """Every built instance (all tiles and pipeline stages, not only the defaults) on odd lengths; the
    sliding-window ones in test_window_gpu.py, the softcap ones in test_softcap_gpu.py."""
    from gemmgen.select import registry
    built = [c.entry for c in registry.load()[0] if c.entry.state == "built" and c.entry.family == "fa2_sm80"
             and c.entry.params.get("mask") != "local" and not c.entry.params.get("softcap")]
    assert built, "no built instance: run `gemmgen generate --arch sm80`"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for entry in built:
        params = entry.params
        causal = params["mask"] == "causal"
        for nq, nk in ((129, 250), (250, 129)):
            q, k, v = make_qkv(1, 2, 2, nq, nk, params["head_dim"], dtypes[params["dtype"]], (entry.name, nq))
            try:
                check(q, k, v, causal=causal, alignment="bottom_right" if causal else "top_left",
                      instance=entry.name)
            except AssertionError as e:
                raise AssertionError(f"{entry.name} at Nq={nq} Nk={nk}: {e}") from None


# ---- head dims without tiles: run padded (gemmgen.ops.padding) ------------------------------------
# 1, 59 and 111 are not multiples of 8: no family could run them unpadded.

@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("head_dim", [1, 40, 59, 80, 111, 224])
def test_head_dims_without_tiles_run_padded(head_dim, mask):
    causal, alignment = mask
    for dtype, (nq, nk) in ((torch.bfloat16, (129, 127)), (torch.float16, (127, 129))):
        q, k, v = make_qkv(2, 4, 2, nq, nk, head_dim, dtype, ("pad", head_dim, mask, nq))  # GQA 2:1
        o_out = check(q, k, v, causal=causal, alignment=alignment)  # into a NaN-poisoned out=
        o = gemmgen.fused_attention(q, k, v, causal=causal, causal_alignment=alignment)
        assert o.shape == q.shape and o.stride() == q.stride()
        assert torch.equal(o, o_out)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("head_dim", [59, 80, 96])
def test_head_dims_without_tiles_backward(head_dim, alignment):
    """dQ, dK, dV of a padded call through autograd: [B, N, H, d] views, GQA 4:1, causal with
    Nq != Nk, against the float64 reference. 80 runs its forward at 96, and 96 (a forward tile) its
    backward at 128 on Hopper where fmha_bwd_sm90 is built and runs the mask (top-left; it has
    bottom-right only at Nq = Nk): selection weighs it above mea_bwd_sm80 at 96."""
    from test_attention_bwd_gpu import assert_close as assert_grad_close
    from gemmgen.ops import torch_op

    dtype = torch.bfloat16
    bases = [randn((2, n, h, head_dim), dtype, ("padbwd", head_dim, name)).requires_grad_()
             for name, n, h in (("q", 100, 8), ("k", 130, 2), ("v", 130, 2))]
    do = randn((2, 8, 100, head_dim), dtype, ("padbwd", head_dim, "do"))
    o = gemmgen.fused_attention(*(t.transpose(1, 2) for t in bases), causal=True, causal_alignment=alignment)
    o.backward(do)
    leaves = [t.detach().double().requires_grad_() for t in bases]
    want, _ = attention_reference(*(t.transpose(1, 2) for t in leaves), True, alignment)
    want.backward(do.double())
    assert_grad_close("O", o, want, dtype)
    for name, got, ref in zip(("dQ", "dK", "dV"), bases, leaves):
        assert_grad_close(name, got.grad, ref.grad, dtype)
    if head_dim > 64 and alignment == "top_left" and torch.cuda.get_device_capability() == (9, 0) and any(
            c.entry.family == "fmha_bwd_sm90" and c.instance.head_dim == 128 for c in registry.load()[0]):
        ran = {key[3][-1]: dim for key, dim in torch_op._kernels.items() if key[0] == "bwd head dim"}
        assert ran.get(96) == 128, ran


def test_head_dim_without_tiles_varlen():
    """fused_attention_varlen of head dim 80 (padded to 96), forward and backward, an empty
    sequence among them, against the float64 reference per sequence."""
    from test_attention_bwd_gpu import assert_close as assert_grad_close

    dtype, d, lengths = torch.bfloat16, 80, [17, 0, 129]
    cu = torch.tensor([0, 17, 17, 146], dtype=torch.int32, device="cuda")
    q, k, v, do = (randn((146, 4, d), dtype, ("padvarlen", name)) for name in ("q", "k", "v", "do"))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    try:
        o = gemmgen.fused_attention_varlen(*leaves, cu, cu, 129, 129, causal=True)
    except gemmgen.NoInstanceError as exc:
        pytest.skip(f"no instance serves packed sequences at head dim 96 here: {exc}")
    o.backward(do)
    assert o.shape == q.shape
    for start, end in ((0, 17), (17, 146)):
        views = [t[start:end].detach().double().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]
        want, _ = attention_reference(*views, True, "top_left")
        want.backward(do[start:end].double().transpose(0, 1).unsqueeze(0))
        assert_grad_close(f"O {start}:{end}", o[start:end], want[0].transpose(0, 1), dtype)
        for name, t, ref in zip(("dQ", "dK", "dV"), leaves, views):
            assert_grad_close(f"{name} {start}:{end}", t.grad[start:end], ref.grad[0].transpose(0, 1), dtype)
