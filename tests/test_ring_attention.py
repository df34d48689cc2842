"""Context-parallel ring attention on CPU: the LSE merge rule against attention over split keys
(rows that see no key included), the zigzag and contiguous visibility plans against the mask of
the global positions for W = 1..4, the shard helpers, the input checks, and ring_attention's
forward and backward against float64 attention over the gathered full sequence: in-process rings
(LocalRing, one thread per rank) over many shapes, and real gloo process groups of 2 and 4
processes. Inputs are float64, so every comparison is tight (1e-9 relative)."""
from __future__ import annotations

import dataclasses
import datetime
import math
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gemmgen.distributed as cp
from gemmgen.distributed import layouts
from gemmgen.errors import InputError
from gemmgen.ops.reference import attention_reference

TOL = 1e-9  # max |got - want| / max(1, max |want|), float64 end to end
GLOO_TIMEOUT = datetime.timedelta(seconds=120)


# ---- the independent float64 reference ------------------------------------------------------------

def full_attention(q, k, v, causal, scale):
    """(O, LSE) of softmax(scale Q K^T + causal mask) V over the full sequence, differentiable."""
    group = q.shape[1] // k.shape[1]
    s = scale * (q @ k.repeat_interleave(group, 1).transpose(-2, -1))
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(group, 1), torch.logsumexp(s, -1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if torch.isnan(got).any():
        return math.inf
    return (got.double() - want.double()).abs().max().item() / max(1.0, want.abs().max().item())


def rand(shape, key, dtype=torch.float64):
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# ---- the merge rule --------------------------------------------------------------------------------

def _parts(n_keys: int, cuts: int, key) -> list[torch.Tensor]:
    """A random partition of the key indices into `cuts` non-empty sets (not contiguous)."""
    order = torch.randperm(n_keys, generator=torch.Generator().manual_seed(zlib.crc32(repr(key).encode())))
    return [order[i::cuts] for i in range(cuts)]


@pytest.mark.parametrize("cuts", [1, 2, 3, 5])
@pytest.mark.parametrize("acc", [torch.float64, torch.float32])
def test_merge_matches_full_attention_on_split_keys(cuts, acc):
    """Merging the (O, LSE) of each key subset, starting from (0, -inf), gives attention over all
    keys; a mask makes rows see no key in some subsets, and rows 0 and 5 in none (O 0, LSE -inf)."""
    b, h, nq, nk, d = 2, 3, 7, 11, 8
    q, k, v = rand((b, h, nq, d), "q"), rand((b, h, nk, d), "k"), rand((b, h, nk, d), "v")
    bias = torch.where(rand((1, 1, nq, nk), "mask") > 0.3, float("-inf"), 0.0).to(torch.float64)
    bias[..., 0, :] = float("-inf")
    bias[..., 5, :] = float("-inf")
    want_o, want_lse = attention_reference(q, k, v, scale=0.4, bias=bias)
    out = torch.zeros((b, h, nq, d), dtype=acc)
    lse = torch.full((b, h, nq), float("-inf"), dtype=acc)
    for idx in _parts(nk, cuts, ("parts", cuts)):
        o_b, lse_b = attention_reference(q, k[:, :, idx], v[:, :, idx], scale=0.4, bias=bias[..., idx])
        cp.merge_partial(out, lse, o_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.isneginf(lse[:, :, [0, 5]]).all() and (out[:, :, [0, 5]] == 0).all()
    finite = torch.isfinite(want_lse)
    tol = 1e-12 if acc == torch.float64 else 1e-5
    assert rel_err(out, want_o) <= tol
    assert rel_err(lse[finite], want_lse[finite]) <= tol


def test_merge_keeps_rows_whose_new_part_is_empty():
    out, lse = torch.tensor([[1.0, 2.0]]), torch.tensor([0.5])
    cp.merge_partial(out, lse, torch.zeros(1, 2), torch.tensor([float("-inf")]))
    assert torch.equal(out, torch.tensor([[1.0, 2.0]])) and torch.equal(lse, torch.tensor([0.5]))
    empty_out, empty_lse = torch.zeros(1, 2), torch.tensor([float("-inf")])
    cp.merge_partial(empty_out, empty_lse, torch.tensor([[3.0, 4.0]]), torch.tensor([-2.0]))
    assert torch.equal(empty_out, torch.tensor([[3.0, 4.0]])) and torch.equal(empty_lse, torch.tensor([-2.0]))


def test_merge_of_equal_halves_averages():
    """Two parts of equal mass: O is their mean and LSE grows by log 2 (the rule is not a no-op)."""
    out, lse = torch.tensor([[1.0, 3.0]], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64)
    cp.merge_partial(out, lse, torch.tensor([[3.0, 5.0]], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64))
    assert torch.allclose(out, torch.tensor([[2.0, 4.0]], dtype=torch.float64))
    assert torch.allclose(lse, torch.tensor([0.25 + math.log(2.0)], dtype=torch.float64))


# ---- the visibility plans --------------------------------------------------------------------------

def plan_coverage(rank, source, world, n_local, layout, causal) -> torch.Tensor:
    """How many times the plan computes each (local query, key of the block) pair."""
    count = torch.zeros(n_local, n_local, dtype=torch.int64)
    for blk in cp.visible_blocks(rank, source, world, n_local, layout, causal):
        sub = count[blk.q, blk.k]
        rect = torch.ones_like(sub)
        sub += rect.tril() if blk.causal else rect
    return count


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_covers_exactly_the_visible_pairs(world, causal, layout):
    """Every rank, every source block, chunks of 1 to 3 rows: each pair the global mask allows is
    computed once and no other pair is."""
    for chunk in (1, 2, 3):
        n_global = chunk * layouts.chunk_count(world, layout)
        n_local = n_global // world
        for rank in range(world):
            pos_q = cp.shard_positions(n_global, rank, world, layout)
            for step in range(world):
                source = cp.source_rank(rank, step, world)
                pos_k = cp.shard_positions(n_global, source, world, layout)
                want = (pos_k[None, :] <= pos_q[:, None]) if causal else torch.ones(n_local, n_local, dtype=torch.bool)
                got = plan_coverage(rank, source, world, n_local, layout, causal)
                assert torch.equal(got, want.to(torch.int64)), f"rank {rank}, block of rank {source}, chunk {chunk}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_balances_causal_work(world):
    """Causal zigzag: every step but the own one computes exactly half of the block's pairs, on
    every rank; contiguous leaves rank 0 with one block and rank W-1 with W."""
    n_local = 6
    for rank in range(world):
        for step in range(1, world):
            blocks = cp.visible_blocks(rank, cp.source_rank(rank, step, world), world, n_local, "zigzag", True)
            assert len(blocks) == 1 and not blocks[0].causal
            assert plan_coverage(rank, cp.source_rank(rank, step, world), world, n_local, "zigzag", True).sum() \
                == n_local * n_local // 2
    calls = [sum(len(cp.visible_blocks(r, s, world, n_local, "contiguous", True)) for s in range(world))
             for r in range(world)]
    assert calls == list(range(1, world + 1))


# ---- layouts and sharding --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_join_back_in_order(world, layout):
    n = 3 * layouts.chunk_count(world, layout)
    x = torch.arange(2 * n * 5).reshape(2, n, 5)
    shards = [cp.take_shard(x, 1, r, world, layout) for r in range(world)]
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, cp.shard_positions(n, r, world, layout)])
    assert torch.equal(cp.join_shards(shards, 1, layout), x)
    all_positions = torch.cat([cp.shard_positions(n, r, world, layout) for r in range(world)])
    assert torch.equal(all_positions.sort().values, torch.arange(n))


