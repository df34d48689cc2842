"""The fmha_sm90 family (CUTLASS's Hopper FMHA): its instance space, validity rule, what a built
instance refuses (problem_reason), rendering, and real nvcc builds of two instances (one of them
persistent)."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli
from gemmgen.kernels import abi
from gemmgen.select import device, registry, selection
from gemmgen.generator import manifest, render, space
from gemmgen.arch import Arch
from gemmgen.generator.families import fmha_sm90 as fam
from gemmgen.generator.families.fmha_sm90 import DType, FmhaSm90Instance, Mask, Schedule
from gemmgen.select.problem import Problem

H200 = device.synthetic((9, 0), 132)
BUILD_ONE = "fmha_sm90_fp16_d64_causal_tma_m64n64s4_lr"  # the quickest to compile


def test_space_names_unique_and_stable():
    names = [inst.name for inst in fam.SPACE]
    assert len(names) == len(set(names))
    assert "fmha_sm90_bf16_d128_none_pingpong_m128n128s5" in names  # CUTLASS's softmax
    assert {inst.name for inst in fam.DEFAULT} >= {"fmha_sm90_fp16_d256_none_coop_m128n64s5_lr",
                                                    "fmha_sm90_fp16_d256_causal_pingpong_m128n64s5_lr",
                                                    "fmha_sm90_bf16_d64_none_pingpong_m256n64s5_lr_q2",
                                                    "fmha_sm90_bf16_d64_causal_pingpong_m256n64s5_lr_q2"}
    assert all(inst.lazy_rescale for inst in fam.DEFAULT)  # our softmax (experiment 41)
    plain = [i for i in fam.SPACE
             if i.mask is not Mask.LOCAL and i.dtype is not DType.FP8 and not i.softcap and not i.bias
             and not i.dropout]
    assert len(plain) == 2 * sum(not inst.lazy_rescale for inst in plain)  # both softmaxes per tile
    # An additive mask: our plain step (no speculation) on the persistent schedule, fixed lengths,
    # 16-bit, no window; each a plain tile's twin.
    biased = [i for i in fam.SPACE if i.bias]
    assert biased and all(i.persistent and i.lazy_rescale and not i.speculates and not i.runs_varlen
                          and i.dtype is not DType.FP8 and i.mask is not Mask.LOCAL and i.name.endswith("_bias")
                          for i in biased)
    assert {dataclasses.replace(i, bias=False) for i in biased} <= set(fam.SPACE)
    capped = [i for i in fam.SPACE if i.softcap]  # our softmax, 16-bit, no window: each a plain tile's twin
    assert capped and all(i.lazy_rescale and i.dtype is not DType.FP8 and i.mask is not Mask.LOCAL
                          and "_sc" in i.name for i in capped)
    assert {dataclasses.replace(i, softcap=False) for i in capped} <= set(fam.SPACE)
    fp8 = [i for i in fam.SPACE if i.dtype is DType.FP8]  # our softmax (it takes the factors), persistent
    assert fp8 and all(i.persistent and i.lazy_rescale and not i.runs_varlen for i in fp8)
    assert {(i.head_dim, i.mask) for i in fp8} == {(d, m) for d in fam.FP8_HEAD_DIMS for m in fam.FP8_MASKS}
    local = [i for i in fam.SPACE if i.mask is Mask.LOCAL]  # a window: persistent, our softmax, no speculation
    assert local and all(i.persistent and i.lazy_rescale and not i.speculates for i in local)
    q2 = next(i for i in fam.SPACE if i.name == "fmha_sm90_bf16_d64_none_pingpong_m256n64s5_lr_q2")
    assert q2.smem_bytes - dataclasses.replace(q2, q_buffers=1).smem_bytes == 4 * 64 * 64 * 2


def test_default_covers_every_dtype_head_dim_mask_once():
    """One preferred default tile per (dtype, head dim, mask) (fp8: per head dim and mask it runs);
    the other default tiles are the 16-bit short-sequence tiles, one per dtype for each (head dim,
    mask) that has one."""
    keys = [(i.dtype, i.head_dim, i.mask, i.softcap, i.bias, i.dropout) for i in fam.PREFERRED_DEFAULT]
    assert sorted(keys, key=str) == sorted(set(keys), key=str)
    wide = [dt for dt in fam.DTYPES if dt is not DType.FP8]
    assert set(keys) == ({(dt, d, m, False, False, False) for dt in wide for d in fam.HEAD_DIMS for m in Mask}
                         | {(DType.FP8, d, m, False, False, False) for d in fam.FP8_HEAD_DIMS for m in fam.FP8_MASKS}
                         | {(dt, d, m, True, False, False) for dt in wide for d in fam.SOFTCAP_DEFAULT_HEAD_DIMS
                            for m in (Mask.NONE, Mask.CAUSAL)}
                         | {(dt, d, m, False, True, False) for dt in wide for d in fam.BIAS_DEFAULT_HEAD_DIMS
                            for m in (Mask.NONE, Mask.CAUSAL)}
                         | {(dt, d, m, False, False, True) for dt in wide for d in fam.DROPOUT_HEAD_DIMS
                            for m in (Mask.NONE, Mask.CAUSAL)})
    capped = [i for i in fam.PREFERRED_DEFAULT if i.softcap]  # the tiles of the plain defaults
    assert all(dataclasses.replace(i, softcap=False) in fam.PREFERRED_DEFAULT for i in capped)
    biased = [i for i in fam.PREFERRED_DEFAULT if i.bias]  # persistent tiles (BIAS_TILE)
    assert all((i.schedule, i.block_m, i.block_n, i.q_buffers) == fam.BIAS_TILE[i.head_dim] for i in biased)
    extra = [i for i in fam.DEFAULT if i not in fam.PREFERRED_DEFAULT]
    assert len(extra) == len(wide) * len(fam.SHORT_SEQUENCE_TILES)
    assert all((i.schedule, i.block_m, i.block_n, i.q_buffers) == fam.SHORT_SEQUENCE_TILES[i.head_dim, i.causal]
               for i in extra)


def test_short_sequence_tile_wins_only_short_causal_sequences(tmp_path):
    """With the default build only, the causal d64 TMA 64x64 tile runs N <= 1024 (its estimate 8%
    or more below the 256x64 tile's) and the preferred tile every longer sequence (NOTES 64)."""
    import dataclasses

    from conftest import make_entry, write_build_dir
    from gemmgen.select import device, registry, selection
    from gemmgen.select.problem import Problem

    entries = [dataclasses.replace(make_entry(i), gencode=["-gencode=arch=compute_90a,code=sm_90a"])
               for i in fam.DEFAULT if i.head_dim == 64 and i.dtype.value == "bf16"]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    h200 = device.synthetic((9, 0), 132, "NVIDIA H200")
    try:
        for n, causal, tile in ((512, True, "tma_m64n64"), (1024, True, "tma_m64n64"), (2048, True, "pingpong_m256n64"),
                                (16384, True, "pingpong_m256n64"), (512, False, "pingpong_m256n64")):
            problem = Problem(dtype="bf16", head_dim=64, causal=causal, device=h200, batch_heads=16384 // n * 32,
                              seqlen_q=n, seqlen_k=n)
            decision = selection.decide(problem)
            assert decision.source == "heuristic" and tile in decision.winner.name, (n, causal, decision.report())
    finally:
        registry.set_build_dirs(None)


def test_every_instance_fits_and_is_built_only_for_sm90():
    for inst in fam.SPACE:
        assert inst.smem_bytes <= Arch.SM90.max_smem_bytes
    assert fam.ARCHS == (Arch.SM90,)
    assert [i for i in space.select_instances(Arch.SM90) if i.family == fam.FAMILY] == list(fam.DEFAULT)
    assert not any(i.family == fam.FAMILY for i in space.select_instances(Arch.SM80, all_instances=True))


def test_wide_head_dims_take_128x64_on_short_sequences(tmp_path):
    """With the default build only, d160 causal and d192 run the buffered 128x64 tile on short
    sequences (128x96's direct stores and 96-key rounding cost it 8% or more in the estimate there)
    and 128x96 from N = 4096; d160 without a mask has no short tile (128x96 led at every length,
    NOTES 113)."""
    from conftest import make_entry, write_build_dir
    from gemmgen.select import device, registry, selection
    from gemmgen.select.problem import Problem

    entries = [dataclasses.replace(make_entry(i), gencode=["-gencode=arch=compute_90a,code=sm_90a"])
               for i in fam.DEFAULT if i.head_dim in (160, 192) and i.dtype.value == "bf16"]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    h100 = device.synthetic((9, 0), 132, "NVIDIA H100 80GB HBM3")
    try:
        for d, causal, n, tile in ((192, True, 1024, "m128n64s5"), (192, False, 1024, "m128n64s5"),
                                   (160, True, 1024, "m128n64s5"), (160, False, 1024, "m128n96s5"),
                                   (192, True, 4096, "m128n96s4"), (192, False, 4096, "m128n96s4"),
                                   (160, True, 16384, "m128n96s5"), (160, False, 512, "m128n96s5")):
            problem = Problem(dtype="bf16", head_dim=d, causal=causal, device=h100,
                              batch_heads=16384 // n * (2048 // d), seqlen_q=n, seqlen_k=n)
            decision = selection.decide(problem)
            assert decision.source == "heuristic" and tile in decision.winner.name, (d, causal, n, decision.report())
    finally:
        registry.set_build_dirs(None)


@pytest.mark.parametrize("change, reason", [
    (dict(block_m=128, schedule=Schedule.TMA), "128 rows"),
    (dict(block_m=64, schedule=Schedule.COOPERATIVE), "32 rows"),
    (dict(block_n=192, stages=4), None),  # one of the two tiles the causal rule removes (O from registers)
    (dict(head_dim=96), None),  # 96, 160 and 192 run as well (bench/NOTES.md, experiment 60)
    (dict(head_dim=80), "head_dim 80"),
    (dict(block_n=256), "tile 128x256"),
    (dict(head_dim=256, block_n=128, stages=5), "shared memory"),
    (dict(stages=3), "stages 3: this tile uses 5"),
    (dict(stages=2), "K/V stages hang"),  # every 2-stage tile hung on an H100 (bench/NOTES.md, 105)
    (dict(head_dim=256, schedule=Schedule.COOPERATIVE, stages=2), "K/V stages hang"),  # only 2 fit
    (dict(schedule=Schedule.TMA, block_m=64, stages=2), "the TMA schedule needs 4"),
    (dict(schedule=Schedule.TMA, block_m=64, head_dim=256, stages=3), "the TMA schedule needs 4"),
    (dict(mask=Mask.CAUSAL, block_n=192, stages=4), "crosses the diagonal"),
    (dict(head_dim=64, block_m=192), None),  # three consumer groups
    (dict(head_dim=64, block_m=192, mask=Mask.CAUSAL), None),  # 192 / 128: the masked tiles still cover it
    (dict(head_dim=64, block_m=192, schedule=Schedule.COOPERATIVE), "96 rows"),
    (dict(block_m=192), "exceed 112 (3 consumer groups)"),  # d128 spills with 160 registers
    (dict(head_dim=64, block_m=256), "tile 256x128"),
    (dict(head_dim=64, block_m=256, block_n=64), None),  # four consumer groups
    (dict(head_dim=64, block_m=64), "2 to 4 consumer warp groups"),
    (dict(head_dim=64, block_m=256, block_n=64, q_buffers=2), None),  # a second Q buffer per group
    (dict(head_dim=64, schedule=Schedule.TMA, block_m=64, stages=4, q_buffers=2), "second Q buffer"),
    (dict(q_buffers=2), None),  # at d128 the Q buffers and O's cost a K/V stage: O from registers
    (dict(q_buffers=2, stages=4), "stages 4: this tile uses 5"),
    (dict(block_n=96), None),
    (dict(head_dim=192, block_n=96, stages=4), None),  # O from registers: 4 stages (3 beside its buffer)
    (dict(head_dim=192, block_n=96, stages=3), "stages 3: this tile uses 4"),
    (dict(block_n=112), "tile 128x112"),  # half of 96's rate on an H100 (bench/NOTES.md, 113)
])
def test_invalid_reason(change, reason):
    base = FmhaSm90Instance(DType.BF16, 128, Mask.NONE, Schedule.PINGPONG, 128, 128, 5)
    assert fam.invalid_reason(base) is None
    got = fam.invalid_reason(dataclasses.replace(base, **change))
    assert got is None if reason is None else reason in got


def test_consumer_groups_and_threads():
    base = FmhaSm90Instance(DType.BF16, 64, Mask.NONE, Schedule.PINGPONG, 128, 128, 5)
    for block_m, groups in ((128, 2), (192, 3), (256, 4)):
        inst = dataclasses.replace(base, block_m=block_m)
        assert (inst.consumer_groups, inst.threads) == (groups, 128 * (groups + 1))
    tma = dataclasses.replace(base, schedule=Schedule.TMA, block_m=64, stages=4)
    assert (tma.consumer_groups, tma.threads) == (1, 128)


@pytest.mark.parametrize("block_m, block_n", [(bm, bn) for bm in (64, 128, 192, 256) for bn in (64, 128, 192)])
def test_causal_tile_rule_matches_the_diagonal(block_m, block_n):
    """The rule against a direct check: in every row tile, each key tile that CUTLASS's fusion leaves
    unmasked has no key past the tile's first row."""
    masked = -(-block_m // block_n)
    crosses = False
    for m in range(12):
        tiles = -(-(m + 1) * block_m // block_n)
        for t in range(max(tiles - masked, 0)):
            last_key = (t + 1) * block_n - 1
            crosses |= last_key > m * block_m
    assert fam.causal_tiles_masked(block_m, block_n) == (not crosses)


def problem(**kw) -> Problem:
    return Problem(**{"dtype": "bf16", "head_dim": 128, "causal": False, "device": H200, "batch_heads": 32,
                      "seqlen_q": 1024, "seqlen_k": 1024, **kw})


CAUSAL_128 = FmhaSm90Instance(DType.BF16, 128, Mask.CAUSAL, Schedule.PINGPONG, 128, 128, 5, lazy_rescale=True)


@pytest.mark.parametrize("kw, reason", [
    (dict(), None),
    (dict(dropout=True), "no dropout"),
    (dict(bias=True), "no additive mask (only instances built for one, `_bias`, run it)"),
    (dict(varlen=True), None),  # packed sequences on the persistent schedule
    (dict(varlen=True, short_keys=True), "every sequence with queries has keys"),
    (dict(varlen=True, causal=True, seqlen_q=1100, seqlen_k=1000), None),  # maxima: short_keys decides
    (dict(negative_scale=True), "scales >= 0"),
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1000), None),  # chunked prefill
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1, seqlen_k=17), None),
    (dict(causal=True, causal_alignment="bottom_right"), None),
    (dict(causal=True, seqlen_q=1000), None),
    (dict(causal=True, seqlen_q=1100, seqlen_k=1000), "seqlen_q <= seqlen_k"),
    (dict(causal=True, seqlen_q=1100), "seqlen_q <= seqlen_k"),
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1100), "seqlen_q <= seqlen_k"),
    (dict(max_offset=2**31), "int32"),
    # a contiguous key-value cache as packed sequences (key counts on the GPU)
    (dict(kv_cache=True, varlen=True, causal=True, causal_alignment="bottom_right"), None),
    (dict(kv_cache=True, varlen=True), None),
    (dict(kv_cache=True, varlen=True, causal=True), "causal bottom-right"),
    (dict(kv_cache=True), "as packed sequences only"),
    (dict(kv_cache=True, varlen=True, paged=True), "contiguous caches"),
    (dict(kv_cache=True, varlen=True, window=(64, 0)), "no window"),
])
def test_problem_reason(kw, reason):
    got = fam.problem_reason(CAUSAL_128, problem(**kw))
    assert got is None if reason is None else reason in got


