"""fused_attention_with_kvcache and the decode_sm80 family on the GPU against the float64 reference:
Nq 1 to 16, context lengths 1 to 65537 differing per sequence (0 included), contiguous and paged
caches (pages 16 and 256, block tables in random page order), new keys and values appended in
place, GQA ratios 1, 4, 8 and MQA, head dims 64 and 128, fp16 and bf16, causal (bottom-right per
sequence) and not, every default instance, CUDA graph replay with new lengths, torch.compile, the
value checks and what a bad length or page gives without them, and gemmgen.fused_attention on
decode-shaped calls. Needs the default build (`gemmgen generate --arch sm80`).

Inputs are fresh random tensors, a different seed per case. Cache rows a sequence does not hold
(past its length, and pages no sequence owns) are NaN, so a read outside a sequence's keys shows
as NaN in O. The op allocates O and LSE: the caching allocator is handed NaN-filled blocks of
their sizes just before each call, and NaN never passes."""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import gemmgen
from gemmgen.errors import NoInstanceError
from gemmgen.generator.families import decode_sm80
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, registry, selection
from test_fused_attention import DTYPES, LSE_TOLERANCE, TOLERANCE, check, make_qkv, randn

pytestmark = pytest.mark.gpu

I32 = torch.int32
NAN = float("nan")


@pytest.fixture(scope="module", autouse=True)
def decode_instances_built():
    """The family's default instances (d64 and d128, both dtypes, both tiles) must be built: else the
    op would compile them on demand, minutes per instance."""
    registry.refresh()
    built = {c.name for c in registry.load()[0] if c.entry.state == "built" and c.entry.family == "decode_sm80"}
    missing = [i.name for i in decode_sm80.DEFAULT if i.name not in built]
    if missing:
        pytest.skip(f"decode_sm80 instances not built ({', '.join(missing[:3])}...): "
                    f"run `gemmgen generate --arch sm80`")


