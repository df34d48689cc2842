"""The fa2_bwd_sm80 family (the mma.sync backward) without a GPU: its instance space and validity rule,
the warp split it shares with traits.h, what a built instance refuses (problem_reason), where the
registry sends backward calls once it is built, rendering, and a real nvcc build of one instance
whose library loads without a GPU: its info, its workspace size and the calls it refuses before any
CUDA call."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import build_one_bwd, fake_bwd_params
from gemmgen.arch import Arch
from gemmgen.errors import GemmgenLaunchError
from gemmgen.generator import render, space
from gemmgen.generator.families import base, fmha_bwd_sm90, mea_bwd_sm80
from gemmgen.generator.families import fa2_bwd_sm80 as fam
from gemmgen.generator.families.fa2_bwd_sm80 import DType, Fa2BwdSm80Instance
from gemmgen.kernels import abi
from gemmgen.select import device
from gemmgen.select.problem import BwdProblem

A100 = device.synthetic((8, 0), 108)
H100 = device.synthetic((9, 0), 132)
BUILD_ONE = "fa2_bwd_sm80_fp16_d32_m64n64w4s1"  # the quickest to compile


def test_family_keeps_the_contract_and_is_registered():
    base.check_family(fam)
    assert fam.KIND == "attention_bwd" and fam.BUILT_BY_DEFAULT and fam.ARCHS == (Arch.SM80,)
    assert space.family_named(fam.FAMILY) is fam
    for inst in fam.DEFAULT:
        assert fam.INSTANCE.from_params(inst.params()) == inst


def test_space_names_unique_and_stable():
    names = [inst.name for inst in fam.SPACE]
    assert len(names) == len(set(names)) == 188
    assert all("bwd" in n and n.startswith("fa2_bwd_sm80_") for n in names)
    assert "fa2_bwd_sm80_bf16_d128_m64n128w8s1" in names and "fa2_bwd_sm80_bf16_d256_m64n64w8s1_sc" in names
    assert "fa2_bwd_sm80_bf16_d256_m64n64w8s2" not in names  # 208 KB of shared memory: not on sm80
    assert "fa2_bwd_sm80_bf16_d128_m128n128w8s1" not in names  # 256 accumulators a thread
    assert {n.removesuffix("_sc") for n in names if n.endswith("_sc")} == {n for n in names if not n.endswith("_sc")}
    assert len({inst.content_hash() for inst in fam.SPACE}) == len(names)


def test_default_covers_every_dtype_and_head_dim_once():
    keys = [(i.dtype, i.head_dim, i.softcap) for i in fam.DEFAULT]
    assert len(keys) == len(set(keys)) == 18
    assert set(keys) == {(dt, d, sc) for dt in fam.DTYPES for d in fam.HEAD_DIMS for sc in (False, True)
                         if not sc or d in fam.SOFTCAP_DEFAULT_HEAD_DIMS}
    assert all(i.mask is None for i in fam.DEFAULT)  # both masks: the causal offset is a launch parameter
    assert [i for i in space.select_instances(Arch.SM80) if i.family == fam.FAMILY] == list(fam.DEFAULT)
    assert not any(i.family == fam.FAMILY for i in space.select_instances(Arch.SM90, all_instances=True))


@pytest.mark.parametrize("rows, cols, warps, want", [
    (64, 128, 8, 2),  # S and dP at 64 x 128: 2 x 4 warps read 512 elements a k step, 4 x 2 640
    (128, 128, 8, 4),  # tie (768): the larger row split
    (64, 64, 8, 4),
    (64, 256, 8, 2),  # tie of 1 and 2 (768): 2
    (64, 32, 8, 4),  # 32 columns take at most 2 column warps
    (16, 16, 8, 0),  # no split gives 8 warps whole 16 x 16 steps
])
def test_warp_split(rows, cols, warps, want):
    assert fam.warp_rows(rows, cols, warps) == want


@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(head_dim=80), "head_dim 80"),
    (dict(block_m=32), "block_m 32"),
    (dict(warps=2), "warps 2"),
    (dict(stages=3), "stages 3"),
    (dict(block_m=128, block_n=128), "accumulators"),  # d128: 256 a thread
    (dict(head_dim=256, block_n=64, stages=2), "shared memory"),
    (dict(head_dim=256, block_n=64), None),
    (dict(head_dim=32, block_m=128, block_n=128), None),
    (dict(head_dim=32, warps=4, block_m=64, block_n=64), None),
    (dict(softcap=True), None),
])
def test_invalid_reason(change, reason):
    inst = dataclasses.replace(Fa2BwdSm80Instance(DType.BF16, 128, 64, 128, 8, 1), **change)
    got = fam.invalid_reason(inst)
    assert got is None if reason is None else reason in got


def test_shared_memory_and_cost_inputs():
    inst = Fa2BwdSm80Instance(DType.BF16, 128, 64, 128, 8, 1)
    # Q and dO (one buffer each), K and V, P and dS: traits.h's kSmemSize.
    assert inst.smem_bytes == (2 * 64 * 128 + 2 * 128 * 128 + 2 * 64 * 128) * 2 == 131072
    assert inst.threads == 256
    cost = inst.cost_inputs  # a CTA's rows are block_n keys, its columns block_m queries a step
    assert (cost.block_m, cost.block_n, cost.stages, cost.threads) == (128, 64, 1, 256)


def problem(**kw) -> BwdProblem:
    return BwdProblem(**{"dtype": "bf16", "head_dim": 128, "causal": False, "device": A100, "batch_heads": 32,
                         "seqlen_q": 1024, "seqlen_k": 1024, **kw})


D128 = Fa2BwdSm80Instance(DType.BF16, 128, 64, 128, 8, 1)


@pytest.mark.parametrize("kw, reason", [
    (dict(), None),
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1000, seqlen_k=77), None),
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1, seqlen_k=4097), None),
    (dict(negative_scale=True), None),
    (dict(zero_scale=True), None),
    (dict(max_offset=2**40), None),  # 64-bit offsets
    (dict(dropout=True), "no dropout"),
    (dict(bias=True), "no bias"),
    (dict(varlen=True), None),
    (dict(varlen=True, causal=True, causal_alignment="bottom_right", seqlen_q=17, seqlen_k=4097), None),
    (dict(kv_cache=True), "no kv cache"),
    (dict(bias_grad=True), "no dbias"),
    (dict(deterministic=True), None),  # dQ added in key-tile order
    (dict(align=8), "16-byte aligned"),
])
def test_problem_reason(kw, reason):
    got = fam.problem_reason(D128, problem(**kw))
    assert got is None if reason is None else reason in got


def test_registry_takes_windows_and_keeps_other_head_dims_away():
    from gemmgen.select import registry

    assert registry.functional_reason(fam, D128, problem(window=(64, 0))) is None  # SLIDING_WINDOW
    assert "head_dim" in registry.functional_reason(fam, D128, problem(head_dim=64))
    assert "softcap" in registry.functional_reason(fam, D128, problem(softcap=True))
    capped = dataclasses.replace(D128, softcap=True)
    assert registry.functional_reason(fam, capped, problem(softcap=True)) is None


def test_relative_speeds_order_the_backward_families():
    """On Hopper fmha_bwd_sm90 keeps the head dims it has a tile for (and d96 pads to its 128); this
    family runs above 128 and everywhere on Ampere-class GPUs ahead of mea_bwd_sm80."""
    assert mea_bwd_sm80.RELATIVE_SPEED < fam.RELATIVE_SPEED < fmha_bwd_sm90.RELATIVE_SPEED * 96 / 128


@pytest.mark.parametrize("arch, d, causal, want", [
    ("sm80", 128, True, "fa2_bwd_sm80"),
    ("sm80", 256, False, "fa2_bwd_sm80"),
    ("sm90", 128, True, "fmha_bwd_sm90"),
    ("sm90", 192, True, "fa2_bwd_sm80"),
    ("sm90", 256, False, "fa2_bwd_sm80"),
    ("sm80", 128, (64, 0), "fa2_bwd_sm80"),  # a sliding window
    ("sm90", 128, (64, 0), "fmha_bwd_sm90"),  # its local instance
    ("sm90", 256, (64, 8), "fa2_bwd_sm80"),
])
def test_registry_picks_by_arch_and_head_dim(tmp_path, monkeypatch, arch, d, causal, want):
    from conftest import make_entry, write_build_dir
    from gemmgen.select import registry, selection

    built = (*fam.DEFAULT, *fmha_bwd_sm90.DEFAULT, *mea_bwd_sm80.DEFAULT)
    root = write_build_dir(tmp_path, [make_entry(i) for i in built])
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(root))
    registry.refresh()
    try:
        gpu = A100 if arch == "sm80" else H100
        mask = dict(window=causal) if isinstance(causal, tuple) else dict(causal=causal)
        picked = selection.select(problem(device=gpu, head_dim=d, **mask))
        assert picked.entry.family == want
    finally:
        monkeypatch.delenv("GEMMGEN_BUILD_DIR")
        registry.refresh()


def test_builds_from_before_the_marks_are_kept_from_varlen_and_windows(tmp_path, monkeypatch):
    """An entry built before its kernels read variable lengths and windows (no marks in its params)
    is refused them with a reason that says to rebuild, and still runs the rest."""
    from conftest import make_entry, write_build_dir
    from gemmgen.select import registry

    new = make_entry(D128)
    assert new.params["varlen"] is True and new.params["window"] is True
    old = dataclasses.replace(new, params={k: v for k, v in new.params.items() if k not in fam.MARKED})
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(write_build_dir(tmp_path, [old])))
    registry.refresh()
    try:
        (cand,) = registry.load()[0]
        assert "built before its family ran variable lengths" in registry.reject_reason(cand, problem(varlen=True))
        assert "built before its family ran sliding windows" in registry.reject_reason(cand, problem(window=(8, 8)))
        assert registry.reject_reason(cand, problem(causal=True)) is None
    finally:
        monkeypatch.delenv("GEMMGEN_BUILD_DIR")
        registry.refresh()


def test_on_demand_build_target():
    """A backward call no built instance runs compiles this family's DEFAULT tile on sm_80, or the
    first tile of SPACE that fits a GPU with less shared memory (compute capability 8.6: 99 KB)."""
    from gemmgen.select import registry

    arch, inst = registry.build_target(problem(head_dim=96))
    assert arch is Arch.SM80 and inst.name == "fa2_bwd_sm80_bf16_d96_m64n128w8s1"
    arch, inst = registry.build_target(problem(device=device.synthetic((8, 6), 84)))
    assert inst.family == fam.FAMILY and inst.head_dim == 128 and inst.smem_bytes <= 99 * 1024
    assert registry.build_target(problem(deterministic=True))[1].family == fam.FAMILY
    assert registry.build_target(problem(dropout=True))[1].family == "mea_bwd_sm80"


def test_rendered_text():
    inst = next(i for i in fam.SPACE if i.name == "fa2_bwd_sm80_bf16_d128_m64n128w8s1")
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    text = render.render_text(inst, tc)
    assert '#include "gemmgen/fa2_bwd_sm80/launch.h"' in text
    assert "BwdTraits<cutlass::bfloat16_t, /*HeadDim=*/128," in text
    assert "/*BlockM=*/64, /*BlockN=*/128," in text and "/*Warps=*/8, /*Stages=*/1>;" in text
    assert "constexpr bool kSoftcap = false;" in text
    capped = dataclasses.replace(inst, softcap=True)
    assert "constexpr bool kSoftcap = true;" in render.render_text(capped, tc)
    sym = inst.symbol
    assert f"GEMMGEN_EXPORT int {sym}(const GemmgenAttnBwdParams* params, void* stream" in text
    assert f"GEMMGEN_EXPORT int64_t {sym}_workspace(const GemmgenAttnBwdParams* params)" in text
    assert f"GEMMGEN_EXPORT int {sym}_info(GemmgenInstanceInfo* info)" in text


# A real build: nvcc 13 with CUTLASS's headers, no GPU needed to load the library.

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_one_bwd(tmp_path_factory, fam.FAMILY, Arch.SM80, BUILD_ONE)


params = fake_bwd_params


def test_real_build_info(built):
    entry, kernel = built
    info = kernel.info()
    assert info.abi_version == abi.ABI_VERSION and info.flags & abi.INFO_BACKWARD
    assert info.flags & abi.INFO_READS_GQA and kernel.reads_gqa  # K and V at their own heads
    assert (info.head_dim, info.block_m, info.block_n, info.causal, info.threads) == (32, 64, 64, 0, entry.threads)
    assert info.smem_bytes == entry.smem_bytes  # the family's figure is exact


def test_real_build_workspace(built):
    _, kernel = built
    # Rows padded to whole 64-row query tiles: the fp32 dQ accumulator, then LSE and D, each part
    # 256-byte aligned.
    vec = -(-2 * 3 * 128 * 4 // 256) * 256
    assert kernel.workspace_bytes(params()) == 2 * 3 * 128 * 32 * 4 + 2 * vec
    assert kernel.workspace_bytes(params(seqlen_q=1)) == 2 * 3 * 64 * 32 * 4 + 2 * (2 * 3 * 64 * 4)
    # Deterministic calls: an int32 turn counter per query tile besides (2 * 3 * 2 of them, 256 bytes).
    assert kernel.workspace_bytes(params(deterministic=1)) == 2 * 3 * 128 * 32 * 4 + 2 * vec + 256
    assert kernel.workspace_bytes(params(head_dim=64)) == 0  # not this instance's: run() refuses it
    assert kernel.workspace_bytes(params(batch=0)) == 0


@pytest.mark.parametrize("kw, words", [
    (dict(head_dim=64), "head_dim 64, this instance runs 32"),
    (dict(seqlen_k=0), "bad sizes"),
    (dict(heads_kv=2), "bad sizes"),  # 3 query heads are no whole groups of 2
    (dict(dropout_p=0.1), "no bias or dropout"),
    (dict(bias=0x1000), "no bias or dropout"),
    (dict(dbias=0x1000), "no bias or dropout"),
    (dict(cu_seqlens_q=0x1000), "need both cu_seqlens_q and cu_seqlens_k"),
    (dict(align_per_sequence=1), "align_per_sequence aligns the sequences of variable lengths"),
    (dict(local=1, window_left=-2, window_right=8), "each side is -1 (unbounded) or >= 0"),
    (dict(softcap=30.0), "this instance runs no logit softcap"),
    (dict(q=0x10000008), "16-byte aligned"),
    (dict(dv_row_stride=36), "dv: stride 36"),
    (dict(k_head_stride=100 * 32 + 4), "k: stride"),
    (dict(dk=0), "must be set"),
    (dict(lse=0x10000002), "lse is not 4-byte aligned"),
    (dict(workspace=0x10000010), "workspace"),
    (dict(workspace_bytes=1024), "workspace"),
])
def test_real_build_refuses(built, kw, words):
    """Every refusal comes before any CUDA call, so it runs without a GPU."""
    _, kernel = built
    with pytest.raises(GemmgenLaunchError, match="INVALID_ARGUMENT") as info:
        kernel.run(params(**kw), None)
    assert words in str(info.value)


def test_real_build_ignores_the_strides_of_single_dims(built):
    """A dim of extent 1 has no stride to align: such a call gets past every check, to the first CUDA
    call, which fails without a GPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the params point at no memory: only a machine without a GPU may get past the checks")
    _, kernel = built
    p = params(batch=1, q_batch_stride=3, heads=1, heads_kv=1, k_head_stride=5)
    try:
        kernel.run(p, None)
    except GemmgenLaunchError as exc:
        assert "INVALID_ARGUMENT" not in str(exc) and "CUDA_ERROR" in str(exc)