def test_additive_masks_only_on_bias_instances():
    """A `_bias` instance runs calls with an additive mask only, with fixed lengths; the others none."""
    biased = dataclasses.replace(CAUSAL_128, bias=True)
    assert biased.name.endswith("_lr_bias") and biased.params()["bias"] is True and "bias" not in CAUSAL_128.params()
    assert fam.problem_reason(biased, problem(bias=True)) is None
    assert fam.problem_reason(biased, problem(bias=True, causal=True, causal_alignment="bottom_right",
                                              seqlen_q=17)) is None
    assert "has none" in fam.problem_reason(biased, problem())
    assert "no dropout" in fam.problem_reason(biased, problem(bias=True, dropout=True))
    assert "fixed lengths" in fam.problem_reason(biased, problem(bias=True, varlen=True))
    assert not biased.speculates and not biased.runs_varlen
    assert biased.smem_bytes == CAUSAL_128.smem_bytes + 1024  # the bias slots
    for bad in (dataclasses.replace(biased, schedule=Schedule.COOPERATIVE),
                dataclasses.replace(biased, mask=Mask.LOCAL), dataclasses.replace(biased, lazy_rescale=False),
                dataclasses.replace(biased, dtype=DType.FP8)):
        assert "additive mask" in (fam.invalid_reason(bad) or "")


