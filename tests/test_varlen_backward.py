"""fused_attention_varlen's backward without a GPU: autograd through torch.ops.gemmgen.fused_attention_varlen
(register_autograd), what the forward saves and refuses, GQA/MQA expansion and the group sums, the
gradients' layouts, strided views and offsets, empty sequences, dropout's seed and offset, double
backward, and the selection of a backward instance for a varlen problem.

The CUDA kernels are replaced by float64 torch code. The forward stand-in follows mea_sm80's varlen
contract (O packed like q, LSE [B, H, max_seqlen_q] with -inf past each sequence's end, dropout
position (b * H + h) * max_q * max_k + i * len_k + j). The backward "instance" reads only the C ABI
params, as a compiled one does: tensors through their pointers and strides, sequence b's rows from
cu_seqlens in memory, LSE at (b * H + h) * max_seqlen_q + i, the forward's mask from the params'
seed and offset. So everything from the autograd kernel to the params runs as on the GPU, and the
gradients are compared with float64 autograd of each sequence alone."""
from __future__ import annotations

import ctypes
import math
import zlib

import pytest
import torch

import gemmgen
from gemmgen.kernels import launch
from gemmgen.ops import attention, torch_op

FP16 = torch.float16
TOL = dict(rtol=1e-2, atol=2e-3)  # gradients are stored in fp16


# ---- the stand-in kernels ------------------------------------------------------------------------

def uniform(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """A stand-in for Philox: a uniform number in [0, 1) per (seed, position), the same for the same pair."""
    x = (positions & 0xFFFFFFFF) ^ (positions >> 32) ^ (seed & 0xFFFFFFFF)
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return (x ^ (x >> 16)).double() / 2**32


def keep_mask(seed: int, first: list[int], heads: int, len_q: int, len_k: int, p: float) -> torch.Tensor | None:
    """[heads, len_q, len_k] kept weights of one sequence, weight (h, i, j) drawn at position
    first[h] + i * len_k + j; None without dropout."""
    if p <= 0.0:
        return None
    rows, cols = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
    return torch.stack([uniform(seed, f + rows * len_k + cols) >= p for f in first])


def sequence_attention(q, k, v, causal: bool, scale: float, keep=None, p: float = 0.0, shift: int = 0):
    """float64 O [H, Lq, d] and LSE [H, Lq] of one sequence (K, V with Q's heads), causal with the
    diagonal at `shift` (0: top-left, Lk - Lq: bottom-right); a row that sees no key gives 0 and -inf."""
    s = scale * q @ k.transpose(-2, -1)
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + shift, float("-inf"))
    seen = (s > float("-inf")).any(-1, keepdim=True)
    w = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(torch.where(seen, s, 0.0), -1), float("-inf"))
    if keep is not None:
        w = w * keep / (1 - p)
    return w @ v, lse


def head_starts(offset: int, b: int, heads: int, max_q: int, max_k: int) -> list[int]:
    """The Philox position of weight (0, 0) of each head of sequence b."""
    return [offset + (b * heads + h) * max_q * max_k for h in range(heads)]


