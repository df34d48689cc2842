"""Batched GEMM and unfused attention without a GPU: the instance spaces and predicates, rendering,
`generate --family`, argument validation, GEMM selection over synthetic manifests, and a real nvcc
compile of one strided and one pointer-array instance that is then loaded with ctypes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_entry, real_generate, run_cli, write_build_dir
from gemmgen.kernels import abi
from gemmgen.select import device, gemm_select, registry, selection
from gemmgen.generator import manifest, render
from gemmgen.arch import Arch
from gemmgen.errors import DeviceError, GemmgenLaunchError, InputError, NoInstanceError
from gemmgen.generator.families import gemm_sm80, gemm_sm90, softmax_sm80
from gemmgen.ops.gemm import batched_gemm, batched_gemm_ptrs
from gemmgen.ops.unfused import unfused_attention

H200 = device.synthetic((9, 0), 132, "NVIDIA H200")


def test_spaces_are_valid_and_named_uniquely():
    for family in (gemm_sm80, gemm_sm90, softmax_sm80):
        assert family.DEFAULT and set(family.DEFAULT) <= set(family.SPACE)
        assert len({i.name for i in family.SPACE}) == len(family.SPACE)
        assert all(family.invalid_reason(i) is None for i in family.SPACE)
    # Every (dtype, output, layout, strategy) has a vectorized and an any-alignment default.
    keys = {(i.dtype, i.out_fp32, i.b_transposed, i.strategy, i.align) for i in gemm_sm80.DEFAULT}
    assert len(keys) == len(gemm_sm80.DEFAULT) == 32
    # sm90: each measured strided tile and the pointer-array reference tile per (dtype, output, layout).
    assert len(gemm_sm90.DEFAULT) == 8 * (len(gemm_sm90.STRIDED_DEFAULT_TILES) + 1) and len(softmax_sm80.DEFAULT) == 2
    for inst in gemm_sm90.DEFAULT:
        key = gemm_sm90.tile_key(inst)
        assert key in gemm_sm90.STRIDED_DEFAULT_TILES if inst.strategy is gemm_sm90.Strategy.STRIDED \
            else key == gemm_sm90.REFERENCE_TILE
    # Every default strided tile has a measured speed in every regime of every GPU profile.
    for profile in gemm_sm90.PROFILES.values():
        assert set(profile.speeds) == {*gemm_sm90.STRIDED_DEFAULT_TILES, gemm_sm90.REFERENCE_TILE}
        regimes = set(gemm_sm90.REGIMES) - (set() if profile.small_work else {"small"}) \
            - (set() if profile.few_batches else {"few"})
        assert all(set(v) == regimes for v in profile.speeds.values())


REFERENCE = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nn_m128n128k64_coop_c1")


def test_predicates_give_reasons():
    inst = gemm_sm80.DEFAULT[0]
    import dataclasses

    bad = dataclasses.replace(inst, align=1, stages=4)
    assert "2-stage" in gemm_sm80.invalid_reason(bad)
    big = dataclasses.replace(inst, tile_m=256, tile_n=256, tile_k=64, warps=8, stages=5, align=8)
    assert gemm_sm80.invalid_reason(big) is not None
    coop64 = dataclasses.replace(REFERENCE, tile_m=64)
    assert "tile_m >= 128" in gemm_sm90.invalid_reason(coop64)
    assert "sm_90a" in gemm_sm90.invalid_reason(REFERENCE, Arch.SM80)
    # A ping-pong tile is one warpgroup's: 128x256 would need 256 accumulator registers per thread.
    pp = dataclasses.replace(REFERENCE, schedule=gemm_sm90.Schedule.PINGPONG, tile_n=256)
    assert "256 registers per thread" in gemm_sm90.invalid_reason(pp)
    assert gemm_sm90.invalid_reason(dataclasses.replace(pp, tile_m=64)) is None


def test_stream_k_axis():
    sk = gemm_sm90.TileScheduler.STREAM_K
    names = {i.name for i in gemm_sm90.SPACE if i.tile_scheduler is sk and not i.evict_last}
    assert "gemm_sm90_strided_fp16_fp16_nn_m128n64k64_coop_c1_sk" in names
    assert all(n.startswith("gemm_sm90_strided_") and "_coop_" in n and n.endswith("_sk") for n in names)
    assert not any(i.stream_k for i in gemm_sm90.DEFAULT)
    import dataclasses

    coop = REFERENCE
    assert "cooperative schedule only" in gemm_sm90.invalid_reason(
        dataclasses.replace(coop, schedule=gemm_sm90.Schedule.PINGPONG, tile_scheduler=sk))
    ptr = next(i for i in gemm_sm90.DEFAULT if i.strategy.value == "ptr")
    assert "grouped scheduler" in gemm_sm90.invalid_reason(dataclasses.replace(ptr, tile_scheduler=sk))
    streamk = dataclasses.replace(coop, tile_scheduler=sk)
    assert streamk.name == coop.name + "_sk" and streamk.content_hash() != coop.content_hash()
    assert streamk.params()["tile_scheduler"] == "streamk"


def test_epilogue_tile_axis():
    """The epilogue sub-tile's columns divide tile_n and name the instance; strided kernels only."""
    base = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m64n256k64_pp_c2")
    wide = dataclasses.replace(base, epi_tile_n=128)
    assert gemm_sm90.invalid_reason(wide) is None and wide.name == base.name + "_e128"
    assert wide.epi_tile == (64, 128) and wide.content_hash() != base.content_hash()
    assert "must divide tile_n 192" in gemm_sm90.invalid_reason(dataclasses.replace(wide, tile_n=192))
    ptr = dataclasses.replace(wide, strategy=gemm_sm90.Strategy.PTR_ARRAY, cluster_m=1)
    assert "strided kernels only" in gemm_sm90.invalid_reason(ptr)