def test_zigzag_positions_pair_early_and_late_chunks():
    assert cp.shard_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert cp.shard_positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert cp.shard_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


def test_lengths_that_do_not_cut_are_refused():
    with pytest.raises(InputError, match="4 equal chunks.*length of 6"):
        cp.take_shard(torch.zeros(6), 0, 0, 2, "zigzag")
    with pytest.raises(InputError, match="3 equal chunks.*length of 2"):
        cp.shard_positions(2, 0, 3, "contiguous")
    with pytest.raises(InputError, match="layout must be one of"):
        cp.take_shard(torch.zeros(4), 0, 0, 2, "striped")


# ---- ring_attention: one case, run by every rank of a ring -----------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One ring_attention call: `chunk` rows per chunk (N_local = chunk, or 2 * chunk for zigzag);
    bnhd: the inputs are [B, N, H, d] storage seen as [B, H, N, d]; grad: 'random' dO, or 'sum'
    (the broadcast gradient of O.sum())."""
    layout: str
    causal: bool
    chunk: int
    d: int = 8
    heads: int = 2
    heads_kv: int = 2
    batch: int = 1
    bnhd: bool = False
    dtype: torch.dtype = torch.float64
    grad: str = "random"

    @property
    def id(self) -> str:
        gqa = f"h{self.heads}kv{self.heads_kv}"
        extra = "-bnhd" * self.bnhd + f"-{str(self.dtype)[6:]}" * (self.dtype != torch.float64) + \
            "-sumgrad" * (self.grad == "sum")
        return f"{self.layout}-{'causal' if self.causal else 'full'}-c{self.chunk}-d{self.d}-{gqa}{extra}"


def run_case(case: Case, group, world: int) -> dict[str, float]:
    """ring_attention forward and backward on this rank's shard of the case's inputs (the same on
    every rank), gathered with unshard and compared with full_attention: the relative errors."""
    n = case.chunk * layouts.chunk_count(world, case.layout)
    b, h, hkv, d = case.batch, case.heads, case.heads_kv, case.d
    full = {"q": rand((b, h, n, d), (case.id, "q")), "k": rand((b, hkv, n, d), (case.id, "k")),
            "v": rand((b, hkv, n, d), (case.id, "v")), "do": rand((b, h, n, d), (case.id, "do"))}
    scale = 0.7 / math.sqrt(d)
    leaves = {name: full[name].clone().requires_grad_() for name in ("q", "k", "v")}
    want_o, want_lse = full_attention(leaves["q"], leaves["k"], leaves["v"], case.causal, scale)
    want_do = torch.ones_like(want_o) if case.grad == "sum" else full["do"]
    want_o.backward(want_do)
    want = {"out": want_o, "lse": want_lse, "dq": leaves["q"].grad, "dk": leaves["k"].grad,
            "dv": leaves["v"].grad}

    def local(t):  # this rank's shard, as the case's dtype and layout
        t = t.to(case.dtype)
        if case.bnhd:
            return cp.shard(t.transpose(1, 2).contiguous(), 1, group=group, layout=case.layout).transpose(1, 2)
        return cp.shard(t, 2, group=group, layout=case.layout)

    q, k, v = (local(full[name]).requires_grad_() for name in ("q", "k", "v"))
    out, lse = cp.ring_attention(q, k, v, group=group, causal=case.causal, layout=case.layout, scale=scale,
                                 return_lse=True)
    assert out.dtype == case.dtype and out.stride() == q.stride(), "O must come back in q's dtype and layout"
    assert lse.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32) and lse.shape == q.shape[:3]
    assert not lse.requires_grad
    if case.grad == "sum":
        out.sum().backward()
    else:
        out.backward(local(full["do"]))
    for t in (q, k, v):
        assert t.grad.stride() == t.stride(), "gradients come back in the inputs' layouts"
    got = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: rel_err(cp.unshard(t, 2, group=group, layout=case.layout), want[name].detach())
            for name, t in got.items()}


def run_local(case: Case, world: int) -> dict[str, float]:
    """run_case on every rank of an in-process ring (one thread per rank); rank 0's errors, after
    checking that every rank gathered the same."""
    results = cp.LocalRing.run(cp.LocalRing.create(world, timeout=60), lambda ring: run_case(case, ring, world))
    assert all(r == results[0] for r in results)
    return results[0]


def assert_small(errors: dict[str, float], tol: float = TOL) -> None:
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"relative errors above {tol:.0e}: {bad}"


LOCAL_CASES = [
    Case(layout, causal, chunk, d=d, heads=h, heads_kv=hkv)
    for layout in cp.LAYOUTS for causal in (False, True)
    for chunk, d, h, hkv in ((1, 8, 2, 2), (3, 16, 4, 2), (17, 8, 3, 1))
]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_local_ring_matches_full_attention(case, world):
    """Forward and backward over an in-process ring against float64 attention over the whole
    sequence: both layouts, causal and not, GQA and MQA, N_local 1, 3, 17 (contiguous) and 2, 6,
    34 (zigzag), d 8 and 16."""
    assert_small(run_local(case, world))


@pytest.mark.parametrize("case", [
    Case("zigzag", True, 3, heads=4, heads_kv=2, bnhd=True),
    Case("contiguous", True, 5, d=16, bnhd=True, grad="sum"),
    Case("zigzag", False, 2, batch=2, grad="sum"),
], ids=lambda c: c.id)
def test_local_ring_layouts_and_gradients(case):
    """[B, N, H, d] storage views in and out, a broadcast gradient (O.sum()), batch 2."""
    assert_small(run_local(case, 3))


def test_local_ring_float32_accumulates_in_float32():
    assert_small(run_local(Case("zigzag", True, 4, d=16, heads=4, heads_kv=1, dtype=torch.float32), 4), 1e-5)


def test_a_wrong_layout_is_caught(monkeypatch):
    """The comparison can fail: zigzag shards run with the contiguous plan give wrong results."""
    from gemmgen.distributed import schedule

    original = schedule.visible_blocks
    monkeypatch.setattr(schedule, "visible_blocks", lambda rank, source, world, n_local, layout, causal:
                        original(rank, source, world, n_local, "contiguous", causal))
    errors = run_local(Case("zigzag", True, 3), 2)
    assert errors["out"] > 1e-3 and errors["dk"] > 1e-3


# ---- real process groups: gloo, 2 and 4 processes ---------------------------------------------------

GLOO_CASES = {
    2: [Case("zigzag", True, 3, d=8, heads=4, heads_kv=2),
        Case("zigzag", False, 1, d=16),
        Case("contiguous", True, 17, d=8, heads=3, heads_kv=1),
        Case("contiguous", False, 1, d=16, heads=4, heads_kv=2),
        Case("zigzag", True, 17, d=16, bnhd=True, grad="sum")],
    4: [Case("zigzag", True, 3, d=16, heads=4, heads_kv=1),
        Case("contiguous", True, 3, d=8, heads=2, heads_kv=2),
        Case("zigzag", False, 1, d=8, heads=4, heads_kv=2)],
}


def gloo_worker(rank: int, world: int, init_file: str, out_file: str, cases: list[Case]) -> None:
    """One process of the gloo group: every case, rank 0 saving {case id: errors}."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        results = {case.id: run_case(case, None, world) for case in cases}
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def gloo_results(world: int, tmp: Path) -> dict[str, dict[str, float]]:
    out_file = tmp / "results.pt"
    mp.spawn(gloo_worker, args=(world, str(tmp / "init"), str(out_file), GLOO_CASES[world]), nprocs=world)
    return torch.load(out_file)