def forward_standin(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                    return_lse=False, instance=None, dropout_p=0.0, seed=None, offset=0, causal_alignment="top_left",
                    window=None, softcap=0.0, deterministic=False):
    """The varlen forward in float64: O [Tq, H, d] in q's dtype, LSE [B, H, max_seqlen_q]; causal in
    either alignment within each sequence (no window or softcap)."""
    assert window is None and softcap == 0.0, "the stand-in runs no window or softcap"
    h, d = q.shape[1], q.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    o = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((len(cq) - 1, h, max_seqlen_q), float("-inf"))
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1).double()
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1).double().repeat_interleave(h // k.shape[1], 0) for t in (k, v))
        keep = keep_mask(seed or 0, head_starts(offset, b, h, max_seqlen_q, max_seqlen_k), h, qs.shape[1],
                         ks.shape[1], dropout_p)
        shift = ks.shape[1] - qs.shape[1] if causal_alignment == "bottom_right" else 0
        ob, lb = sequence_attention(qs, ks, vs, causal, scale, keep, dropout_p, shift)
        o[cq[b]:cq[b + 1]] = ob.transpose(0, 1).to(q.dtype)
        lse[b, :, :qs.shape[1]] = lb.float()
    return o, (lse if return_lse else torch.empty(0))


def tensor_at(address: int, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """The memory at `address` as a tensor of `size` and `stride` (elements), read and written in place."""
    if 0 in size:
        return torch.empty(size, dtype=dtype)
    extent = sum((n - 1) * s for n, s in zip(size, stride)) + 1
    raw = (ctypes.c_char * (extent * torch.empty((), dtype=dtype).element_size())).from_address(address)
    return torch.frombuffer(raw, dtype=dtype).as_strided(size, stride)


class VarlenKernel:
    """A varlen backward "instance" of one dtype that computes dQ, dK, dV in float64 from what the
    C ABI params point at, and checks what a compiled instance requires of them."""

    calls: list = []
    reads_gqa = False  # as mea_bwd_sm80: K and V come expanded to Q's heads

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def workspace_bytes(self, p) -> int:
        return 0

    def packed(self, p, name: str, strides: str, rows: int) -> torch.Tensor:
        """Tensor `name` as the params describe it: [rows, heads, head_dim] by its strides. A row or
        head stride the kernel steps over is a non-zero multiple of 8 elements (torch_op._kernel_ready)."""
        row, head = getattr(p, f"{strides}_row_stride"), getattr(p, f"{strides}_head_stride")
        for n, stride in ((rows, row), (p.heads, head)):
            assert n <= 1 or (stride != 0 and stride % 8 == 0), f"{name}'s strides ({row}, {head})"
        assert getattr(p, name) % 16 == 0, f"{name} is not 16-byte aligned"
        return tensor_at(getattr(p, name), self.dtype, (rows, p.heads, p.head_dim), (row, head, 1))

    def run(self, p, stream) -> None:
        batch, h, max_q, max_k = p.batch, p.heads, p.seqlen_q, p.seqlen_k
        assert p.heads_kv == h, "K and V reach the kernel with Q's heads"
        assert p.causal_offset in (0, launch.NO_MASK_OFFSET), "varlen's mask is aligned per sequence"
        assert p.align_per_sequence in (0, 1) and not (p.align_per_sequence and p.causal_offset), "bottom-right"
        cq = list((ctypes.c_int32 * (batch + 1)).from_address(p.cu_seqlens_q))
        ck = list((ctypes.c_int32 * (batch + 1)).from_address(p.cu_seqlens_k))
        t = {name: self.packed(p, name, strides, cq[-1] if name in ("q", "o", "d_o", "dq") else ck[-1])
             for name, strides in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("d_o", "do"), ("dq", "dq"),
                                   ("dk", "dk"), ("dv", "dv"))}
        lse = tensor_at(p.lse, torch.float32, (batch, h, max_q), (h * max_q, max_q, 1))
        for b in range(batch):
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            assert cq[b + 1] - cq[b] <= max_q and ck[b + 1] - ck[b] <= max_k
            self.sequence(p, b, rows, keys, t, lse[b])
        VarlenKernel.calls.append(p)

    def sequence(self, p, b: int, rows: slice, keys: slice, t: dict, lse: torch.Tensor) -> None:
        """Sequence b's gradients, written where the params say; its O and LSE checked against the
        forward's (which the kernel would read)."""
        q, k, v = (t[n][s].transpose(0, 1).double().requires_grad_() for n, s in (("q", rows), ("k", keys),
                                                                                 ("v", keys)))
        lq, lk = q.shape[1], k.shape[1]
        starts = [p.dropout_offset + (b * p.heads + h) * p.seqlen_q * p.seqlen_k for h in range(p.heads)]
        keep = keep_mask(p.dropout_seed, starts, p.heads, lq, lk, p.dropout_p)
        with torch.enable_grad():  # the backward op runs with grad mode off
            shift = lk - lq if p.align_per_sequence else 0
            o, ref_lse = sequence_attention(q, k, v, p.causal_offset == 0, p.scale, keep, p.dropout_p, shift)
            grads = torch.autograd.grad(o, (q, k, v), t["d_o"][rows].transpose(0, 1).double(), allow_unused=True)
        assert torch.equal(torch.isneginf(lse[:, :lq]), torch.isneginf(ref_lse)), "the forward's LSE rows"
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[:, :lq].double()[finite], ref_lse[finite].detach(), atol=1e-3), "the forward's LSE"
        assert torch.allclose(t["o"][rows].transpose(0, 1).double(), o.detach(), **TOL), "the forward's O"
        for name, s, g in zip(("dq", "dk", "dv"), (rows, keys, keys), grads):
            t[name][s] = g.transpose(0, 1) if g is not None else 0