def test_evict_last_axis():
    """Evict-last operand loads name the instance, reach the template, and are strided-only."""
    base = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m64n256k64_pp_c2_e64")
    el = dataclasses.replace(base, evict_last=True)
    assert gemm_sm90.invalid_reason(el) is None and el.name == base.name + "_el" and el in gemm_sm90.SPACE
    assert el.params()["evict_last"] is True and "evict_last" not in base.params()
    assert el.content_hash() != base.content_hash()
    assert el.template_values()["evict_last"] and not base.template_values()["evict_last"]
    assert all(i.strategy is gemm_sm90.Strategy.STRIDED for i in gemm_sm90.DEFAULT if i.evict_last)
    ptr = next(i for i in gemm_sm90.DEFAULT if i.strategy is gemm_sm90.Strategy.PTR_ARRAY)
    assert "strided kernels only" in gemm_sm90.invalid_reason(dataclasses.replace(ptr, evict_last=True))
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    assert "/*EvictLast=*/true" in render.render_text(el, tc)
    assert "/*EvictLast=*/false" in render.render_text(base, tc)


def test_in_order_scheduler_axis():
    """The in-order scheduler names the instance, reaches the template, and is cooperative and
    strided only (CUTLASS's ping-pong kernel and the pointer-array kernels cannot take it)."""
    base = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m256n128k64_coop_c1x2_e64")
    io = dataclasses.replace(base, tile_scheduler=gemm_sm90.TileScheduler.IN_ORDER)
    assert gemm_sm90.invalid_reason(io) is None and io.name == base.name + "_io" and io in gemm_sm90.SPACE
    assert dataclasses.replace(io, evict_last=True).name == base.name + "_io_el"
    assert io.params()["tile_scheduler"] == "inorder" and io.content_hash() != base.content_hash()
    assert all(i.schedule is gemm_sm90.Schedule.COOPERATIVE for i in gemm_sm90.DEFAULT
               if i.tile_scheduler is gemm_sm90.TileScheduler.IN_ORDER)
    pingpong = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m64n256k64_pp_c2_e64")
    assert "cooperative schedule only" in gemm_sm90.invalid_reason(
        dataclasses.replace(pingpong, tile_scheduler=gemm_sm90.TileScheduler.IN_ORDER))
    ptr = next(i for i in gemm_sm90.DEFAULT if i.strategy is gemm_sm90.Strategy.PTR_ARRAY)
    assert "grouped scheduler" in gemm_sm90.invalid_reason(
        dataclasses.replace(ptr, tile_scheduler=gemm_sm90.TileScheduler.IN_ORDER))
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    assert "gemmgen::gemm_sm90::InOrderScheduler" in render.render_text(io, tc)
    assert "cutlass::gemm::PersistentScheduler" in render.render_text(base, tc)