def test_dropout_only_on_dropout_instances():
    """A `_dropout` instance runs dropout calls only, with fixed lengths and fewer than 2^31 weights
    per head (the mask's 32-bit positions); the others none."""
    dropped = dataclasses.replace(CAUSAL_128, dropout=True)
    assert dropped.name.endswith("_lr_dropout") and dropped.params()["dropout"] is True
    assert "dropout" not in CAUSAL_128.params()
    assert fam.problem_reason(dropped, problem(dropout=True)) is None
    assert fam.problem_reason(dropped, problem(dropout=True, causal=True, causal_alignment="bottom_right",
                                               seqlen_q=17)) is None
    assert "has none" in fam.problem_reason(dropped, problem())
    assert "`_dropout`" in fam.problem_reason(CAUSAL_128, problem(dropout=True))
    assert "fixed lengths" in fam.problem_reason(dropped, problem(dropout=True, varlen=True))
    assert "2^31" in fam.problem_reason(dropped, problem(dropout=True, seqlen_q=46341, seqlen_k=46341))
    assert fam.problem_reason(dropped, problem(dropout=True, seqlen_q=46340, seqlen_k=46340)) is None
    assert not dropped.speculates and not dropped.runs_varlen
    assert dropped.smem_bytes == CAUSAL_128.smem_bytes + 768  # the dropout slots
    assert fam.invalid_reason(dropped) is None
    for bad in (dataclasses.replace(dropped, schedule=Schedule.COOPERATIVE),
                dataclasses.replace(dropped, mask=Mask.LOCAL), dataclasses.replace(dropped, lazy_rescale=False),
                dataclasses.replace(dropped, dtype=DType.FP8), dataclasses.replace(dropped, bias=True),
                dataclasses.replace(dropped, softcap=True), dataclasses.replace(dropped, head_dim=96)):
        assert "dropout runs" in (fam.invalid_reason(bad) or ""), bad.name
    built = [i for i in fam.DEFAULT if i.dropout]
    assert {(i.dtype, i.head_dim, i.mask) for i in built} == {
        (dt, d, m) for dt in (DType.FP16, DType.BF16) for d in fam.DROPOUT_HEAD_DIMS
        for m in (Mask.NONE, Mask.CAUSAL)}
    assert all((i.schedule, i.block_m, i.block_n, i.q_buffers) == fam.DROPOUT_TILE[i.head_dim] for i in built)