@pytest.fixture
def cpu_ops(monkeypatch, cpu_ops_library):
    """CPU implementations of the varlen forward (the stand-in) and of its backward (the real one,
    with VarlenKernel behind the params), for the op and for the public function's eager paths
    (the implementation called directly, or in a torch.autograd.Function when training); the
    public function's device check passes CPU tensors."""
    monkeypatch.setattr(torch_op, "_varlen_bwd_kernel", lambda q, *a, **kw: VarlenKernel(q.dtype))
    monkeypatch.setattr(torch_op, "_fused_attention_varlen", forward_standin)
    monkeypatch.setattr(torch_op, "run_fused_attention_varlen", forward_standin)
    monkeypatch.setattr(attention, "_check_device", lambda *a: None)
    VarlenKernel.calls = []
    cpu_ops_library(fused_attention_varlen=forward_standin,
                    fused_attention_varlen_backward=torch_op._fused_attention_varlen_backward)


# ---- inputs and the float64 reference ------------------------------------------------------------

def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed(gen, rows: int, heads: int, d: int, layout: str = "packed", parts: int = 1) -> torch.Tensor:
    """[rows, heads, d] fp16: contiguous ("packed"), a slice of an interleaved [rows, parts + 1,
    heads, d] buffer ("interleaved", as q of a fused QKV projection), or head-major storage."""
    x = torch.randn(rows, heads, d, generator=gen, dtype=torch.float64).to(FP16)
    if layout == "interleaved":
        store = torch.zeros(rows, parts + 1, heads, d, dtype=FP16)
        store[:, parts] = x
        return store[:, parts]
    if layout == "head_major":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


def reference_grads(q, k, v, do, lens_q, lens_k, *, causal=False, scale=None, keeps=None, p=0.0,
                    alignment="top_left"):
    """float64 (dQ, dK, dV) of sum(O * dO), O the attention of each sequence alone: torch SDPA (or,
    with the dropout masks `keeps`, one per sequence, or bottom-right causal, an explicit softmax),
    GQA by repeating K, V."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    group, d = q.shape[1] // k.shape[1], q.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    outs, cq, ck = [], cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs = q64[cq[b]:cq[b + 1]].transpose(0, 1)
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(group, 0) for t in (k64, v64))
        if lq == 0 or lk == 0:
            outs.append(qs.transpose(0, 1) * 0)  # no key: O = 0, and no gradient reaches K, V
        elif keeps is None and alignment == "top_left":
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
            outs.append(o.transpose(0, 1))
        else:
            shift = lk - lq if alignment == "bottom_right" else 0
            keep = None if keeps is None else keeps[b]
            outs.append(sequence_attention(qs, ks, vs, causal, scale, keep, p, shift)[0].transpose(0, 1))
    out = torch.cat(outs) if outs else q64 * 0
    return torch.autograd.grad(out, leaves, do.double(), allow_unused=True, materialize_grads=True)


def varlen_grads(q, k, v, do, lens_q, lens_k, cu_q=None, cu_k=None, **kw):
    """(dQ, dK, dV) through gemmgen.fused_attention_varlen's autograd."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    cu_q = cu(lens_q) if cu_q is None else cu_q
    cu_k = cu(lens_k) if cu_k is None else cu_k
    o = gemmgen.fused_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    # A plain eager call: the op's pieces in a torch.autograd.Function (torch_op._eager_training).
    assert type(o.grad_fn).__name__ == "_EagerTrainingVarlenBackward"
    return torch.autograd.grad(o, leaves, do)