def test_stream_k_heuristic_on_few_tiles(tmp_path):
    """Eight 1024 x 64 outputs are 64 tiles of 128 x 64 on 132 SMs: stream-K's estimate (balanced
    K loops) beats the same tile's one half-empty wave; with thousands of tiles it does not."""
    import dataclasses

    base = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nn_m128n64k64_coop_c1")
    streamk = dataclasses.replace(base, tile_scheduler=gemm_sm90.TileScheduler.STREAM_K)
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(base), make_entry(streamk)])])
    try:
        few = selection.decide(_problem(m=1024, n=64, k=1024, batch_count=8, b_transposed=False))
        assert few.winner.name == streamk.name, few.report()
        many = selection.decide(_problem(m=4096, n=64, k=1024, batch_count=512, b_transposed=False))
        assert many.winner.name == base.name, many.report()
    finally:
        registry.set_build_dirs(None)


def test_generate_family_renders_only_what_is_asked(tmp_path):
    proc = run_cli("generate", "--arch", "sm80", "--family", "gemm_sm80", "--family", "softmax_sm80",
                   "--no-compile", "--out", str(tmp_path), env={"GEMMGEN_NVCC": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert "34 rendered, not compiled" in proc.stdout
    names = {e.name for e in manifest.load(tmp_path / "sm80" / "manifest.json").instances}
    assert names == {i.name for i in gemm_sm80.DEFAULT + softmax_sm80.DEFAULT}
    text = (tmp_path / "sm80" / "src" / "gemm_sm80_ptr_bf16_f32_nt_m128n128k32w4s4a8.cu").read_text()
    assert text.startswith("// Generated by gemmgen") and "Do not edit" in text
    assert "Traits<cutlass::bfloat16_t, float" in text and "/*BTransposed=*/true" in text
    assert "run_ptrs<Traits>(args" in text and "const GemmgenBatchedGemmPtrArgs* args" in text
    sm90 = run_cli("generate", "--arch", "sm90", "--family", "gemm_sm90", "--no-compile", "--out", str(tmp_path))
    assert sm90.returncode == 0 and "48 rendered" in sm90.stdout
    bad = run_cli("generate", "--arch", "sm80", "--family", "nope", "--no-compile", "--out", str(tmp_path))
    assert bad.returncode == 2 and "unknown family 'nope'" in bad.stderr


def test_default_generate_builds_no_gemm(tmp_path):
    proc = run_cli("generate", "--arch", "sm80", "--no-compile", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    families = {e.family for e in manifest.load(tmp_path / "sm80" / "manifest.json").instances}
    assert families and not families & {"gemm_sm80", "softmax_sm80"}


def test_validation_without_gpu():
    a, b = torch.randn(2, 3, 17, 8).half(), torch.randn(2, 3, 8, 5).half()
    with pytest.raises(DeviceError, match="CUDA GPU"):
        batched_gemm(a, b)
    with pytest.raises(InputError, match=r"\[B, H, N, K\]"):
        batched_gemm(a, b, b_transposed=True)
    with pytest.raises(InputError, match="one dtype"):
        batched_gemm(a, b.bfloat16())
    with pytest.raises(InputError, match="4-D"):
        batched_gemm(a[0], b)
    with pytest.raises(InputError, match="contiguous in its last dim"):
        batched_gemm(a, b.transpose(2, 3).contiguous().transpose(2, 3)[..., :4].contiguous().transpose(2, 3),
                     b_transposed=True)
    with pytest.raises(InputError, match="one device"):
        batched_gemm(a, b.to("meta"))
    with pytest.raises(InputError, match="out must be"):
        batched_gemm(a, b, out=torch.empty(2, 3, 17, 6).half())
    with pytest.raises(InputError, match="out dtype"):
        batched_gemm(a, b, out_dtype=torch.bfloat16)
    with pytest.raises(InputError, match="one length"):
        batched_gemm_ptrs([a[0, 0]] * 2, [b[0, 0]])
    with pytest.raises(InputError, match=r"a_list\[1\]"):
        batched_gemm_ptrs([a[0, 0], a[0, 0, :16]], [b[0, 0]] * 2)
    with pytest.raises(DeviceError):
        batched_gemm_ptrs([a[0, 0]] * 2, [b[0, 0]] * 2)
    q, k = torch.randn(1, 4, 9, 64).half(), torch.randn(1, 3, 9, 64).half()
    with pytest.raises(InputError, match="Hkv dividing H"):
        unfused_attention(q, k, k)
    with pytest.raises(InputError, match="causal_alignment"):
        unfused_attention(q, q, q, causal_alignment="middle")
    with pytest.raises(DeviceError):
        unfused_attention(q, q, q)


def _problem(**kw) -> gemm_select.GemmProblem:
    base = dict(dtype="fp16", out_dtype="fp16", b_transposed=True, strategy="strided", device=H200,
                m=1024, n=1024, k=64, batch_count=64, align=8, align_c=8)
    return gemm_select.GemmProblem(**{**base, **kw})


@pytest.fixture
def gemm_build(tmp_path):
    entries = [make_entry(i) for i in gemm_sm80.DEFAULT]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    yield tmp_path
    registry.set_build_dirs(None)


def test_selection_reasons_and_heuristic(gemm_build):
    decision = selection.decide(_problem())
    assert decision.source == "heuristic"
    assert decision.winner.name == "gemm_sm80_strided_fp16_fp16_nt_m128n128k32w4s4a8"
    assert {c.name for c in decision.candidates} == {decision.winner.name,
                                                     "gemm_sm80_strided_fp16_fp16_nt_m64n64k32w4s2a1"}
    reasons = dict((label.split()[0], reason) for label, reason in decision.rejected)
    assert "strategy ptr" in reasons["gemm_sm80_ptr_fp16_fp16_nt_m128n128k32w4s4a8"]
    assert "b_transposed False" in reasons["gemm_sm80_strided_fp16_fp16_nn_m128n128k32w4s4a8"]
    assert "out_dtype fp32" in reasons["gemm_sm80_strided_fp16_f32_nt_m128n128k32w4s4a8"]
    odd = selection.decide(_problem(k=17, align=1))
    assert odd.winner.name == "gemm_sm80_strided_fp16_fp16_nt_m64n64k32w4s2a1"
    odd_reasons = dict((label.split()[0], reason) for label, reason in odd.rejected)
    assert "needs alignment 8" in odd_reasons["gemm_sm80_strided_fp16_fp16_nt_m128n128k32w4s4a8"]
    assert "decided by: heuristic" in decision.report()


def test_selection_without_instances_names_the_command(tmp_path):
    registry.set_build_dirs([tmp_path])
    try:
        with pytest.raises(NoInstanceError, match=r"Build one with: gemmgen generate --arch sm80 .*--filter gemm_sm80_\S+ --family gemm_sm80"):
            selection.decide(_problem(device=device.synthetic((8, 0), 108)))
    finally:
        registry.set_build_dirs(None)


# One instance of each strategy, compiled for real (about 40 s each, in parallel on 2 cores).
COMPILED = ["gemm_sm80_ptr_bf16_f32_nn_m64n64k32w4s2a1", "gemm_sm80_strided_fp16_fp16_nt_m128n128k32w4s4a8"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemm_build")
    return out, real_generate(out, "--family", "gemm_sm80", "--filter", "|".join(COMPILED))


def test_real_compile_and_load(compiled):
    out, proc = compiled
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 built, 0 failed" in proc.stdout
    for e in manifest.load(out / "sm80" / "manifest.json").instances:
        strategy = abi.GEMM_PTR_ARRAY if e.params["strategy"] == "ptr" else abi.GEMM_STRIDED
        info = abi.bind_gemm(out / "sm80" / e.library, e.symbol, strategy).info().as_dict()
        assert info["abi_version"] == abi.ABI_VERSION and info["strategy"] == strategy
        assert (info["tile_m"], info["tile_n"], info["tile_k"], info["stages"]) == (
            e.params["tile_m"], e.params["tile_n"], e.params["tile_k"], e.params["stages"])
        assert info["alignment"] == e.params["align"] and info["threads"] == e.threads
        assert info["b_transposed"] == int(e.params["b_transposed"])
        assert info["out_bytes"] == (4 if e.params["out_dtype"] == "fp32" else 2)
        assert 0 < info["smem_bytes"] <= e.smem_bytes + 16 * 1024


def test_library_rejects_bad_args(compiled):
    out, _ = compiled
    name = COMPILED[1]
    kernel = abi.bind_gemm(out / "sm80" / "lib" / f"{name}.so", f"gemmgen_{name}", abi.GEMM_STRIDED)
    args = abi.BatchedGemmStridedArgs(0x10000, 0x20000, 0x30000, 128, 128, 64, 2, 3,
                                      3 * 128 * 64, 128 * 64, 64, 3 * 128 * 64, 128 * 64, 64,
                                      3 * 128 * 128, 128 * 128, 128, 0, 1.0)
    with pytest.raises(GemmgenLaunchError, match="b_transposed 0, this instance runs 1"):
        kernel.run(args, None)
    args.b_transposed, args.stride_a_row = 1, 65
    with pytest.raises(GemmgenLaunchError, match="multiples of 8"):
        kernel.run(args, None)
    with pytest.raises(TypeError):
        kernel.run(abi.BatchedGemmPtrArgs(), None)


def test_explain_gemm_cli(gemm_build):
    proc = run_cli("explain-gemm", "--cc", "9.0", "--sms", "132", "--b-transposed", "--k", "17",
                   "--build-dir", str(gemm_build))
    assert proc.returncode == 0, proc.stderr
    assert "winner: gemm_sm80_strided_fp16_fp16_nt_m64n64k32w4s2a1" in proc.stdout
    assert "needs alignment 8" in proc.stdout and "decided by: heuristic" in proc.stdout


def test_default_tiles_picked_per_regime(tmp_path):
    """The sm90 default set, untuned, on the two GPU models measured (bench/NOTES.md, experiment 63;
    bench/results/gemm_tiles_h200.csv and gemm_tiles_h100.csv): each regime's measured winner. On
    the H200 the 1x2-cluster ping-pong tile for Q x K^T at K = 128, the 256x128 tile for thousands of
    small outputs; on the H100 the 256x128 tile wherever C is large, the 128x128 cooperative one for
    small problems (C x K up to 2^32; experiment 104) and the ping-pong ones for 8 matrices or fewer;
    on both the 128x64 tile for 64-column outputs (P x V at d = 64) and no 1x2 cluster where the
    output is one tile wide."""
    import dataclasses

    entries = [make_entry(i) for i in gemm_sm90.DEFAULT if i.dtype.value == "fp16" and not i.out_fp32]
    entries = [dataclasses.replace(e, gencode=["-gencode=arch=compute_90a,code=sm_90a"]) for e in entries]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    h100 = device.synthetic((9, 0), 132, "NVIDIA H100 80GB HBM3")

    def pick(**kw) -> str:
        decision = selection.decide(_problem(**kw))
        assert decision.source == "heuristic"
        return decision.winner.name.rsplit("_n", 1)[1][2:]  # after the layout (nt, nn)

    cluster, e64, large, narrow, coop = ("m128n128k64_pp_c1x2_e128_el", "m128n128k64_pp_c1_e64",
                                         "m256n128k64_coop_c1x2_e128_io_el", "m128n64k64_coop_c1",
                                         "m128n128k64_coop_c1")
    try:
        assert pick(m=2048, n=2048, k=128, batch_count=64) == cluster
        assert pick(m=4096, n=4096, k=128, batch_count=8) == cluster
        assert pick(m=512, n=512, k=128, batch_count=4096) == large
        assert pick(m=256, n=256, k=64, batch_count=4096) == large
        assert pick(m=2048, n=2048, k=128, batch_count=64, device=h100) == large
        assert pick(m=1024, n=1024, k=64, batch_count=8, device=h100) == e64
        assert pick(m=512, n=512, k=64, batch_count=256, device=h100) == coop  # 2^26 x 64: small
        assert pick(m=1024, n=1024, k=64, batch_count=64, device=h100) == coop
        assert pick(m=1024, n=1024, k=128, batch_count=64, device=h100) == large  # 2^26 x 128: not small
        assert pick(m=512, n=512, k=64, batch_count=256) != coop  # the H200 keeps its picks
        assert pick(m=4096, n=4096, k=128, batch_count=8, device=h100) in (e64, cluster)
        for device_ in (H200, h100):
            assert pick(m=2048, n=64, k=2048, batch_count=64, b_transposed=False, device=device_) == narrow
            assert pick(m=2048, n=128, k=2048, batch_count=64, b_transposed=False, device=device_) in (e64, narrow)
            assert pick(m=2048, n=2048, k=2048, batch_count=32, device=device_) in (e64, cluster)
        report = selection.decide(_problem(m=512, n=512, k=128, batch_count=4096)).report()
        assert "regime many" in report and "measured speed 1.16" in report
    finally:
        registry.set_build_dirs(None)


def test_unmeasured_tiles_take_their_shapes_slowest_speed():
    h200 = _problem(m=2048, n=2048, k=4096)
    variant = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nn_m128n64k64_coop_c1_sk")
    measured = dataclasses.replace(variant, tile_scheduler=gemm_sm90.TileScheduler.PERSISTENT)
    speeds = gemm_sm90.PROFILES["NVIDIA H200"].speeds
    assert gemm_sm90.speed(variant, h200) == speeds[gemm_sm90.tile_key(measured)]["long"]
    square = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m128n128k64_pp_c2")
    assert gemm_sm90.speed(square, h200) == 1.0  # the reference tile's, the slowest 128x128 measured
    small = next(i for i in gemm_sm90.SPACE if i.name == "gemm_sm90_strided_fp16_fp16_nt_m64n64k64_pp_c1")
    assert gemm_sm90.speed(small, h200) is None  # no 64x64 measured: the shape's efficiency decides
    # A GPU model not measured takes the H100's profile.
    assert gemm_sm90.profile_for("NVIDIA H800") is gemm_sm90.PROFILES["NVIDIA H100"]
    assert gemm_sm90.profile_for("NVIDIA H200 NVL") is gemm_sm90.PROFILES["NVIDIA H200"]


def test_regimes():
    regime = gemm_sm90.regime
    h100 = device.synthetic((9, 0), 132, "NVIDIA H100 80GB HBM3")
    big = dict(m=2048, n=2048, batch_count=64)
    assert regime(_problem(k=64, **big)) == "short" and regime(_problem(k=128, **big)) == "mid"
    assert regime(_problem(k=257)) == "long"
    assert regime(_problem(m=512, n=512, k=128, batch_count=512)) == "many"
    assert regime(_problem(m=512, n=512, k=128, batch_count=511)) == "mid"
    # A small problem (C's elements x K up to 2^32) is a regime of the H100's profile only.
    assert regime(_problem(m=1024, n=1024, k=64, batch_count=64, device=h100)) == "small"
    assert regime(_problem(m=1024, n=1024, k=64, batch_count=65, device=h100)) == "short"
    assert regime(_problem(m=1024, n=1024, k=128, batch_count=32, device=h100)) == "small"
    assert regime(_problem(m=1024, n=1024, k=128, batch_count=33, device=h100)) == "mid"
    assert regime(_problem(m=1024, n=1024, k=64, batch_count=64)) == "short"
    # On the H100 eight matrices or fewer are a regime of their own, whatever their size (not long K).
    assert regime(_problem(m=4096, n=4096, k=128, batch_count=8, device=h100)) == "few"
    assert regime(_problem(m=4096, n=4096, k=128, batch_count=9, device=h100)) == "mid"
    assert regime(_problem(m=64, n=64, k=64, batch_count=8)) == "short"
    # A GPU without those regimes never gets them, empty problems included (its speeds lack them).
    assert regime(_problem(m=0, n=64, k=64, batch_count=0)) == "short"
    assert regime(_problem(m=4096, n=4096, k=1024, batch_count=8, device=h100)) == "long"
