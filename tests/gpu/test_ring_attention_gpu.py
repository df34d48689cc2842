"""Context-parallel ring attention on GPUs with gemmgen's kernels as the block primitive, forward
and backward against float64 attention over the full sequence: on one GPU a simulated world of 2
to 4 ranks (in-process rings, one thread per rank, driving the ring schedule), and on 2 and 4 GPUs
real NCCL process groups (one process per GPU), causal and not, zigzag and contiguous, GQA, N_global
4096 and 2 * W * 129. Needs the default build (`gemmgen generate --arch sm80`). Inputs are fresh
random tensors, a different seed per case; the caching allocator is handed NaN-filled blocks of the
ring's buffer sizes (received blocks, gradient partials, outputs) before each run, and NaN never
passes."""
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
from gemmgen.distributed.schedule import RingConfig, ring_backward, ring_forward
from gemmgen.errors import InputError

pytestmark = pytest.mark.gpu

# ||X - ref|| / ||ref||: the forward's O (blocks rounded to the input dtype before the float32
# merge), and the gradients (as for the single-GPU backward).
OUT_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
GRAD_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}
LSE_TOLERANCE = 1e-3  # relative to max(1, |LSE|)
NCCL_TIMEOUT = datetime.timedelta(minutes=10)  # the first call of a shape may compile an instance


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str
    causal: bool
    n_global: int
    d: int = 128
    heads: int = 4
    heads_kv: int = 2
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16

    @property
    def id(self) -> str:
        return (f"{self.layout}-{'causal' if self.causal else 'full'}-n{self.n_global}-d{self.d}-"
                f"h{self.heads}kv{self.heads_kv}-{str(self.dtype)[6:]}")


def randn(shape, dtype, key, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, dtype=dtype, device=device, generator=gen)


def inputs(case: Case, device) -> dict[str, torch.Tensor]:
    """The full sequence's q, k, v and dO (the same on every rank: one seed per case)."""
    b, h, hkv, n, d = case.batch, case.heads, case.heads_kv, case.n_global, case.d
    return {"q": randn((b, h, n, d), case.dtype, (case.id, "q"), device),
            "k": randn((b, hkv, n, d), case.dtype, (case.id, "k"), device),
            "v": randn((b, hkv, n, d), case.dtype, (case.id, "v"), device),
            "do": randn((b, h, n, d), case.dtype, (case.id, "do"), device)}