def test_a_head_dim_without_tiles_runs_padded(cpu_ops):
    """Head dim 24 runs on copies padded to 32 (gemmgen.ops.padding): the kernel sees 32, at the
    scale of 24, and the gradients come back at 24."""
    gen = torch.Generator().manual_seed(24)
    lens_q, lens_k = [3, 0, 9], [5, 4, 9]
    q, do = packed(gen, sum(lens_q), 4, 24), packed(gen, sum(lens_q), 4, 24)
    k, v = packed(gen, sum(lens_k), 2, 24), packed(gen, sum(lens_k), 2, 24)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = gemmgen.fused_attention_varlen(*leaves, cu(lens_q), cu(lens_k), 9, 9, causal=True)
    got = torch.autograd.grad(o, leaves, do)
    want = reference_grads(q, k, v, do, lens_q, lens_k, causal=True)
    assert_grads(got, want, (q, k, v), "padded")
    (params,) = VarlenKernel.calls
    assert params.head_dim == 32 and params.scale == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward(cpu_ops, deterministic):
    """deterministic=True travels from the forward to the backward's params and selection problem
    (the forward has nothing to order: it keeps no such field)."""
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k = [3, 0, 9], [5, 4, 9]
    q, do = packed(gen, sum(lens_q), 4, 32), packed(gen, sum(lens_q), 4, 32)
    k, v = packed(gen, sum(lens_k), 2, 32), packed(gen, sum(lens_k), 2, 32)
    asked = []  # the deterministic argument of each kernel selection (at the forward and the backward)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_op, "_varlen_bwd_kernel", lambda q, *a: asked.append(a[-1]) or VarlenKernel(q.dtype))
        got = varlen_grads(q, k, v, do, lens_q, lens_k, causal=True, deterministic=deterministic)
    assert_grads(got, reference_grads(q, k, v, do, lens_q, lens_k, causal=True), (q, k, v), "deterministic")
    (p,) = VarlenKernel.calls
    assert p.deterministic == int(deterministic)
    assert asked == [deterministic, deterministic]
    with pytest.raises(gemmgen.InputError, match="deterministic"):
        gemmgen.fused_attention_varlen(q, k, v, cu(lens_q), cu(lens_k), 9, 9, deterministic="yes")


