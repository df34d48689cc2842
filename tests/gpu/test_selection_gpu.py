"""Selection on the GPU: autotune picks a checked winner, a wrong or failing candidate never wins,
GEMMGEN_AUTOTUNE tunes on first sight, compiling on demand, torch.compile (fullgraph) and CUDA graph
replay, a second GPU. Needs instances built into ./build (`gemmgen generate --arch sm80`; more than
one tile per key makes the tuning tests meaningful: `gemmgen generate --arch sm80 --all --filter fp16_d64_`)."""
from __future__ import annotations

import dataclasses
import math

import re

import pytest
import torch

import gemmgen
from gemmgen.kernels import abi
from gemmgen.select import registry, selection, tuner, tuning_db
from gemmgen.errors import GemmgenLaunchError
from gemmgen.ops.reference import attention_reference
from gemmgen.select.shapes import Shape

pytestmark = pytest.mark.gpu

SHAPE = Shape(2, 8, 300, 300, 64, causal=True, dtype="fp16")
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def fresh():
    registry.refresh()
    torch._dynamo.reset()
    yield
    registry.refresh()


def candidates(shape: Shape = SHAPE) -> list:
    cands = registry.candidates(tuner.problem_of(shape, torch.cuda.current_device()))[0]
    if not cands:
        pytest.skip(f"no built instance for {shape.describe()}: run `gemmgen generate --arch sm80`")
    return cands


def rel_err(o: torch.Tensor, q, k, v, causal: bool) -> float:
    ref, _ = attention_reference(q, k, v, causal)
    return ((o.double() - ref).norm() / ref.norm()).item()