def cpu_generator(key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@dataclasses.dataclass
class Case:
    """One call's tensors, and the keys and values each sequence is meant to hold (`truth_k`,
    `truth_v` [B, capacity, Hkv, d]: row t of sequence b is key t) from which the caches are filled."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seqlens: torch.Tensor
    table: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    truth_k: torch.Tensor
    truth_v: torch.Tensor
    capacity: int
    nnew: int

    @property
    def page_size(self) -> int | None:
        return None if self.table is None else self.k_cache.shape[1]

    def slots(self, b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch-or-page, row) indices of the cache where keys `positions` of sequence b live."""
        if self.table is None:
            return torch.full_like(positions, b), positions
        return self.table[b].long()[positions // self.page_size], positions % self.page_size

    def write_rows(self, k_cache, v_cache, b: int, start: int, stop: int) -> None:
        pos = torch.arange(start, stop, device="cuda")
        i0, i1 = self.slots(b, pos)
        k_cache[i0, i1] = self.truth_k[b, start:stop]
        v_cache[i0, i1] = self.truth_v[b, start:stop]

    def set_lengths(self, lengths: list[int], key) -> None:
        """Caches holding each sequence's first lengths[b] keys (NaN elsewhere), new tokens the next
        `nnew` keys, a fresh q; in place (a captured graph keeps its tensors)."""
        self.seqlens.copy_(torch.tensor(lengths, dtype=I32))
        self.q.copy_(randn(tuple(self.q.shape), self.q.dtype, (key, "q")))
        self.k_cache.fill_(NAN)
        self.v_cache.fill_(NAN)
        for b, length in enumerate(lengths):
            self.write_rows(self.k_cache, self.v_cache, b, 0, length)
            if self.nnew:
                self.k[b].copy_(self.truth_k[b, length:length + self.nnew])
                self.v[b].copy_(self.truth_v[b, length:length + self.nnew])

    def expected_caches(self, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as they must be after the call appends the new tokens."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        for b, length in enumerate(lengths):
            self.write_rows(k_cache, v_cache, b, length, length + self.nnew)
        return k_cache, v_cache


def make_case(b, nq, h, hkv, d, dtype, lengths, *, page_size=None, nnew=0, capacity=None, spare_pages=3,
              key="case") -> Case:
    """A Case; `capacity` defaults to the longest sequence with its new tokens, rounded up to whole
    pages; a paged cache has `spare_pages` pages no sequence owns, its block table the pages in a
    random order."""
    capacity = capacity or max(max(lengths) + nnew, 1)
    if page_size is not None:
        capacity = -(-capacity // page_size) * page_size
    truth_k = randn((b, capacity, hkv, d), dtype, (key, "k"))
    truth_v = randn((b, capacity, hkv, d), dtype, (key, "v"))
    if page_size is None:
        shape, table = (b, capacity, hkv, d), None
    else:
        max_pages = capacity // page_size
        pages = b * max_pages + spare_pages
        perm = torch.randperm(pages, generator=cpu_generator((key, "table")))[:b * max_pages]
        table = perm.view(b, max_pages).to(I32).cuda()
        shape = (pages, page_size, hkv, d)
    new = (torch.empty((b, nnew, hkv, d), dtype=dtype, device="cuda") for _ in range(2)) if nnew else (None, None)
    case = Case(torch.empty((b, nq, h, d), dtype=dtype, device="cuda"), torch.empty(shape, dtype=dtype, device="cuda"),
                torch.empty(shape, dtype=dtype, device="cuda"), torch.zeros(b, dtype=I32, device="cuda"), table,
                *new, truth_k, truth_v, capacity, nnew)
    case.set_lengths(lengths, key)
    return case


def poison_allocator(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Leave NaN-filled blocks of these sizes in the caching allocator, for the op's outputs to reuse."""
    blocks = [torch.full(shape, NAN, dtype=dtype, device="cuda") for shape, dtype in like]
    del blocks


def run(case: Case, *, causal=True, scale=None, instance=None, check_values=False, return_lse=True, window=None):
    b, nq, h, _ = case.q.shape
    poison_allocator((tuple(case.q.shape), case.q.dtype), ((b, h, nq), torch.float32))
    out = gemmgen.fused_attention_with_kvcache(case.q, case.k_cache, case.v_cache, case.seqlens,
                                               block_table=case.table, k=case.k, v=case.v, causal=causal,
                                               scale=scale, return_lse=return_lse, check_values=check_values,
                                               instance=instance, window=window)
    torch.cuda.synchronize()
    return out


def reference(case: Case, lengths: list[int], *, causal=True, scale=None, window=None):
    """float64 O [B, Nq, H, d] and LSE [B, H, Nq] from each sequence's first lengths[b] + nnew keys
    (a window, too, around its bottom-right diagonal)."""
    outs, lses = [], []
    for b, length in enumerate(lengths):
        n = length + case.nnew
        q = case.q[b].transpose(0, 1)[None]  # [1, H, Nq, d]
        k = case.truth_k[b, :n].transpose(0, 1)[None]  # [1, Hkv, n, d]
        v = case.truth_v[b, :n].transpose(0, 1)[None]
        o, lse = attention_reference(q, k, v, causal, "bottom_right", scale, window=window)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def check_result(case: Case, lengths: list[int], o, lse, *, causal=True, scale=None, skip=(), window=None):
    """O and LSE against the reference, sequence by sequence (those in `skip` aside)."""
    b, nq, h, d = case.q.shape
    assert o.shape == (b, nq, h, d) and o.dtype == case.q.dtype and o.device == case.q.device
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32 and lse.is_contiguous()
    ref_o, ref_lse = reference(case, lengths, causal=causal, scale=scale, window=window)
    for i in range(b):
        if i in skip:
            continue
        where = f"sequence {i} (length {lengths[i]} + {case.nnew} new, Nq {nq})"
        assert not torch.isnan(o[i]).any(), f"{where}: NaN in O (an unwritten element or a read past its keys)"
        assert not torch.isnan(lse[i]).any(), f"{where}: NaN in LSE"
        norm = ref_o[i].norm().item()
        if norm == 0:
            assert torch.equal(o[i], torch.zeros_like(o[i])), f"{where}: O must be 0"
        else:
            err = (o[i].double() - ref_o[i]).norm().item() / norm
            assert err <= TOLERANCE[case.q.dtype], f"{where}: relative error {err:.3e}"
        empty = torch.isneginf(ref_lse[i])  # [H, Nq]: rows that see no key
        assert torch.equal(torch.isneginf(lse[i]), empty), f"{where}: LSE must be -inf exactly where no key is seen"
        rows = o[i].transpose(0, 1)[empty]  # [rows, d]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{where}: rows that see no key must be 0"
        finite = ~empty
        lse_err = ((lse[i].double() - ref_lse[i]).abs() / ref_lse[i].abs().clamp_min(1.0))[finite]
        assert lse_err.numel() == 0 or lse_err.max().item() <= LSE_TOLERANCE, f"{where}: LSE error {lse_err.max():.3e}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def replay_with_lengths(case: Case, call, steps, key) -> None:
    """Capture `call` once (a first call outside the capture selects and loads), then for each
    lengths of `steps` set the case's tensors, replay into NaN-filled outputs and check the appended
    cache rows and O, LSE against the reference."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = call()
    for step, lengths in enumerate(steps):
        case.set_lengths(lengths, (key, step))
        want_k, want_v = case.expected_caches(lengths)
        o.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(case.k_cache, want_k) and same_bits(case.v_cache, want_v), f"replay {step}: cache rows"
        check_result(case, lengths, o, lse)


LAYOUTS = [None, 16, 256]
LAYOUT_IDS = ["contiguous", "page16", "page256"]


# ---- lengths, page sizes, dtypes, head dims, Nq, masks ---------------------------------------------

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-mask"])
@pytest.mark.parametrize("dtype, d", [(torch.float16, 64), (torch.bfloat16, 128), (torch.float16, 128),
                                      (torch.bfloat16, 64)], ids=["fp16-d64", "bf16-d128", "fp16-d128", "bf16-d64"])
@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
def test_lengths_per_sequence(page_size, dtype, d, causal):
    """Lengths 0, 1, 17, 4097 and one on a page boundary in one batch, Nq 1, 2, 4, 16 (the rows of
    a query that sees no key under the bottom-right mask: O 0 and LSE -inf)."""
    lengths = [17, 0, 4097, 1, 512]
    case = make_case(5, 16, 8, 2, d, dtype, lengths, page_size=page_size, key=("len", page_size, dtype, d))
    for nq in (1, 2, 4, 16):
        sub = dataclasses.replace(case, q=case.q[:, :nq])
        o, lse = run(sub, causal=causal)
        check_result(sub, lengths, o, lse, causal=causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [32, 64, 96, 128, 192, 48])
def test_page_sizes_around_the_key_tile(page_size, d):
    """Page sizes that put a key tile (64 keys at d128, 128 at d64) in one page (looked up once per
    tile) or across pages (looked up per row), powers of two and not; lengths ending inside a page
    and on its boundary, one split and several, a bad page in one sequence's table beside good ones."""
    from gemmgen.ops import torch_op

    lengths = [4097, 0, 17, 3 * page_size, 1000]
    case = make_case(5, 2, 8, 2, d, torch.bfloat16, lengths, page_size=page_size, key=("pages", page_size, d))
    o, lse = run(case)
    check_result(case, lengths, o, lse)
    for forced in (1, 7):
        saved = selection.splits
        selection.splits = lambda cand, problem, forced=forced: forced
        torch_op._kernels.clear()
        try:
            o2, lse2 = run(case)
        finally:
            selection.splits = saved
            torch_op._kernels.clear()
        check_result(case, lengths, o2, lse2)
    case.table[4, 1] = 10**6  # a page the cache does not have: NaN rows for sequence 4 only
    o3, lse3 = run(case)
    assert torch.isnan(o3[4]).all() and torch.isnan(lse3[4]).all()
    check_result(case, lengths, o3, lse3, skip=(4,))


@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
def test_long_contexts(page_size):
    """65537 keys beside 4097, 17, 1 and 0 (MQA, 4 query heads), split over many CTAs."""
    lengths = [65537, 4097, 0, 17, 1]
    case = make_case(5, 4, 4, 1, 128, torch.bfloat16, lengths, page_size=page_size, key=("long", page_size))
    for nq in (1, 4):
        sub = dataclasses.replace(case, q=case.q[:, :nq])
        o, lse = run(sub)
        check_result(sub, lengths, o, lse)
    o, lse = run(case, causal=False, scale=0.3)
    check_result(case, lengths, o, lse, causal=False, scale=0.3)


@pytest.mark.parametrize("h, hkv", [(4, 4), (8, 2), (16, 2), (16, 1)], ids=["mha", "gqa4", "gqa8", "mqa16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_gqa_and_mqa(h, hkv, dtype):
    """GQA packing: a KV head's query heads times the query rows share a row tile (4 x 16 = 64 rows,
    16 x 4 = 64 rows for MQA)."""
    lengths = [1000, 0, 33]
    case = make_case(3, 4, h, hkv, 128, dtype, lengths, page_size=16, key=("gqa", h, hkv, dtype))
    for nq in (1, 4):
        sub = dataclasses.replace(case, q=case.q[:, :nq])
        for causal in (True, False):
            o, lse = run(sub, causal=causal)
            check_result(sub, lengths, o, lse, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-mask"])
@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
def test_long_chunks_against_the_cache(page_size, causal):
    """Chunked prefill: 256 and 1024 query rows (at least DENSE_CHUNK_ROWS: a contiguous cache's chunk
    runs as packed sequences where an instance runs that, else each sequence as a dense bottom-right
    call on its keys, gathered from its pages) against lengths 300, 0, 4097 and 17 with three new
    tokens appended first (the 17 + 3 keys fewer than the rows: rows without keys)."""
    from gemmgen.ops.torch_op import DENSE_CHUNK_ROWS

    lengths = [300, 0, 4097, 17]
    case = make_case(4, 1024, 8, 2, 128, torch.bfloat16, lengths, page_size=page_size, nnew=3,
                     key=("chunk", page_size, causal))
    for nq in (256, 1024):
        assert nq >= DENSE_CHUNK_ROWS
        case.set_lengths(lengths, ("chunk", page_size, causal, nq))
        sub = dataclasses.replace(case, q=case.q[:, :nq])
        o, lse = run(sub, causal=causal)
        check_result(sub, lengths, o, lse, causal=causal)


def packed_plans() -> list:
    """The kernels of the chunks run as packed sequences so far (gemmgen.ops.torch_op's plans)."""
    from gemmgen.ops import torch_op

    return [plan.kernel.symbol for key, plan in torch_op._kernels.items()
            if key[0] == "kv_packed" and plan is not torch_op._NO_PACKED]


def require_packed_chunks(dtype, d) -> None:
    """Skip unless a built fmha_sm90 instance runs chunks as packed sequences at this dtype and head
    dim (the sm90 default build: `gemmgen generate --arch sm90` on a Hopper GPU)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("packed chunks run on fmha_sm90 (Hopper)")
    problem = dataclasses.replace(
        calls.problem_for_varlen(torch.empty((2, 8, d), dtype=dtype, device="cuda"),
                                 torch.empty((2, 2, d), dtype=dtype, device="cuda"),
                                 torch.empty((2, 2, d), dtype=dtype, device="cuda"), 1, 2, 2, True,
                                 causal_alignment="bottom_right", short_keys=False), kv_cache=True)
    try:
        selection.select(problem)
    except NoInstanceError as exc:
        pytest.skip(f"no built fmha_sm90 instance runs key-value chunks: run `gemmgen generate --arch sm90` ({exc})")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-mask"])
@pytest.mark.parametrize("dtype, d, h, hkv", [(torch.bfloat16, 128, 8, 2), (torch.float16, 64, 4, 1),
                                              (torch.float16, 128, 4, 4), (torch.bfloat16, 64, 16, 2)],
                         ids=["bf16-d128-gqa4", "fp16-d64-mqa4", "fp16-d128-mha", "bf16-d64-gqa8"])
def test_chunks_as_packed_sequences(dtype, d, h, hkv, causal):
    """Chunks of at least DENSE_CHUNK_ROWS rows against a contiguous cache run on fmha_sm90 as packed
    sequences whose lengths the kernel reads on the GPU: the plan is fmha_sm90's; lengths 0, 1, 17
    (fewer keys than rows: the first rows see none under the bottom-right mask), 129, 4097 and the
    whole capacity, with and without new tokens appended, Nq 128, 129, 200 and 1000, and the cache's
    rows past each length NaN (a read of them, or 0 * NaN in P V, shows as NaN)."""
    require_packed_chunks(dtype, d)
    from gemmgen.ops import torch_op

    lengths = [17, 0, 4097, 1, 129, 4100]
    for nnew in (0, 3):
        case = make_case(6, 1000, h, hkv, d, dtype, lengths, nnew=nnew, capacity=4103,
                         key=("packed", dtype, d, h, causal, nnew))
        for nq in (128, 129, 200, 1000):
            assert nq >= torch_op.DENSE_CHUNK_ROWS
            case.set_lengths(lengths, ("packed", dtype, d, h, causal, nnew, nq))
            want_k, want_v = case.expected_caches(lengths)
            sub = dataclasses.replace(case, q=case.q[:, :nq])
            torch_op._kernels.clear()
            o, lse = run(sub, causal=causal)
            assert [s for s in packed_plans() if "fmha_sm90" in s], f"Nq {nq}: not run as packed sequences"
            if nnew:
                assert same_bits(case.k_cache, want_k) and same_bits(case.v_cache, want_v), "appended rows"
            check_result(sub, lengths, o, lse, causal=causal)
    o = run(case, causal=causal, return_lse=False)  # (the kernel's LSE goes to a scratch buffer)
    assert isinstance(o, torch.Tensor)
    ref_o, _ = reference(case, lengths, causal=causal)
    for i in range(len(lengths)):
        err = (o[i].double() - ref_o[i]).norm().item() / max(ref_o[i].norm().item(), 1e-30)
        assert err <= TOLERANCE[dtype] or ref_o[i].norm().item() == 0, f"sequence {i} without LSE: {err:.3e}"


def test_packed_chunks_bad_lengths_strides_and_scales():
    """The packed route with a length past the capacity and a negative one (NaN rows for those
    sequences only, no fault, no check_values), q given as a [B, H, Nq, d] view (copied into packed
    rows), scales 0.05 and 0 (a negative scale goes the dense route), and a cache in [B, Hkv, Nmax,
    d] storage (not evenly spaced rows: the dense route)."""
    require_packed_chunks(torch.bfloat16, 128)
    from gemmgen.ops import torch_op

    lengths = [300, 700, 50]
    case = make_case(3, 160, 8, 2, 128, torch.bfloat16, lengths, capacity=1024, key="packed-bad")
    case.seqlens.copy_(torch.tensor([300, 1025, -4], dtype=I32))
    torch_op._kernels.clear()
    o, lse = run(case)
    assert packed_plans()
    for i in (1, 2):
        assert torch.isnan(o[i]).all() and torch.isnan(lse[i]).all(), f"sequence {i}: NaN rows"
    check_result(case, lengths, o, lse, skip=(1, 2))
    case.seqlens.copy_(torch.tensor(lengths, dtype=I32))
    bhnd = case.q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Nq, H, d] view of [B, H, Nq, d] storage
    for scale in (0.05, 0.0, -0.3):
        torch_op._kernels.clear()
        o, lse = run(dataclasses.replace(case, q=bhnd), scale=scale)
        assert bool(packed_plans()) == (scale >= 0), f"scale {scale}: the packed route iff scale >= 0"
        check_result(dataclasses.replace(case, q=bhnd), lengths, o, lse, scale=scale)
    hnd_k = case.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    hnd_v = case.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    torch_op._kernels.clear()
    o, lse = run(dataclasses.replace(case, k_cache=hnd_k, v_cache=hnd_v))
    assert not packed_plans(), "a [B, Hkv, Nmax, d] cache is not evenly spaced rows"
    check_result(case, lengths, o, lse)


@pytest.mark.parametrize("nnew", [0, 5])
def test_packed_chunks_in_cuda_graphs(nnew):
    """A chunk of 256 rows captured once and replayed with new lengths (0 and fewer keys than rows
    among them): the packed route runs under capture too (no host sync), each replay the reference."""
    require_packed_chunks(torch.float16, 128)
    from gemmgen.ops import torch_op

    first = [300, 0, 1000]
    case = make_case(3, 256, 8, 2, 128, torch.float16, first, nnew=nnew, capacity=1100, key=("packed-graph", nnew))

    def call():
        return gemmgen.fused_attention_with_kvcache(case.q, case.k_cache, case.v_cache, case.seqlens, k=case.k,
                                                    v=case.v, return_lse=True)

    torch_op._kernels.clear()
    replay_with_lengths(case, call, ([300, 0, 1000], [1090, 17, 0], [0, 0, 0], [255, 256, 1]),
                        ("packed-graph", nnew))
    assert packed_plans()


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_decode_loop_of_eager_calls(page_size):
    """Calls of one signature back to back, as a decode loop makes them (the eager fast path reuses
    the first call's checks and launch params): new lengths, queries and new tokens at every step,
    each against the reference, with and without LSE."""
    case = make_case(3, 1, 8, 2, 128, torch.bfloat16, [5, 0, 300], page_size=page_size, nnew=1, capacity=512,
                     key=("loop", page_size))
    for step in range(4):
        lengths = [5 + 37 * step, step, 300 - 50 * step]
        case.set_lengths(lengths, ("loop", page_size, step))
        o, lse = run(case)
        check_result(case, lengths, o, lse)
        case.set_lengths(lengths, ("loop", page_size, step))
        assert torch.equal(run(case, return_lse=False), o)


def test_one_split_and_many_splits():
    """Many sequences fill the GPU (one CTA per row tile), few split their keys; both give the reference."""
    for b, hkv, lengths, expect_split in ((128, 8, [(37 * i) % 3000 for i in range(128)], False),
                                          (2, 1, [2999, 1500], True)):
        case = make_case(b, 1, 4 * hkv, hkv, 64, torch.float16, lengths, page_size=256, key=("splits", b))
        problem = calls.problem_for_kvcache(case.q, case.k_cache, case.v_cache, case.capacity, True)
        cand = selection.select(problem)
        assert cand.entry.family == "decode_sm80"
        assert (selection.splits(cand, problem) > 1) == expect_split
        o, lse = run(case)
        check_result(case, lengths, o, lse)


def test_kept_workspaces_per_stream():
    """Split calls outside graph capture share one workspace per (device, stream): calls queued on
    two streams at once, a small split call and then a larger one on the same stream (the kept
    buffer grows while the first call may still run), and a kept buffer filled with NaN bytes
    before a call, all give the reference; each call's O equals that call alone."""
    from gemmgen.kernels import launch

    small = make_case(1, 1, 32, 8, 128, torch.bfloat16, [1000], key=("kept", "small"))
    large = make_case(2, 4, 32, 8, 128, torch.bfloat16, [65537, 30000], key=("kept", "large"))
    alone = {}
    for name, case in (("small", small), ("large", large)):
        o, lse = run(case)
        alone[name] = o.clone()
    lengths = {"small": [1000], "large": [65537, 30000]}
    launch.release_stream_workspaces()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = []
    for step in range(6):  # no synchronization between the calls: the streams overlap
        for s, case_name in zip(streams, ("small", "large") if step % 2 else ("large", "small")):
            with torch.cuda.stream(s):
                case = small if case_name == "small" else large
                outs.append((case_name, gemmgen.fused_attention_with_kvcache(case.q, case.k_cache, case.v_cache,
                                                                             case.seqlens)))
    torch.cuda.synchronize()
    for name, o in outs:
        assert same_bits(o, alone[name]), f"{name}: a call sharing its stream's workspace changed O"
    assert len(launch._stream_workspaces) >= 2  # one per stream
    launch.release_stream_workspaces()
    small_o = gemmgen.fused_attention_with_kvcache(small.q, small.k_cache, small.v_cache, small.seqlens)
    large_o = gemmgen.fused_attention_with_kvcache(large.q, large.k_cache, large.v_cache, large.seqlens)
    torch.cuda.synchronize()
    assert same_bits(small_o, alone["small"]) and same_bits(large_o, alone["large"])
    for buf in launch._stream_workspaces.values():
        buf.fill_(0xFF)  # NaN in every float the kernels could read without writing first
    o, lse = run(large)
    check_result(large, lengths["large"], o, lse)


@pytest.mark.parametrize("splits", [2, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("d", [64, 128])
def test_forced_split_counts(monkeypatch, splits, d):
    """The combine's two layouts (a row's splits over two warps below four splits, four warps from
    four on) at split counts the heuristic may not pick for these shapes: per-sequence lengths with
    empty splits (short and empty sequences), Nq 2 with GQA 4, paged; and a bad length's NaN rows
    beside good ones."""
    from gemmgen.ops import torch_op

    monkeypatch.setattr(selection, "splits", lambda cand, problem: splits)
    monkeypatch.setattr(torch_op, "_kernels", {})  # plans made under the real split count stay out
    lengths = [4097, 0, 17, 1300, 64]
    case = make_case(5, 2, 8, 2, d, torch.bfloat16, lengths, page_size=64, nnew=1, key=("forced", splits, d))
    o, lse = run(case)
    check_result(case, lengths, o, lse)
    case.seqlens[1] = -3  # a bad length: NaN rows there, the others unchanged
    o2, lse2 = run(case)
    assert torch.isnan(o2[1]).all() and torch.isnan(lse2[1]).all()
    for i in (0, 2, 3, 4):
        assert torch.equal(o2[i], o[i]) and torch.equal(lse2[i], lse[i]), f"sequence {i} changed"


def test_every_default_instance():
    """Each default instance forced by name (both tiles, both head dims, both dtypes)."""
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for inst in decode_sm80.DEFAULT:
        lengths = [0, 17, 1000]
        case = make_case(3, 4, 8, 2, inst.head_dim, dtypes[inst.dtype.value], lengths, page_size=16, nnew=1,
                         key=("inst", inst.name))
        o, lse = run(case, instance=inst.name)
        try:
            check_result(case, lengths, o, lse)
        except AssertionError as e:
            raise AssertionError(f"{inst.name}: {e}") from None


def test_strided_layouts_scales_and_return_types():
    """q stored [B, H, Nq, d], caches stored [B, Hkv, N, d] (transpose(1, 2) views) and new tokens
    sliced from wider rows; explicit and negative scales; O is a new [B, Nq, H, d] tensor; without
    return_lse only O comes back, the same values."""
    lengths = [300, 5]
    case = make_case(2, 3, 8, 2, 64, torch.bfloat16, lengths, nnew=2, key="strided")
    q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    kc, vc = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (case.k_cache, case.v_cache))
    k, v = (torch.cat([t, torch.zeros_like(t)], dim=3)[..., :64] for t in (case.k, case.v))
    strided = dataclasses.replace(case, q=q, k_cache=kc, v_cache=vc, k=k, v=v)
    assert not any(t.is_contiguous() for t in (q, kc, vc, k, v))
    want_k, want_v = strided.expected_caches(lengths)
    o, lse = run(strided)
    assert o.shape == q.shape and o.is_contiguous()
    assert same_bits(kc, want_k) and same_bits(vc, want_v)
    check_result(strided, lengths, o, lse)
    for scale in (0.3, -0.4):
        o, lse = run(strided, scale=scale, causal=False)  # appends the same rows again
        check_result(strided, lengths, o, lse, causal=False, scale=scale)
    only = run(strided, causal=False, scale=-0.4, return_lse=False)
    assert isinstance(only, torch.Tensor) and torch.equal(only, o)


# ---- appending new keys and values -----------------------------------------------------------------

@pytest.mark.parametrize("nnew", [1, 5])
@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
def test_append_new_tokens(page_size, nnew):
    """New tokens land at rows cache_seqlens[b] .. + Nnew - 1 (across a page boundary, up to the
    capacity exactly), every other row untouched, cache_seqlens unchanged, and the attention sees them."""
    capacity = 512
    lengths = [0, 15, 255, capacity - nnew, 100]
    for dtype in DTYPES:
        case = make_case(5, nnew, 8, 2, 128, dtype, lengths, page_size=page_size, nnew=nnew, capacity=capacity,
                         key=("append", page_size, nnew, dtype))
        want_k, want_v = case.expected_caches(lengths)
        assert not same_bits(want_k, case.k_cache)
        o, lse = run(case)
        assert same_bits(case.k_cache, want_k) and same_bits(case.v_cache, want_v), "cache rows written wrong"
        assert case.seqlens.tolist() == lengths, "cache_seqlens must not change"
        check_result(case, lengths, o, lse)
        # Nq other than Nnew, no mask.
        case.set_lengths(lengths, ("append-2", page_size, nnew, dtype))
        sub = dataclasses.replace(case, q=case.q[:, :1])
        o, lse = run(sub, causal=False)
        check_result(sub, lengths, o, lse, causal=False)


# ---- CUDA graphs and torch.compile -------------------------------------------------------------------

@pytest.mark.parametrize("nnew", [0, 3])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
def test_cuda_graph_replays_with_new_lengths(page_size, nnew):
    """Captured once (check_values=True is skipped under capture), replayed with new cache_seqlens
    copied into the captured tensor, new q and new tokens: each replay gives the reference, and
    appends where that replay's lengths say."""
    first = [10, 0, 2000, 1]
    case = make_case(4, 4, 8, 2, 64, torch.float16, first, page_size=page_size, nnew=nnew, capacity=2048,
                     key=("graph", page_size, nnew))

    def call():
        return gemmgen.fused_attention_with_kvcache(case.q, case.k_cache, case.v_cache, case.seqlens,
                                                    block_table=case.table, k=case.k, v=case.v, return_lse=True,
                                                    check_values=True)

    replay_with_lengths(case, call, ([10, 0, 2000, 1], [2045, 7, 0, 64], [0, 0, 0, 0], [1, 1999, 16, 33]),
                        ("graph", page_size, nnew))


def test_torch_compile_fullgraph():
    """A function calling fused_attention_with_kvcache compiled with fullgraph=True: the caches are
    appended in place and the results are the reference's, for two sets of lengths (one compile)."""
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, seqlens, table, k, v):
        o, lse = gemmgen.fused_attention_with_kvcache(q, k_cache, v_cache, seqlens, block_table=table, k=k, v=v,
                                                      return_lse=True)
        return o * 1.0, lse

    compiled = torch.compile(step, fullgraph=True)
    case = make_case(3, 2, 8, 2, 128, torch.bfloat16, [5, 0, 700], page_size=16, nnew=2, capacity=1024,
                     key="compile")
    for i, lengths in enumerate(([5, 0, 700], [1022, 31, 0])):
        case.set_lengths(lengths, ("compile", i))
        want_k, want_v = case.expected_caches(lengths)
        o, lse = compiled(case.q, case.k_cache, case.v_cache, case.seqlens, case.table, case.k, case.v)
        torch.cuda.synchronize()
        assert same_bits(case.k_cache, want_k) and same_bits(case.v_cache, want_v), f"call {i}: cache rows"
        check_result(case, lengths, o, lse)
    torch._dynamo.reset()


# ---- bad lengths and block tables ----------------------------------------------------------------------

def test_check_values_raise_outside_capture():
    lengths = [3, 40]
    case = make_case(2, 1, 4, 2, 64, torch.float16, lengths, page_size=16, nnew=2, capacity=64, spare_pages=0,
                     key="errors")
    before_k = case.k_cache.clone()
    case.seqlens.copy_(torch.tensor([3, 63], dtype=I32))  # 63 + 2 new > 64
    with pytest.raises(gemmgen.InputError, match=r"cache_seqlens \+ new tokens must lie in \[0, 64\]"):
        run(case, check_values=True)
    case.seqlens.copy_(torch.tensor([-1, 3], dtype=I32))
    with pytest.raises(gemmgen.InputError, match=r"must lie in \[0, 64\]"):
        run(case, check_values=True)
    assert same_bits(case.k_cache, before_k), "nothing is appended when the check raises"
    case.seqlens.copy_(torch.tensor(lengths, dtype=I32))
    table = case.table.clone()
    case.table[1, 2] = 999  # keys 32..47 of sequence 1: used (40 + 2 keys)
    with pytest.raises(gemmgen.InputError, match=r"block_table\[1, 2\] = 999 is not a page of the cache \(0 to 7\)"):
        run(case, check_values=True)
    case.table.copy_(table)
    case.table[0, 3] = -7  # sequence 0 holds 5 keys: its fourth page is never read
    want_k, want_v = case.expected_caches(lengths)
    o, lse = run(case, check_values=True)
    check_result(case, lengths, o, lse)
    assert same_bits(case.k_cache, want_k)


def test_bad_lengths_and_pages_give_nan_rows_without_the_check():
    """Without check_values a sequence whose length (new tokens included) lies outside [0, capacity],
    or whose used pages are not pages of the cache, gets NaN rows in O and LSE (never a fault), its
    new tokens are not appended, and the other sequences are right."""
    lengths = [3, 40, 100, 7]
    case = make_case(4, 2, 4, 2, 64, torch.bfloat16, lengths, page_size=16, nnew=2, capacity=128, spare_pages=0,
                     key="nan")
    case.table[2, 1] = 10_000  # keys 16..31 of sequence 2
    case.seqlens.copy_(torch.tensor([3, 127, 100, -5], dtype=I32))  # 1: 127 + 2 > 128; 3: negative
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    case.write_rows(want_k, want_v, 0, 3, 5)  # sequence 0 is appended; 1 and 3 are not
    o, lse = run(case)
    for i in (1, 2, 3):
        assert torch.isnan(o[i]).all() and torch.isnan(lse[i]).all(), f"sequence {i} must be NaN"
    check_result(case, [3, 0, 0, 0], o, lse, skip=(1, 2, 3))
    # Sequence 2's new tokens go to a good page (keys 100, 101): written or not, they are not checked.
    page, row = case.slots(2, torch.arange(100, 102, device="cuda"))
    for want, got in ((want_k, case.k_cache), (want_v, case.v_cache)):
        want[page, row] = got[page, row]
        assert same_bits(got, want), "a bad sequence's rows were appended, or a good one's were not"


def test_negative_length_with_new_tokens_is_nan():
    """cache_seqlens -1 with 5 new tokens: no row is appended, so the sequence must not attend to
    the 4 rows its length plus the new tokens would name (stale rows): NaN rows, as for any bad length."""
    case = make_case(2, 1, 4, 2, 64, torch.float16, [4, 10], nnew=5, capacity=64, key="negative")  # rows 0..3 hold keys
    case.seqlens.copy_(torch.tensor([-1, 10], dtype=I32))
    before_k = case.k_cache.clone()
    o, lse = run(case)
    assert same_bits(case.k_cache[0], before_k[0]), "a negative length appends nothing"
    assert torch.isnan(o[0]).all() and torch.isnan(lse[0]).all()
    check_result(case, [4, 10], o, lse, skip=(0,))


def test_other_bad_inputs_on_the_gpu():
    """What only a GPU call reaches: tensors on two devices, misaligned data pointers; and a strided
    cache_seqlens view, which must raise or be read by its stride, never misread."""
    lengths = [9, 30]
    case = make_case(2, 1, 4, 2, 64, torch.float16, lengths, nnew=1, capacity=64, key="bad-gpu")
    with pytest.raises(gemmgen.InputError, match="every tensor must be on one device"):
        run(dataclasses.replace(case, seqlens=case.seqlens.cpu()))
    shifted = torch.empty(case.q.numel() + 8, dtype=case.q.dtype, device="cuda")[1:1 + case.q.numel()]
    with pytest.raises(gemmgen.InputError, match="q's data pointer is not 16-byte aligned"):
        run(dataclasses.replace(case, q=shifted.view(case.q.shape)))
    wide = torch.zeros(4, dtype=I32, device="cuda")
    wide[::2] = case.seqlens
    wide[1::2] = 1000  # what a contiguous read of the view would take for sequence 1's length
    strided = dataclasses.replace(case, seqlens=wide[::2])
    want_k, want_v = case.expected_caches(lengths)
    try:
        o, lse = run(strided)
    except gemmgen.InputError as e:
        assert "cache_seqlens" in str(e)
        return
    assert same_bits(case.k_cache, want_k) and same_bits(case.v_cache, want_v)
    check_result(case, lengths, o, lse)


# ---- the dense path on decode shapes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("nq", [1, 4])
def test_dense_fused_attention_on_decode_shapes(nq, dtype):
    """gemmgen.fused_attention on B=4 H=32 Hkv=8 Nk=4097 with Nq 1 and 4 selects a decode instance
    (no mask) and matches the reference; the decode instance also runs both causal alignments."""
    q, k, v = make_qkv(4, 32, 8, nq, 4097, 128, dtype, ("dense", nq, dtype))
    name = gemmgen.selected_instance(q, k, v)
    assert name.startswith("decode_sm80_"), name
    # selected_instance takes no causal_alignment: ask the selection for the bottom-right call.
    bottom_right = calls.problem_for(q, k, True, v=v, causal_alignment="bottom_right")
    assert selection.select(bottom_right).entry.family == "decode_sm80"
    check(q, k, v)
    for alignment in ("bottom_right", "top_left"):
        check(q, k, v, causal=True, alignment=alignment)
        check(q, k, v, causal=True, alignment=alignment, instance=name)
    # [B, N, H, d] storage, as a KV cache holds it.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    check(qt, kt, vt, causal=True, alignment="bottom_right", instance=name)


# ---- sliding windows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("window, causal", [((255, 0), True), ((16, 7), False), ((-1, 3), False), ((40, -1), False)],
                         ids=["causal-255", "16-7", "right-3", "left-40"])
@pytest.mark.parametrize("nq", [1, 4, 200])
def test_windows(layout, window, causal, nq):
    """A sliding window around each sequence's bottom-right diagonal: lengths 0 to 5000 per sequence
    with new tokens appended first, contiguous or paged, GQA 4:1; 200 query rows take the dense
    chunk path."""
    lengths = [0, 17, 700, 5000]
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64)):
        case = make_case(4, nq, 8, 2, d, dtype, lengths, page_size=layout, nnew=2, key=(layout, window, nq, d))
        o, lse = run(case, causal=causal, window=window)
        check_result(case, lengths, o, lse, causal=causal, window=window)