def test_the_op_and_the_eager_path_give_the_same_gradients(cpu_ops):
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [3, 0, 9], [5, 4, 9]
    q, do = packed(gen, sum(lens_q), 4, 32), packed(gen, sum(lens_q), 4, 32)
    k, v = packed(gen, sum(lens_k), 2, 32), packed(gen, sum(lens_k), 2, 32)
    eager_grads = varlen_grads(q, k, v, do, lens_q, lens_k, causal=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, _ = torch.ops.gemmgen.fused_attention_varlen(*leaves, cu(lens_q), cu(lens_k), 9, 9, True, return_lse=True)
    for got, want in zip(torch.autograd.grad(o, leaves, do), eager_grads):
        assert torch.equal(got, want)


def is_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its memory without gaps or overlaps (in any dim order)."""
    step = 1
    for stride, n in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != step:
            return False
        step *= n
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and equal strides on every dim of size > 1 (where a stride means something)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def assert_grads(got, want, inputs, label: str) -> None:
    for name, g, w, x in zip(("dQ", "dK", "dV"), got, want, inputs):
        assert same_layout(g, x) or not is_dense(x), f"{label} {name} not in its input's layout"
        assert g.shape == x.shape and g.dtype == x.dtype, f"{label} {name}: {tuple(g.shape)} {g.dtype}"
        assert torch.allclose(g.double(), w, **TOL), f"{label} {name}: max error {(g.double() - w).abs().max():.3g}"


# ---- gradients -----------------------------------------------------------------------------------

LENGTHS = [([0, 1, 17, 9, 5], [3, 17, 1, 0, 12]),  # an empty sequence of each side, Nq != Nk
           ([17, 0, 1], [17, 4, 1])]


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("lens", LENGTHS, ids=["lengths-a", "lengths-b"])
def test_gradients_per_sequence_with_group_sums(cpu_ops, h, hkv, causal, lens):
    lens_q, lens_k = lens
    gen = torch.Generator().manual_seed(zlib.crc32(repr((h, hkv, causal, lens)).encode()))
    d = 32
    q, do = packed(gen, sum(lens_q), h, d), packed(gen, sum(lens_q), h, d)
    k, v = packed(gen, sum(lens_k), hkv, d), packed(gen, sum(lens_k), hkv, d)
    got = varlen_grads(q, k, v, do, lens_q, lens_k, causal=causal, scale=0.3)
    want = reference_grads(q, k, v, do, lens_q, lens_k, causal=causal, scale=0.3)
    assert_grads(got, want, (q, k, v), f"{h}:{hkv} causal={causal}")
    (p,) = VarlenKernel.calls
    assert (p.batch, p.heads, p.seqlen_q, p.seqlen_k) == (len(lens_q), h, max(lens_q), max(lens_k))
    assert p.causal_offset == (0 if causal else launch.NO_MASK_OFFSET)
    assert p.q_batch_stride == p.dk_batch_stride == 0, "sequences are placed by cu_seqlens, not a batch stride"


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_bottom_right_causal_within_each_sequence(cpu_ops, h, hkv):
    """causal_alignment="bottom_right" aligns each sequence's diagonal at its own len_k - len_q
    (FlashAttention's varlen causal): the params carry it as align_per_sequence with offset 0, and
    rows of a sequence with more queries than keys that see no key get no gradient."""
    lens_q, lens_k = [3, 17, 0, 9, 5], [12, 4, 3, 9, 0]
    gen = torch.Generator().manual_seed(41 + h)
    q, do = packed(gen, sum(lens_q), h, 32), packed(gen, sum(lens_q), h, 32)
    k, v = packed(gen, sum(lens_k), hkv, 32), packed(gen, sum(lens_k), hkv, 32)
    got = varlen_grads(q, k, v, do, lens_q, lens_k, causal=True, causal_alignment="bottom_right")
    want = reference_grads(q, k, v, do, lens_q, lens_k, causal=True, alignment="bottom_right")
    assert_grads(got, want, (q, k, v), f"{h}:{hkv} bottom-right")
    top_left = reference_grads(q, k, v, do, lens_q, lens_k, causal=True)
    assert not torch.allclose(want[0], top_left[0], **TOL), "the case tells the alignments apart"
    (p,) = VarlenKernel.calls
    assert (p.causal_offset, p.align_per_sequence, p.local) == (0, 1, 0)


def test_varlen_alignment_is_ignored_without_a_mask(cpu_ops):
    """Without a mask the alignment means nothing: no offset, no per-sequence shift."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (packed(gen, 9, 2, 32) for _ in range(4))
    varlen_grads(q, k, v, do, [4, 5], [4, 5], causal_alignment="bottom_right")
    (p,) = VarlenKernel.calls
    assert (p.causal_offset, p.align_per_sequence) == (launch.NO_MASK_OFFSET, 0)


@pytest.mark.parametrize("layout", ["interleaved", "head_major"])
def test_strided_views_and_offsets(cpu_ops, layout):
    """q and dO views of fused buffers or head-major storage, k and v likewise, strided cu_seqlens
    views: the kernel gets readable strides and the offsets as arrays; the gradients come back in
    the inputs' dim order (dense)."""
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [5, 0, 17, 1], [9, 3, 17, 2]
    h, hkv, d = 4, 2, 32
    q, do = packed(gen, sum(lens_q), h, d, layout, 2), packed(gen, sum(lens_q), h, d, layout, 1)
    k, v = packed(gen, sum(lens_k), hkv, d, layout, 1), packed(gen, sum(lens_k), hkv, d, layout, 2)
    cu_q, cu_k = (torch.stack([cu(n), cu(n) + 100]).t().reshape(-1)[::2] for n in (lens_q, lens_k))
    assert not cu_q.is_contiguous() and torch.equal(cu_q, cu(lens_q))
    got = varlen_grads(q, k, v, do, lens_q, lens_k, cu_q, cu_k, causal=True)
    want = reference_grads(q, k, v, do, lens_q, lens_k, causal=True)
    assert_grads(got, want, (q, k, v), layout)
    for g, x in zip(got, (q, k, v)):
        dense = torch_op._packed_like(x)
        assert same_layout(g, dense) and is_dense(g)
    if layout == "head_major":
        assert all(same_layout(g, x) for g, x in zip(got, (q, k, v)))
    fake = torch_op._fake_varlen_backward(do, q, k, v, q, None, cu_q, cu_k, 17, 17, True, None, 0.0, 0, 0)
    assert all(f.shape == g.shape and f.stride() == g.stride() for f, g in zip(fake, got)), "fake and real layouts"


def test_tensors_the_kernel_cannot_read_are_copied(cpu_ops):
    """The forward reads q and k broadcast over heads (stride 0), and o.sum().backward() hands the
    backward dO as an expanded tensor of ones: the kernel gets dense copies, the gradients have the
    inputs' shapes."""
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k = [3, 17], [17, 5]
    q, k = packed(gen, 20, 1, 32).expand(20, 4, 32), packed(gen, 22, 1, 32).expand(22, 2, 32)
    v = packed(gen, 22, 2, 32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    gemmgen.fused_attention_varlen(*leaves, cu(lens_q), cu(lens_k), 17, 17).sum().backward()  # dO: strides 0
    want = reference_grads(q, k, v, torch.ones_like(q), lens_q, lens_k)
    assert_grads([t.grad for t in leaves], want, (q, k, v), "broadcast inputs, dO of ones")


def test_empty_totals_give_zero_gradients_without_a_kernel(cpu_ops):
    gen = torch.Generator().manual_seed(13)
    for lens_q, lens_k in (([0, 0], [5, 3]), ([4, 2], [0, 0]), ([0], [0])):
        q, do = packed(gen, sum(lens_q), 2, 32), packed(gen, sum(lens_q), 2, 32)
        k, v = packed(gen, sum(lens_k), 1, 32), packed(gen, sum(lens_k), 1, 32)
        for g, x in zip(varlen_grads(q, k, v, do, lens_q, lens_k, causal=True), (q, k, v)):
            assert g.shape == x.shape and torch.equal(g, torch.zeros_like(g))
    assert VarlenKernel.calls == []


@pytest.mark.parametrize("seed", [None, 1234])
def test_dropout_backward_regenerates_the_forward_mask(cpu_ops, monkeypatch, seed):
    """The backward gets the forward's seed and offset (drawn by the public function when seed is
    None), and its mask, regenerated at the backward's positions, is the forward's."""
    drawn = []

    def draw_seed(index, draws):
        drawn.append(draws)
        return 99, 64

    monkeypatch.setattr(launch, "draw_seed", draw_seed)
    gen = torch.Generator().manual_seed(17)
    lens_q, lens_k, h, p = [6, 0, 17], [9, 4, 17], 4, 0.3
    q, do = packed(gen, 23, h, 32), packed(gen, 23, h, 32)
    k, v = packed(gen, 30, 2, 32), packed(gen, 30, 2, 32)
    got = varlen_grads(q, k, v, do, lens_q, lens_k, causal=True, dropout_p=p, seed=seed, offset=8)
    want_seed, want_offset = (99, 64 + 8) if seed is None else (seed, 8)
    assert drawn == ([3 * h * 17 * 17] if seed is None else [])
    (params,) = VarlenKernel.calls
    assert (params.dropout_seed, params.dropout_offset) == (want_seed, want_offset)
    keeps = [keep_mask(want_seed, head_starts(want_offset, b, h, 17, 17), h, lq, lk, p)
             for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    want = reference_grads(q, k, v, do, lens_q, lens_k, causal=True, keeps=keeps, p=p)
    assert_grads(got, want, (q, k, v), "dropout")
    no_dropout = reference_grads(q, k, v, do, lens_q, lens_k, causal=True)
    assert not torch.allclose(got[0].double(), no_dropout[0], **TOL), "the mask must matter"


# ---- refusals ------------------------------------------------------------------------------------

def small_case():
    """Two sequences of 4 and 5 tokens, 2 heads of 64, inputs that require grad."""
    gen = torch.Generator().manual_seed(19)
    q, k, v = (packed(gen, 9, 2, 64).requires_grad_() for _ in range(3))
    return q, k, v, cu([4, 5]), cu([4, 5])


def test_lse_has_no_gradient_and_double_backward_raises(cpu_ops):
    q, k, v, cu_q, cu_k = small_case()
    o, lse = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, return_lse=True)
    assert o.requires_grad and not lse.requires_grad and lse.shape == (2, 2, 5)
    with pytest.raises(gemmgen.InputError, match="double backward through gemmgen.fused_attention_varlen"):
        torch.autograd.grad(o, (q, k, v), torch.ones_like(o), create_graph=True)


def test_the_forward_refuses_what_its_backward_could_not_use(cpu_ops):
    q, k, v, cu_q, cu_k = small_case()
    with pytest.raises(gemmgen.InputError, match="fused_attention_varlen needs return_lse=True"):
        torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(gemmgen.InputError, match="with dropout needs an explicit seed"):
        torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, return_lse=True, dropout_p=0.1)
    with torch.no_grad():  # inference needs neither
        torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, dropout_p=0.1)
    o, lse = torch.ops.gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, return_lse=True)
    with pytest.raises(gemmgen.InputError, match=r"needs the forward's LSE \[B, H, max_seqlen_q\]"):
        torch.ops.gemmgen.fused_attention_varlen_backward(o.detach(), q.detach(), k.detach(), v.detach(), o.detach(),
                                                          lse[:, :, :4], cu_q, cu_k, 5, 5, False, None, 0.0, 0, 0)