def test_varlen_only_on_the_persistent_16_bit_schedule():
    """Packed sequences run on the persistent 16-bit instances, sliding windows included; those carry
    the `varlen` mark (a build from before lacks it and is refused them by the registry)."""
    tma = FmhaSm90Instance(DType.BF16, 32, Mask.NONE, Schedule.TMA, 64, 128, 4, lazy_rescale=True)
    assert not tma.runs_varlen and "varlen" not in tma.params()
    assert "persistent schedule, 16-bit" in fam.problem_reason(tma, problem(varlen=True))
    local = dataclasses.replace(CAUSAL_128, mask=Mask.LOCAL, lazy_rescale=True)
    assert local.runs_varlen and local.params()["varlen"] is True
    assert fam.problem_reason(local, problem(varlen=True, window=(8, 0))) is None
    assert CAUSAL_128.runs_varlen and CAUSAL_128.params()["varlen"] is True
    assert CAUSAL_128.params()["kv_cache"] is True and "kv_cache" not in tma.params()
    assert fam.MARKED == ("varlen", "kv_cache")


def test_builds_from_before_key_value_chunks_are_kept_from_them(tmp_path, monkeypatch):
    """An entry built before the packed kernel read key counts on the GPU (params with the `varlen`
    mark, without `kv_cache`) is refused key-value chunks with a reason that says to rebuild, and
    still runs packed calls."""
    from conftest import make_entry, write_build_dir

    new = dataclasses.replace(make_entry(CAUSAL_128), arch="sm90", gencode=list(Arch.SM90.gencode))
    old = dataclasses.replace(new, params={k: v for k, v in new.params.items() if k != "kv_cache"})
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(write_build_dir(tmp_path, [old])))
    registry.refresh()
    try:
        (cand,) = registry.load()[0]
        chunk = problem(causal=True, causal_alignment="bottom_right", varlen=True, kv_cache=True)
        assert "built before its family ran key-value caches" in registry.reject_reason(cand, chunk)
        assert registry.reject_reason(cand, problem(causal=True, varlen=True)) is None
    finally:
        monkeypatch.delenv("GEMMGEN_BUILD_DIR")
        registry.refresh()