class WrongKernel:
    """Runs the real kernel on a quarter of the keys: faster than every honest candidate, and wrong.
    The queries are cut to as many, so that the cut call stays one that every family runs (the
    fmha_sm90 causal tiles refuse more queries than keys unless the keys fill whole tiles): the
    kernel must be caught by its result, not by a refusal."""

    def __init__(self, real: abi.Instance) -> None:
        self.real = real

    def __getattr__(self, name: str):  # the real kernel's facts (needs_lse, kv_cache, workspace_bytes)
        return getattr(self.real, name)

    def run(self, params: abi.AttnParams, stream: int | None) -> None:
        cut = abi.AttnParams.from_buffer_copy(params)
        cut.seqlen_k = max(1, cut.seqlen_k // 4)
        cut.seqlen_q = min(cut.seqlen_q, cut.seqlen_k)
        self.real.run(cut, stream)


class FailingKernel:
    needs_lse = kv_cache = False

    def workspace_bytes(self, params: abi.AttnParams) -> int:
        return 0

    def run(self, params: abi.AttnParams, stream: int | None) -> None:
        raise GemmgenLaunchError("gemmgen_fake: too many resources requested for launch")


def impostor(real, name: str, kernel) -> registry.Candidate:
    fake = dataclasses.replace(real, entry=dataclasses.replace(real.entry, name=name, content_hash=name[:16]))
    fake.__dict__["kernel"] = kernel  # the cached_property's slot
    return fake


def test_autotune_picks_a_checked_winner():
    cands = candidates()
    [result] = gemmgen.autotune([SHAPE], reps=10)
    assert {m.name for m in result.measurements} == {c.name for c in cands}
    assert all(m.ok and m.error <= TOLERANCE[torch.float16] for m in result.measurements), result.measurements
    assert result.winner.ms == min(m.ms for m in result.measurements)
    assert result.database is not None and result.database.exists()
    decision = selection.decide(tuner.problem_of(SHAPE, torch.cuda.current_device()))
    assert (decision.source, decision.winner.name) == ("tuned", result.winner.name)
    q, k, v = tuner.make_qkv(SHAPE, torch.cuda.current_device(), seed=7)
    assert gemmgen.selected_instance(q, k, v, causal=True) == result.winner.name
    assert rel_err(gemmgen.fused_attention(q, k, v, causal=True), q, k, v, True) <= TOLERANCE[torch.float16]


def test_wrong_or_failing_candidate_never_wins():
    real = candidates()[0]
    wrong = impostor(real, "wrong_but_fast", WrongKernel(real.kernel))
    failing = impostor(real, "failing_launch", FailingKernel())
    result = tuner.tune_shape(SHAPE, candidates=[wrong, failing, real], reps=10)
    by_name = {m.name: m for m in result.measurements}
    assert by_name["wrong_but_fast"].ms == math.inf
    assert by_name["wrong_but_fast"].reason.startswith(selection.WRONG_RESULT)
    assert by_name["failing_launch"].ms == math.inf and "too many resources" in by_name["failing_launch"].reason
    assert result.winner.name == real.name
    stored = tuning_db.read(result.database).buckets(result.problem.functional_key)[result.problem.bucket.key]
    assert stored["wrong_but_fast"].ms == math.inf and stored[real.content_hash].ok


def test_autotune_on_first_sight(monkeypatch):
    candidates()
    monkeypatch.setenv("GEMMGEN_AUTOTUNE", "1")
    problem = tuner.problem_of(SHAPE, torch.cuda.current_device())
    assert selection.needs_tuning(problem)
    q, k, v = tuner.make_qkv(SHAPE, torch.cuda.current_device(), seed=8)
    o = gemmgen.fused_attention(q, k, v, causal=True)
    assert rel_err(o, q, k, v, True) <= TOLERANCE[torch.float16]
    assert not selection.needs_tuning(problem)
    assert selection.decide(problem).source == "tuned"


@pytest.mark.parametrize("with_out", [False, True], ids=["returned", "out"])
def test_torch_compile_fullgraph(with_out):
    candidates()
    q, k, v = tuner.make_qkv(SHAPE, torch.cuda.current_device(), seed=9)

    def f(q, k, v):
        if with_out:
            out = torch.empty_like(q)
            _, lse = gemmgen.fused_attention(q, k, v, causal=True, out=out, return_lse=True)
            return out * 1.0, lse
        return gemmgen.fused_attention(q, k, v, causal=True, return_lse=True)

    o, lse = torch.compile(f, fullgraph=True)(q, k, v)
    ref, ref_lse = attention_reference(q, k, v, True)
    assert rel_err(o, q, k, v, True) <= TOLERANCE[torch.float16]
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


def test_cuda_graph_replay_gives_the_reference():
    candidates()
    q, k, v = tuner.make_qkv(SHAPE, torch.cuda.current_device(), seed=10)
    gemmgen.fused_attention(q, k, v, causal=True)  # select and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = gemmgen.fused_attention(q, k, v, causal=True)
    for seed in (11, 12):
        nq, nk, nv = tuner.make_qkv(SHAPE, torch.cuda.current_device(), seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(o, q, k, v, True) <= TOLERANCE[torch.float16]


def test_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs a second GPU; this machine has {torch.cuda.device_count()}")
    candidates()
    q, k, v = tuner.make_qkv(SHAPE, 1, seed=13)
    with torch.cuda.device(0):  # inputs on GPU 1 while GPU 0 is current: runs on GPU 1's current stream
        o = gemmgen.fused_attention(q, k, v, causal=True)
        assert torch.cuda.current_device() == 0
    assert o.device == torch.device("cuda", 1)
    assert rel_err(o, q, k, v, True) <= TOLERANCE[torch.float16]
    side = torch.cuda.Stream(device=1)
    side.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.stream(side):
        on_side = gemmgen.fused_attention(q, k, v, causal=True)
    side.synchronize()
    assert torch.equal(on_side, o)


def test_compiles_a_missing_instance_on_demand(tmp_path, capfd):
    """No build directory at all: the first call compiles the instance into the cache (real nvcc)."""
    registry.set_build_dirs([tmp_path / "empty"])
    try:
        shape = Shape(1, 2, 129, 127, 32, dtype="bf16")
        q, k, v = tuner.make_qkv(shape, torch.cuda.current_device(), seed=14)
        o = gemmgen.fused_attention(q, k, v)
        assert rel_err(o, q, k, v, False) <= TOLERANCE[torch.bfloat16]
        assert "gemmgen: compiling fa2_sm80_bf16_d32_none_" in capfd.readouterr().err
        gemmgen.fused_attention(q, k, v)
        assert "compiling" not in capfd.readouterr().err
    finally:
        registry.set_build_dirs(None)


def test_profile_and_explain_commands(tmp_path):
    from conftest import run_cli

    candidates()
    csv = tmp_path / "profile.csv"
    proc = run_cli("profile", "--arch", "sm80", "--shapes", "2,8,300,64,causal", "--dtype", "fp16", "--reps", "5",
                   "--csv", str(csv), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"winner: (fa2|mea|decode)_sm80_fp16_", proc.stdout) and "torch sdpa flash" in proc.stdout
    assert "stored in" in proc.stdout and len(csv.read_text().splitlines()) >= 1 + 3 + 1
    proc = run_cli("explain", "--shape", "2,8,300,300,64", "--causal", "--dtype", "fp16")
    assert proc.returncode == 0, proc.stderr
    assert "decided by: tuned bucket bhnd_g1_bh16_q512_k512" in proc.stdout