REAL_VARLEN_BWD_KERNEL = torch_op._varlen_bwd_kernel  # cpu_ops replaces it


def synthetic_build(tmp_path, monkeypatch, instances):
    """A build of `instances` (no libraries) as the only one, on an H100 as selection sees it,
    compiling on demand off."""
    from conftest import make_entry, write_build_dir
    from gemmgen.select import device, registry

    monkeypatch.setattr(device, "facts", lambda index: device.synthetic((9, 0), 132, "NVIDIA H100"))
    monkeypatch.setenv("GEMMGEN_JIT", "0")
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(i) for i in instances])])


@pytest.fixture
def restore_builds():
    from gemmgen.select import registry

    yield
    registry.set_build_dirs(None)


def test_forward_refuses_when_no_backward_instance_serves_varlen(cpu_ops, monkeypatch, tmp_path, restore_builds):
    """With only Hopper backward instances of example 88's loop built (no varlen: the split-dQ ones
    run it), the forward raises at once with their reason, as fused_attention does; without grad it
    runs."""
    from gemmgen.generator.families import fmha_bwd_sm90

    monkeypatch.setattr(torch_op, "_varlen_bwd_kernel", REAL_VARLEN_BWD_KERNEL)
    synthetic_build(tmp_path, monkeypatch, [i for i in fmha_bwd_sm90.SPACE if not i.split_dq])
    q, k, v, cu_q, cu_k = small_case()
    with pytest.raises(gemmgen.NoInstanceError, match="variable lengths on its split-dQ instances"):
        gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    with torch.no_grad():
        gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, 5, 5, causal=True)