def test_registry_prefers_the_family_that_can_run(tmp_path):
    """With an sm90 and an sm80 instance built, a negative scale goes to fa2_sm80 with the reason."""
    from conftest import make_entry, write_build_dir
    from gemmgen.generator.families import fa2_sm80

    sm90 = next(i for i in fam.DEFAULT if i.name == "fmha_sm90_bf16_d128_none_pingpong_m128n128s5_lr")
    assert sm90 in fam.DEFAULT
    sm80 = next(i for i in fa2_sm80.DEFAULT if i.name == "fa2_sm80_bf16_d128_none_m128n64w4s1")
    entries = [make_entry(sm80), dataclasses.replace(make_entry(sm90), arch="sm90", gencode=list(Arch.SM90.gencode))]
    registry.set_build_dirs([write_build_dir(tmp_path, entries)])
    try:
        good, rejected = registry.candidates(problem())
        assert {c.name for c in good} == {sm80.name, sm90.name}
        assert selection.select(problem()).name == sm90.name  # the heuristic weighs the family's speed
        good, rejected = registry.candidates(problem(negative_scale=True))
        assert [c.name for c in good] == [sm80.name]
        assert any(sm90.name in label and "scales >= 0" in reason for label, reason in rejected)
        # sm_90a code runs on compute capability 9.0 only.
        good, rejected = registry.candidates(problem(device=device.synthetic((10, 0), 148)))
        assert any(sm90.name in label and "no code for this GPU" in reason for label, reason in rejected)
    finally:
        registry.set_build_dirs(None)


