"""Batched GEMM (strided and pointer-array) and the unfused attention path on the GPU against
float64 references. Needs the GEMM and softmax families built into the build directories
($GEMMGEN_BUILD_DIR or ./build):

    gemmgen generate --arch sm80 --family gemm_sm80 --family softmax_sm80
    gemmgen generate --arch sm90 --family gemm_sm90        # optional, Hopper

Inputs are fresh random tensors (a seed per case); outputs are poisoned with NaN first."""
from __future__ import annotations

import re

import zlib

import pytest
import torch

import gemmgen
from gemmgen.select import gemm_select, registry
from gemmgen.errors import InputError
from gemmgen.ops.reference import attention_reference

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # ||out - ref|| / ||ref||
# Every odd size in every position: (M, N, K).
SIZES = [(1, 1, 1), (17, 127, 129), (129, 17, 1000), (1000, 129, 17), (127, 1000, 127), (1, 1000, 64),
         (1000, 1, 128), (64, 64, 64), (512, 512, 128)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not any(gemm_select.is_gemm(c) and c.entry.state == "built" for c in registry.load()[0]):
        pytest.fail("no GEMM instances built: run `gemmgen generate --arch sm80 --family gemm_sm80 "
                    "--family softmax_sm80` (and set GEMMGEN_BUILD_DIR if not ./build)")


def randn(shape, dtype, key) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, dtype=dtype, device="cuda", generator=gen)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element never written?)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ref_gemm(a, b, b_transposed, alpha=1.0):
    b64 = b.double().transpose(-2, -1) if b_transposed else b.double()
    return alpha * (a.double() @ b64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("m, n, k", SIZES)
def test_strided(dtype, b_transposed, m, n, k):
    key = ("strided", dtype, b_transposed, m, n, k)
    a = randn((2, 3, m, k), dtype, (key, "a"))
    b = randn((2, 3, n, k) if b_transposed else (2, 3, k, n), dtype, (key, "b"))
    out = torch.full((2, 3, m, n), float("nan"), dtype=dtype, device="cuda")
    gemmgen.batched_gemm(a, b, b_transposed=b_transposed, out=out, alpha=0.5)
    assert rel_error(out, ref_gemm(a, b, b_transposed, 0.5)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-input-dtype", "out-fp32"])
def test_repeated_calls_take_the_fast_path(out_dtype):
    """A call seen before skips the checks and the selection: fresh inputs each time, poisoned or
    newly allocated outputs, alpha changing, and a changed stride falling back to the full path."""
    from gemmgen.ops import gemm

    for rep in range(3):
        key = ("fast", rep, out_dtype)
        a = randn((2, 3, 129, 64), torch.bfloat16, (key, "a"))
        b = randn((2, 3, 127, 64), torch.bfloat16, (key, "b"))
        out = gemmgen.batched_gemm(a, b, b_transposed=True, alpha=0.5 + rep, out_dtype=out_dtype)
        assert out.dtype == (out_dtype or torch.bfloat16)
        assert rel_error(out, ref_gemm(a, b, True, 0.5 + rep)) <= TOLERANCE[torch.bfloat16]
        given = torch.full_like(out, float("nan"))
        gemmgen.batched_gemm(a, b, b_transposed=True, alpha=2.0, out=given)
        assert rel_error(given, ref_gemm(a, b, True, 2.0)) <= TOLERANCE[torch.bfloat16]
    assert gemm._calls, "repeated calls were not cached"
    # A repeat with out=None takes the fast path too: no new problem is built for it.
    built = []
    real = gemm.strided_problem
    gemm.strided_problem = lambda *args, **kw: built.append(1) or real(*args, **kw)
    try:
        again = gemmgen.batched_gemm(a, b, b_transposed=True, alpha=1.5, out_dtype=out_dtype)
    finally:
        gemm.strided_problem = real
    assert not built, "a repeated out=None call took the full path"
    assert rel_error(again, ref_gemm(a, b, True, 1.5)) <= TOLERANCE[torch.bfloat16]
    wide = randn((2, 3, 129, 128), torch.bfloat16, "fast-wide")[..., :64]  # same shape, new strides
    out = gemmgen.batched_gemm(wide, b, b_transposed=True, out_dtype=out_dtype)
    assert rel_error(out, ref_gemm(wide, b, True)) <= TOLERANCE[torch.bfloat16]


TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (B, H, M, N, K): odd M, several tiles and K blocks; then two output tiles with a long K loop,
# which stream-K instances split over most of the GPU's SMs (partial sums fixed up in a workspace);
# then several tiles per persistent CTA, with an odd N that leaves half-empty clusters (the in-order
# scheduler's tickets and its last, invalid one). Each with an alpha: the sm90 epilogue leaves the
# multiply out when alpha is 1, so both of its paths run on every instance.
EVERY_INSTANCE_SHAPES = [((2, 3, 201, 72, 1032), 0.25), ((1, 1, 256, 128, 8192), -0.5), ((4, 33, 129, 520, 64), 1.0)]


def test_every_built_strided_instance():
    """Each built strided GEMM instance, forced by name, on the shapes above that it can run."""
    from gemmgen.ops import gemm

    ran, failures = 0, []
    for cand in registry.load()[0]:
        params = cand.entry.params
        if not gemm_select.is_gemm(cand) or cand.entry.state != "built" or params.get("strategy") != "strided":
            continue
        dtype, out_dtype, bt = TORCH_DTYPES[params["dtype"]], TORCH_DTYPES[params["out_dtype"]], params["b_transposed"]
        for (bb, h, m, n, k), alpha in EVERY_INSTANCE_SHAPES:
            key = ("every", cand.name, m, n, k, alpha)
            a = randn((bb, h, m, k), dtype, (key, "a"))
            b = randn((bb, h, n, k) if bt else (bb, h, k, n), dtype, (key, "b"))
            out = torch.full((bb, h, m, n), float("nan"), dtype=out_dtype, device="cuda")
            if gemm_select.reject_reason(cand, gemm.strided_problem(a, b, out, b_transposed=bt)) is not None:
                continue
            gemmgen.batched_gemm(a, b, b_transposed=bt, out=out, alpha=alpha, instance=cand.name)
            err = rel_error(out, ref_gemm(a, b, bt, alpha))
            ran += 1
            # fp32 C is not rounded to 16 bits: only the fp32 sums' rounding over K <= 8192 remains.
            if err > (3e-5 if out_dtype == torch.float32 else TOLERANCE[dtype]):
                failures.append(f"{cand.name} {(bb, h, m, n, k)} alpha {alpha}: relative error {err:.2e}")
    assert ran, "no strided instance could run the shapes"
    assert not failures, "\n".join(failures)


def test_profile_gemm_records_sustained_times():
    """profile-gemm times every candidate and torch.matmul under sustained load, the contenders
    also over short runs and, on calls this long (about 0.3 ms), up to three finalists alone under
    load; it records the times, and the next selection for that shape reads them: the winner's
    cost (gemm_select.tuned_costs) is the lowest, and a winner among several contenders is a
    finalist."""
    from conftest import run_cli

    shape = ["--batch", "8", "--heads", "64", "--m", "1024", "--n", "1024", "--k", "64", "--b-transposed"]
    proc = run_cli("profile-gemm", *shape, "--reps", "20", "--record", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "under sustained load" in proc.stdout and "torch.matmul (cuBLAS)" in proc.stdout
    # Rows: a mark column ("*" or " "), then name, ms, TFLOP/s, short ms, TFLOP/s, alone ms, TFLOP/s
    # ("-" where not taken) and the time ratio of torch.matmul to the instance.
    rows = [line[2:].split() for line in proc.stdout.splitlines() if line[2:].startswith("gemm_")]
    assert rows and all("failed:" not in row for row in rows), proc.stdout
    assert all(len(row) == 8 for row in rows), proc.stdout
    contenders = [row for row in rows if row[3] != "-"]
    alone = [row for row in rows if row[5] != "-"]
    assert len(alone) == (min(3, len(contenders)) if len(contenders) > 1 else 0), proc.stdout
    assert "stored in" in proc.stdout
    explain = run_cli("explain-gemm", *shape)
    assert explain.returncode == 0 and "decided by: tuned" in explain.stdout, explain.stdout + explain.stderr
    lines = [line for line in explain.stdout.splitlines() if ", cost " in line]
    costs = {next(t for t in line.split() if t.startswith("gemm_")): float(re.search(r", cost ([0-9.]+)", line)[1])
             for line in lines}
    winner = next(line for line in lines if line.startswith("  * "))
    assert costs[winner.split()[1]] == min(costs.values()) and "short runs" in explain.stdout, explain.stdout
    assert not alone or "alone under load" in winner, explain.stdout


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("m, n, k", [(17, 127, 129), (512, 512, 128), (1000, 1000, 64)])
def test_pointer_array(dtype, b_transposed, m, n, k):
    key = ("ptrs", dtype, b_transposed, m, n, k)
    a_list = [randn((m, k), dtype, (key, "a", i)) for i in range(5)]
    b_list = [randn((n, k) if b_transposed else (k, n), dtype, (key, "b", i)) for i in range(5)]
    outs = [torch.full((m, n), float("nan"), dtype=dtype, device="cuda") for _ in range(5)]
    gemmgen.batched_gemm_ptrs(a_list, b_list, b_transposed=b_transposed, out_list=outs, alpha=0.5)
    for a, b, out in zip(a_list, b_list, outs):
        assert rel_error(out, ref_gemm(a, b, b_transposed, 0.5)) <= TOLERANCE[dtype]
    again = gemmgen.batched_gemm_ptrs(a_list, b_list, b_transposed=b_transposed, alpha=0.5)
    assert all(torch.equal(x, y) for x, y in zip(again, outs))
    unscaled = gemmgen.batched_gemm_ptrs(a_list, b_list, b_transposed=b_transposed)  # alpha = 1: no multiply
    for a, b, out in zip(a_list, b_list, unscaled):
        assert rel_error(out, ref_gemm(a, b, b_transposed)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("k", [64, 17])
def test_fp32_out(dtype, b_transposed, k):
    key = ("fp32", dtype, b_transposed, k)
    a = randn((2, 4, 129, k), dtype, (key, "a"))
    b = randn((2, 4, 127, k) if b_transposed else (2, 4, k, 127), dtype, (key, "b"))
    out = gemmgen.batched_gemm(a, b, b_transposed=b_transposed, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_error(out, ref_gemm(a, b, b_transposed)) <= 1e-5  # fp32 accumulate and store: no rounding of C
    # Separate allocations: views into one tensor are 16-byte aligned only when a matrix's size is.
    outs = gemmgen.batched_gemm_ptrs([t.clone() for t in a.flatten(0, 1)], [t.clone() for t in b.flatten(0, 1)],
                                     b_transposed=b_transposed, out_dtype=torch.float32)
    assert rel_error(torch.stack(outs).view_as(out), ref_gemm(a, b, b_transposed)) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("k, pad", [(64, 8), (17, 3)], ids=["aligned", "odd"])
def test_non_contiguous_views(dtype, k, pad):
    """[B, N, H, d] storage seen as [B, H, N, d] (heads do not nest in batches), padded rows, and
    an output written through a transposed view."""
    key = ("views", dtype, k, pad)
    b, h, m, n = 3, 4, 129, 100
    a = randn((b, m, h, k + pad), dtype, (key, "a"))[..., :k].transpose(1, 2)  # [B, H, M, K]
    kt = randn((b, h, n, k + pad), dtype, (key, "k"))[..., :k]  # [B, H, N, K] padded rows
    store = torch.full((b, m, h, n + 8), float("nan"), dtype=dtype, device="cuda")
    out = store[..., :n].transpose(1, 2)  # [B, H, M, N]
    gemmgen.batched_gemm(a, kt, b_transposed=True, out=out)
    assert rel_error(out, ref_gemm(a, kt, True)) <= TOLERANCE[dtype]
    assert store[..., n:].isnan().all(), "wrote past the view"
    v = randn((b, h, k + pad, n), dtype, (key, "v"))[:, :, :k]  # [B, H, K, N]
    o2 = gemmgen.batched_gemm(a, v)
    assert rel_error(o2, ref_gemm(a, v, False)) <= TOLERANCE[dtype]


def test_batch_above_grid_limit():
    """65536 + 17 matrices: more than grid.z holds in one launch."""
    a = randn((65553, 1, 16, 8), torch.float16, "big-a")
    b = randn((65553, 1, 8, 16), torch.float16, "big-b")
    out = torch.full((65553, 1, 16, 16), float("nan"), dtype=torch.float16, device="cuda")
    gemmgen.batched_gemm(a, b, out=out)
    assert rel_error(out, ref_gemm(a, b, False)) <= TOLERANCE[torch.float16]


def test_bad_input_on_gpu():
    a = randn((1, 2, 64, 64), torch.float16, "bad")
    with pytest.raises(InputError, match="16-byte aligned"):
        gemmgen.batched_gemm(a.flatten()[1:4097].view(1, 1, 64, 64), a[:, :1])
    with pytest.raises(InputError, match="one device"):
        gemmgen.batched_gemm(a, a.cpu())
    b = randn((32, 64), torch.float16, "bad-b")
    with pytest.raises(InputError, match="row stride"):  # same shapes, rows 64 and 32 elements apart
        gemmgen.batched_gemm_ptrs([a[0, 0, :, :32], a[0, 1, :, :32].contiguous()], [b, b])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal, alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")],
                         ids=["none", "causal-top-left", "causal-bottom-right"])
@pytest.mark.parametrize("nq, nk", [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 1000), (1000, 17), (17, 1000)])
@pytest.mark.parametrize("d", [64, 128])
def test_unfused_attention(dtype, causal, alignment, nq, nk, d):
    key = ("unfused", dtype, causal, alignment, nq, nk, d)
    q = randn((2, 4, nq, d), dtype, (key, "q"))
    k = randn((2, 4, nk, d), dtype, (key, "k"))
    v = randn((2, 4, nk, d), dtype, (key, "v"))
    o = gemmgen.unfused_attention(q, k, v, causal=causal, causal_alignment=alignment)
    ref, _ = attention_reference(q, k, v, causal, alignment)
    if ref.norm() == 0:  # every row masked out (bottom-right with Nq > Nk): zeros expected
        assert not o.isnan().any() and (o == 0).all()
    else:
        assert rel_error(o, ref) <= TOLERANCE[dtype]


def test_unfused_gqa_and_strided_inputs():
    dtype = torch.bfloat16
    q = randn((2, 77, 8, 64), dtype, "gqa-q").transpose(1, 2)  # [B, H, N, d] view of [B, N, H, d]
    k = randn((2, 2, 77, 64), dtype, "gqa-k")
    v = randn((2, 2, 77, 64), dtype, "gqa-v")
    o = gemmgen.unfused_attention(q, k, v, causal=True, scale=0.2)
    ref, _ = attention_reference(q, k, v, True, "top_left", 0.2)
    assert rel_error(o, ref) <= TOLERANCE[dtype]