def test_varlen_backward_problem_and_selection(monkeypatch, tmp_path, restore_builds):
    """The varlen backward's problem carries the varlen flag and the maxima, K with Q's heads: the
    Hopper backward's split-dQ instance runs it, example 88's loop is rejected with its reason,
    dropout needs mea_bwd_sm80's dropout instance."""
    from gemmgen.generator.families import fa2_bwd_sm80, fmha_bwd_sm90, mea_bwd_sm80
    from gemmgen.select import calls, selection

    synthetic_build(tmp_path, monkeypatch, (*mea_bwd_sm80.DEFAULT, *fmha_bwd_sm90.DEFAULT))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    q = torch.empty(40, 8, 64, dtype=torch.bfloat16)
    kk = torch.empty(50, 8, 64, dtype=torch.bfloat16)
    problem = calls.problem_for_bwd_varlen(q, kk, 3, 17, 30, True, tensors=(q, kk))
    assert problem.kind == "attention_bwd" and problem.varlen and problem.gqa == 1
    assert (problem.batch_heads, problem.seqlen_q, problem.seqlen_k) == (24, 17, 30)
    assert problem.functional_key == "bwd_bf16_d64_causal_a16_varlen"
    decision = selection.decide(problem)
    assert decision.winner.name == "fmha_bwd_sm90_bf16_d64_causal_m128n128_sq"
    synthetic_build(tmp_path / "loop", monkeypatch, (*mea_bwd_sm80.DEFAULT,
                                                     *(i for i in fmha_bwd_sm90.SPACE if not i.split_dq)))
    decision = selection.decide(problem)
    assert decision.winner.entry.family == "mea_bwd_sm80"
    reasons = dict(decision.rejected)
    hopper = [r for label, r in reasons.items() if "fmha_bwd_sm90_bf16_d64_causal" in label]
    assert hopper and all("split-dQ instances" in r for r in hopper), reasons
    with pytest.raises(gemmgen.NoInstanceError, match="built without dropout"):
        selection.select(calls.problem_for_bwd_varlen(q, kk, 3, 17, 30, True, dropout=True))
    # Deterministic packed calls: the split-dQ instances take turns per query tile, ahead of
    # fa2_bwd_sm80's, which do too.
    synthetic_build(tmp_path / "det", monkeypatch, (*mea_bwd_sm80.DEFAULT, *fa2_bwd_sm80.DEFAULT,
                                                    *fmha_bwd_sm90.DEFAULT))
    det = calls.problem_for_bwd_varlen(q, kk, 3, 17, 30, True, tensors=(q, kk), deterministic=True)
    assert det.deterministic and det.functional_key == "bwd_bf16_d64_causal_a16_varlen_det"
    assert selection.decide(det).winner.name == "fmha_bwd_sm90_bf16_d64_causal_m128n128_sq"