@pytest.mark.parametrize("suffix, lazy", [("", "false"), ("_lr", "true")])
def test_rendered_text(suffix, lazy):
    inst = next(i for i in fam.SPACE if i.name == "fmha_sm90_bf16_d128_causal_pingpong_m128n128s5" + suffix)
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    text = render.render_text(inst, tc)
    assert '#include "gemmgen/fmha_sm90/launch.h"' in text
    assert "Config<cutlass::bfloat16_t, /*BlockM=*/128, /*BlockN=*/128," in text
    assert "Schedule::kPingpong" in text and "/*Causal=*/true, /*StagesKV=*/5," in text
    assert f"/*Lazy=*/{lazy}, /*QBuffers=*/1,\n" in text
    assert f"/*Speculate=*/{lazy},\n" in text  # the d128 128x128 ping-pong tile speculates with our softmax
    assert "/*Local=*/false,\n" in text and "/*Softcap=*/false,\n" in text and "/*Bias=*/false,\n" in text and "/*DirectO=*/false,\n" in text
    assert "/*Dropout=*/false>" in text
    assert f"GEMMGEN_EXPORT int {inst.symbol}(const GemmgenAttnParams* params" in text


@pytest.mark.parametrize("name, direct", [
    ("fmha_sm90_bf16_d192_none_pingpong_m128n96s4_lr", True),  # 3 stages beside the buffer, 4 without
    ("fmha_sm90_bf16_d160_causal_pingpong_m128n96s5_lr", True),  # 4 and 5
    ("fmha_sm90_bf16_d256_local_pingpong_m128n64s5_lr", True),  # 3 and 5
    ("fmha_sm90_fp8_d256_none_pingpong_m128n128s5_lr", True),  # 4 and 5
    ("fmha_sm90_bf16_d192_none_pingpong_m128n64s5_lr", False),  # 5 fit beside the buffer
    ("fmha_sm90_bf16_d128_causal_pingpong_m128n128s5_lr", False),
    ("fmha_sm90_bf16_d256_none_coop_m128n64s5_lr", False),  # CUTLASS's epilogue, in the mainloop's space
])
def test_direct_store(name, direct):
    """O goes from registers straight to memory exactly where its buffer would cost K/V stages;
    the rule is in the build key, the rendered source and the shared-memory figure."""
    inst = next(i for i in fam.SPACE if i.name == name)
    assert inst.direct_store is direct
    assert inst.params().get("direct_store", False) is direct
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    assert f"/*DirectO=*/{'true' if direct else 'false'},\n" in render.render_text(inst, tc)
    if inst.persistent:
        buffers = inst.consumer_groups * 64 * inst.head_dim * 2
        assert inst._smem_bytes(inst.stages, True) - inst._smem_bytes(inst.stages, False) == buffers
        assert inst.smem_bytes == inst._smem_bytes(inst.stages, not direct)
        fits = [s for s in (3, 4, 5) if inst._smem_bytes(s, True) <= Arch.SM90.max_smem_bytes]
        assert direct == (max(fits, default=0) < inst.stages)