@pytest.fixture(scope="module")
def gloo_2(tmp_path_factory):
    return gloo_results(2, tmp_path_factory.mktemp("gloo2"))


@pytest.fixture(scope="module")
def gloo_4(tmp_path_factory):
    return gloo_results(4, tmp_path_factory.mktemp("gloo4"))


@pytest.mark.parametrize("case", GLOO_CASES[2], ids=lambda c: c.id)
def test_gloo_2_processes(gloo_2, case):
    assert_small(gloo_2[case.id])


@pytest.mark.parametrize("case", GLOO_CASES[4], ids=lambda c: c.id)
def test_gloo_4_processes(gloo_4, case):
    assert_small(gloo_4[case.id])


# ---- input checks ----------------------------------------------------------------------------------

def _qkv(n=4, h=2, hkv=2, d=8, dtype=torch.float64):
    return rand((1, h, n, d), "q", dtype), rand((1, hkv, n, d), "k", dtype), rand((1, hkv, n, d), "v", dtype)


def test_needs_a_process_group_or_a_ring():
    assert not dist.is_initialized()
    with pytest.raises(InputError, match="init_process_group"):
        cp.ring_attention(*_qkv())
    with pytest.raises(InputError, match="init_process_group"):
        cp.shard(torch.zeros(4), 0)


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q, k, v[:, :, :3]), "k and v must have one shape"),
    (lambda q, k, v: (q, k[:, :, :2], v[:, :, :2]), "same rows of the sequence"),
    (lambda q, k, v: (q.float(), k, v), "share one dtype"),
    (lambda q, k, v: (q, k.to("meta"), v), "on one device"),
    (lambda q, k, v: (q[0], k, v), "must be 4-D"),
    (lambda q, k, v: (q, k[:, :1].expand(1, 3, 4, 8), v[:, :1].expand(1, 3, 4, 8)), "must divide q's 2"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), "head_dim must be equal"),
])
def test_bad_tensors_are_refused(change, message):
    ring = cp.LocalRing.create(1)[0]
    with pytest.raises(InputError, match=message):
        cp.ring_attention(*change(*_qkv()), group=ring)