def test_varlen_runs_on_the_fa2_families_in_either_alignment(monkeypatch, tmp_path, restore_builds):
    """With the default build of every family that runs varlen: fa2_sm80 wins the forward (fmha_sm90
    is not in this build) in both alignments, with a window (a local instance) and a softcap (an
    `_sc` one); the backward goes to fmha_bwd_sm90's split-dQ instances where it has the head dim
    and to fa2_bwd_sm80 where not (d256); mea_sm80 and mea_bwd_sm80 refuse the bottom-right
    alignment and keep dropout."""
    from gemmgen.generator.families import fa2_bwd_sm80, fa2_sm80, fmha_bwd_sm90, mea_bwd_sm80, mea_sm80
    from gemmgen.select import calls, selection

    synthetic_build(tmp_path, monkeypatch, (*fa2_sm80.DEFAULT, *mea_sm80.DEFAULT, *fa2_bwd_sm80.DEFAULT,
                                            *mea_bwd_sm80.DEFAULT, *fmha_bwd_sm90.DEFAULT))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    q = torch.empty(40, 8, 128, dtype=torch.bfloat16)
    kk = torch.empty(50, 8, 128, dtype=torch.bfloat16)
    for alignment in ("top_left", "bottom_right"):
        fwd = calls.problem_for_varlen(q, kk, kk, 3, 1024, 2048, True, causal_alignment=alignment)
        bwd = calls.problem_for_bwd_varlen(q, kk, 3, 1024, 2048, True, causal_alignment=alignment)
        assert selection.select(fwd).name == "fa2_sm80_bf16_d128_causal_m128n64w4s1"
        assert selection.select(bwd).name == "fmha_bwd_sm90_bf16_d128_causal_m64n128_sq"
    reasons = dict(selection.decide(calls.problem_for_bwd_varlen(
        q, kk, 3, 1024, 2048, True, causal_alignment="bottom_right")).rejected)
    mea = [r for label, r in reasons.items() if label.startswith("mea_bwd_sm80_bf16_k128")]
    assert mea and any("top-left only" in r for r in mea), reasons
    window = calls.problem_for_varlen(q, kk, kk, 3, 1024, 2048, False, causal_alignment="bottom_right", window=(8, 0))
    assert selection.select(window).name == "fa2_sm80_bf16_d128_local_m128n64w4s1"
    capped = calls.problem_for_varlen(q, kk, kk, 3, 1024, 2048, True, softcap=True)
    assert selection.select(capped).name == "fa2_sm80_bf16_d128_causal_m128n64w4s1_sc"
    assert selection.select(calls.problem_for_bwd_varlen(q, kk, 3, 1024, 2048, True, softcap=True)).name == \
        "fmha_bwd_sm90_bf16_d128_causal_m64n128_sq_sc"
    q256, k256 = torch.empty(40, 8, 256, dtype=torch.bfloat16), torch.empty(50, 8, 256, dtype=torch.bfloat16)
    assert selection.select(calls.problem_for_bwd_varlen(q256, k256, 3, 1024, 2048, True)).name == \
        "fa2_bwd_sm80_bf16_d256_m64n64w8s1"
    dropout = calls.problem_for_varlen(q, kk, kk, 3, 1024, 2048, True, dropout=True)
    assert selection.select(dropout).entry.family == "mea_sm80"


def test_fake_backward_traces_on_fake_tensors():
    """The backward op's fake implementation: gradients of the inputs' shapes, packed like them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        # q as a slice of a fused [30, 3, 4, 64] buffer, k head-major (views of fake CUDA tensors
        # need a CUDA build of torch: the strides are given instead)
        q = torch.empty_strided((30, 4, 64), (3 * 4 * 64, 64, 1), dtype=FP16, device="cuda")
        k = torch.empty_strided((40, 2, 64), (64, 40 * 64, 1), dtype=FP16, device="cuda")
        o, lse = torch.empty(30, 4, 64, dtype=FP16, device="cuda"), torch.empty(2, 4, 20, device="cuda")
        c = torch.empty(3, dtype=torch.int32, device="cuda")
        dq, dk, dv = torch.ops.gemmgen.fused_attention_varlen_backward(o, q, k, k, o, lse, c, c, 20, 20, True, None,
                                                                       0.0, 0, 0)
    assert dq.shape == q.shape and dq.stride() == (256, 64, 1)
    assert dk.shape == k.shape and dk.stride() == k.stride() and dv.stride() == k.stride()