def reference(full: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """float64 O, LSE, dQ, dK, dV over the full sequence."""
    q, k, v = (full[x].double().requires_grad_() for x in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    lse = torch.logsumexp(s, -1)
    out.backward(full["do"].double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative norm errors (LSE: max relative error); NaN anywhere counts as infinite."""
    out = {}
    for name, g in got.items():
        w = want[name]
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        if torch.isnan(g).any():
            out[name] = math.inf
        elif name == "lse":
            out[name] = ((g.double() - w).abs() / w.abs().clamp_min(1.0)).max().item()
        else:
            out[name] = (g.double() - w).norm().item() / w.norm().item()
    return out


def failures(case: Case, errs: dict[str, float]) -> list[str]:
    bad = []
    for name, err in errs.items():
        tol = LSE_TOLERANCE if name == "lse" else OUT_TOLERANCE[case.dtype] if name == "out" else \
            GRAD_TOLERANCE[case.dtype]
        if not err <= tol:
            bad.append(f"{case.id} {name}: {err:.3e} (tolerance {tol:.0e})")
    return bad


def poison_allocator(case: Case, world: int) -> None:
    """Leave NaN-filled blocks of the ring's buffer sizes in the caching allocator."""
    n = case.n_global // world
    kv = (2, case.batch, case.heads_kv, n, case.d)
    blocks = [torch.full(kv, math.nan, dtype=case.dtype, device="cuda"),
              torch.full(kv, math.nan, dtype=torch.float32, device="cuda"),
              torch.full((case.batch, case.heads, n, case.d), math.nan, dtype=case.dtype, device="cuda")]
    del blocks


# ---- one GPU, a simulated world ---------------------------------------------------------------------

def warm_up(blocks: cp.GemmgenBlocks, shards: dict[str, torch.Tensor], case: Case, world: int) -> None:
    """Select (or compile) the kernels of every block shape from one thread, before the ranks' threads
    call them concurrently."""
    n = shards["q"].shape[2]
    shapes = {(len(range(n)[b.q]), len(range(n)[b.k]), b.causal)
              for r in range(world) for s in range(world)
              for b in cp.visible_blocks(r, s, world, n, case.layout, case.causal)}
    scale = 1 / math.sqrt(case.d)
    for nq, nk, causal in shapes:
        q, k, v, do = shards["q"][:, :, :nq], shards["k"][:, :, :nk], shards["v"][:, :, :nk], shards["do"][:, :, :nq]
        o, lse = blocks.forward(q, k, v, causal, scale)
        blocks.backward(do, q, k, v, o, lse, causal, scale)
    torch.cuda.synchronize()


def run_simulated(case: Case, world: int) -> dict[str, float]:
    """The ring schedule over `world` in-process ranks on this GPU (one thread each, without
    autograd: ring_forward, then ring_backward from the global O and LSE)."""
    full = inputs(case, "cuda")
    shards = [{x: cp.take_shard(t, 2, r, world, case.layout) for x, t in full.items()} for r in range(world)]
    blocks = cp.GemmgenBlocks()
    warm_up(blocks, shards[0], case, world)
    rings = cp.LocalRing.create(world, timeout=300)

    def rank_main(ring) -> dict:
        s = shards[ring.rank]
        config = RingConfig(ring=ring, blocks=blocks, layout=case.layout, causal=case.causal,
                            scale=1 / math.sqrt(case.d))
        with torch.no_grad():
            out_acc, lse = ring_forward(s["q"], s["k"], s["v"], config)
            out = out_acc.to(case.dtype)
            dq, dk, dv = ring_backward(s["do"], s["q"], s["k"], s["v"], out, lse, config)
        return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}

    poison_allocator(case, world)
    got = cp.LocalRing.run(rings, rank_main)
    torch.cuda.synchronize()
    joined = {name: cp.join_shards([g[name] for g in got], 2, case.layout) for name in got[0]}
    return errors(joined, reference(full, case.causal))


SIMULATED = [Case(layout, causal, n, d=d, heads=h, heads_kv=hkv, dtype=dtype)
             for layout in cp.LAYOUTS for causal in (False, True)
             for n, d, h, hkv, dtype in ((2048, 128, 4, 2, torch.bfloat16), (8 * 129, 64, 3, 1, torch.float16))]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", SIMULATED, ids=lambda c: c.id)
def test_simulated_world_on_one_gpu(case, world):
    """gemmgen's forward and backward kernels as the ring's blocks, merged and accumulated by the
    ring schedule, over 2 and 4 simulated ranks."""
    bad = failures(case, run_simulated(case, world))
    assert not bad, "; ".join(bad)


def test_ring_attention_forward_on_a_simulated_world():
    """The public entry point under no_grad over in-process ranks; training through autograd with
    a LocalRing on CUDA is refused (one autograd thread per GPU would deadlock the ranks)."""
    case, world = Case("zigzag", True, 1024, d=64), 2
    full = inputs(case, "cuda")
    rings = cp.LocalRing.create(world, timeout=300)
    shards = [{x: cp.take_shard(t, 2, r, world, case.layout) for x, t in full.items()} for r in range(world)]
    warm_up(cp.GemmgenBlocks(), shards[0], case, world)

    def rank_main(ring):
        with torch.no_grad():
            s = shards[ring.rank]
            return cp.ring_attention(s["q"], s["k"], s["v"], group=ring, causal=True, layout="zigzag",
                                     return_lse=True)

    got = cp.LocalRing.run(rings, rank_main)
    joined = {"out": cp.join_shards([g[0] for g in got], 2, "zigzag"),
              "lse": cp.join_shards([g[1] for g in got], 2, "zigzag")}
    want = reference(full, True)
    bad = failures(case, errors(joined, want))
    assert not bad, "; ".join(bad)
    q = shards[0]["q"].clone().requires_grad_()
    with pytest.raises(InputError, match="LocalRing cannot train CUDA tensors"):
        cp.ring_attention(q, shards[0]["k"], shards[0]["v"], group=rings[0], causal=True)


# ---- several GPUs, NCCL -----------------------------------------------------------------------------

def nccl_cases(world: int) -> list[Case]:
    odd = 2 * world * 129
    return [Case(layout, causal, n, d=d, heads=h, heads_kv=hkv)
            for layout in cp.LAYOUTS for causal in (False, True)
            for n, d, h, hkv in ((4096, 128, 8, 2), (odd, 64, 4, 4))]


def run_nccl_case(case: Case, world: int) -> dict[str, float]:
    """ring_attention forward and backward through autograd on this rank's shard (NaN-poisoned
    allocator), gathered with unshard and compared with the float64 reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    full = inputs(case, device)
    q, k, v = (cp.shard(full[x], 2, layout=case.layout).requires_grad_() for x in ("q", "k", "v"))
    do = cp.shard(full["do"], 2, layout=case.layout)
    poison_allocator(case, world)
    out, lse = cp.ring_attention(q, k, v, causal=case.causal, layout=case.layout, return_lse=True)
    out.backward(do)
    got = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    joined = {name: cp.unshard(t, 2, layout=case.layout) for name, t in got.items()}
    return errors(joined, reference(full, case.causal))


def nccl_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    """One process per GPU: every case of nccl_cases(world); rank 0 saves {case id: errors}."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=NCCL_TIMEOUT)
    try:
        results = {case.id: run_nccl_case(case, world) for case in nccl_cases(world)}
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ring_matches_one_gpu_reference(world, tmp_path: Path):
    """One process per GPU over NCCL: forward and backward of every case against float64."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs; torch sees {torch.cuda.device_count()}")
    out_file = tmp_path / "results.pt"
    mp.spawn(nccl_worker, args=(world, str(tmp_path / "init"), str(out_file)), nprocs=world)
    results = torch.load(out_file)
    cases = nccl_cases(world)
    assert set(results) == {c.id for c in cases}
    bad = [line for c in cases for line in failures(c, results[c.id])]
    assert not bad, "; ".join(bad)



# ---- torch's own context parallelism, with gemmgen as its flash implementation ----------------------

def torch_cp_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    """torch.distributed.tensor.experimental.context_parallel over `world` GPUs with gemmgen activated:
    causal SDPA forward and backward, gathered with context_parallel_unshard; rank 0 saves the
    errors against float64 and which kernels served the flash ops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import gemmgen
    from gemmgen.integrations import torch_sdpa

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=NCCL_TIMEOUT)
    try:
        gemmgen.activate()
        mesh = init_device_mesh("cuda", (world,))
        case = Case("zigzag", True, 2048, d=128, heads=8, heads_kv=8)
        full = inputs(case, "cuda")
        want = reference(full, True)
        q, k, v, do = (full[x].clone() for x in ("q", "k", "v", "do"))
        # context_parallel resizes its buffers in place: they may require grad only inside it.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), context_parallel(
                mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, do}):
            for t in (q, k, v):
                t.requires_grad_()
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(do)
        got = context_parallel_unshard(mesh, [out.detach(), q.grad, k.grad, v.grad], [2, 2, 2, 2])
        errs = errors(dict(zip(("out", "dq", "dk", "dv"), got)), want)
        if rank == 0:
            torch.save({"errors": errs, "counts": torch_sdpa.counts()}, out_file)
    finally:
        dist.destroy_process_group()


def test_torch_context_parallel_runs_on_gemmgen(tmp_path: Path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; torch sees {torch.cuda.device_count()}")
    out_file = tmp_path / "results.pt"
    mp.spawn(torch_cp_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2)
    results = torch.load(out_file)
    served = results["counts"]
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        assert served.get(op, {}).get("gemmgen", 0) > 0 and served[op].get("torch", 0) == 0, served
    bad = failures(Case("zigzag", True, 2048, d=128, heads=8, heads_kv=8), results["errors"])
    assert not bad, "; ".join(bad)