def test_bad_arguments_are_refused():
    ring = cp.LocalRing.create(2)[0]
    q, k, v = _qkv(n=3)
    with pytest.raises(InputError, match="local length must be even; got 3"):
        cp.ring_attention(q, k, v, group=ring, layout="zigzag")
    q, k, v = _qkv()
    with pytest.raises(InputError, match="does not support dropout"):
        cp.ring_attention(q, k, v, group=ring, dropout_p=0.1)
    with pytest.raises(InputError, match="layout must be one of"):
        cp.ring_attention(q, k, v, group=ring, layout="ring")
    with pytest.raises(InputError, match="causal must be a bool"):
        cp.ring_attention(q, k, v, group=ring, causal="yes")
    with pytest.raises(InputError, match="scale must be finite"):
        cp.ring_attention(q, k, v, group=ring, scale=float("inf"))
    with pytest.raises(InputError, match="GemmgenBlocks runs torch.float16, torch.bfloat16; got torch.float64"):
        cp.ring_attention(q, k, v, group=ring, blocks=cp.GemmgenBlocks())
    with pytest.raises(InputError, match="group must be a torch.distributed ProcessGroup"):
        _initialized_then(lambda: cp.ring_attention(q, k, v, group="world"))


def _initialized_then(fn):
    """fn() inside a one-process gloo group (destroyed afterwards)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def test_one_process_group_runs_and_checks_the_backend():
    """A real one-rank gloo group: the ring of one rank is plain attention; gloo refuses other
    devices than the CPU (the meta device stands in for CUDA here)."""
    q, k, v = _qkv(n=6)

    def run():
        out = cp.ring_attention(q, k, v, causal=True)
        with pytest.raises(InputError, match="gloo, whose point-to-point transfers move CPU tensors"):
            cp.ring_attention(*(t.to("meta") for t in (q, k, v)), blocks=cp.ReferenceBlocks())
        return out

    out = _initialized_then(run)
    want, _ = full_attention(q, k, v, True, 1 / math.sqrt(8))
    assert rel_err(out, want) <= TOL


def test_local_ring_timeout_names_the_missing_rank():
    ring = cp.LocalRing.create(2, timeout=0.05)[0]
    with pytest.raises(RuntimeError, match="no block arrived from rank 1"):
        ring.exchange(torch.zeros(2), 0).wait()