@pytest.mark.parametrize("name, speculates", [
    ("fmha_sm90_fp16_d128_none_pingpong_m128n128s5_lr", True),  # 2 groups: 128 + 64 + 16 <= 240
    ("fmha_sm90_fp16_d128_causal_coop_m128n128s5_lr", True),
    ("fmha_sm90_fp16_d64_causal_pingpong_m256n64s5_lr_q2", True),  # 4 groups: 64 + 32 + 16 <= 112
    ("fmha_sm90_fp16_d64_none_pingpong_m192n128s5_lr", False),  # 3 groups: 128 + 32 + 16 > 160
    ("fmha_sm90_fp16_d64_causal_tma_m64n64s4_lr", False),  # CUTLASS's TMA mainloop
    ("fmha_sm90_fp16_d128_none_pingpong_m128n128s5", False),  # CUTLASS's softmax
    ("fmha_sm90_fp16_d256_none_coop_m128n64s5_lr", False),  # head dims above 128: not measured
])
def test_speculates(name, speculates):
    """Which instances run the speculative softmax step: one rule in Python, rendered into the source."""
    inst = next(i for i in fam.SPACE if i.name == name)
    assert inst.speculates is speculates
    assert inst.params().get("speculate", False) is speculates  # in the build key
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    assert f"/*Speculate=*/{'true' if speculates else 'false'},\n" in render.render_text(inst, tc)


@pytest.mark.parametrize("name, shape", [
    (BUILD_ONE, (64, 64, 64, 1)),
    # the persistent schedule: our own kernel and output epilogue (persistent.h)
    ("fmha_sm90_bf16_d128_none_pingpong_m128n128s5_lr", (128, 128, 128, 0)),
    # three consumer groups, and CUTLASS's softmax
    ("fmha_sm90_bf16_d32_causal_pingpong_m192n128s5", (32, 192, 128, 1)),
    # O stored from registers (direct_store): no output buffers in the shared memory
    ("fmha_sm90_bf16_d192_none_pingpong_m128n96s4_lr", (192, 128, 96, 0)),
])
def test_real_build_and_info(tmp_path, name, shape):
    """nvcc compiles an sm_90a instance; its library loads without a GPU and reports what the
    manifest says (shared memory to within the estimate's margin, which must not undercount)."""
    proc = run_cli("generate", "--arch", "sm90", "--all", "--filter", f"^{name}$", "--out", str(tmp_path),
                   "--jobs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry = manifest.load(tmp_path / "sm90" / "manifest.json").instances[0]
    assert entry.name == name and entry.state == "built" and entry.gencode == list(Arch.SM90.gencode)
    kernel = abi.bind(tmp_path / "sm90" / entry.library, entry.symbol)
    info = kernel.info().as_dict()
    assert kernel.needs_lse
    assert (info["head_dim"], info["block_m"], info["block_n"], info["causal"], info["threads"]) == (
        *shape, entry.threads)
    assert 0 <= entry.smem_bytes - info["smem_bytes"] <= 2048
