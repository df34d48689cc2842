"""The fmha_bwd_sm90 family (CUTLASS's Hopper FMHA backward): its instance space, validity rule, what
a built instance refuses (problem_reason), rendering, and a real nvcc build of one instance whose
library loads without a GPU: its info, its workspace size, and the calls it refuses before any CUDA
call."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import build_one_bwd, fake_bwd_params
from gemmgen.arch import Arch
from gemmgen.errors import GemmgenLaunchError
from gemmgen.generator import render, space
from gemmgen.generator.families import base
from gemmgen.generator.families import fmha_bwd_sm90 as fam
from gemmgen.generator.families.fmha_bwd_sm90 import DType, FmhaBwdSm90Instance, Mask
from gemmgen.kernels import abi
from gemmgen.select import device
from gemmgen.select.problem import BwdProblem

H100 = device.synthetic((9, 0), 132)
BUILD_ONE = "fmha_bwd_sm90_fp16_d32_none_m64n128"  # the quickest to compile


def test_family_keeps_the_contract_and_is_registered():
    base.check_family(fam)
    assert fam.KIND == "attention_bwd" and fam.BUILT_BY_DEFAULT and fam.ARCHS == (Arch.SM90,)
    assert space.family_named(fam.FAMILY) is fam
    assert fam.INSTANCE.from_params(fam.DEFAULT[0].params()) == fam.DEFAULT[0]


def test_space_names_unique_and_stable():
    names = [inst.name for inst in fam.SPACE]
    assert len(names) == len(set(names)) == 80
    assert all("bwd" in n and n.startswith("fmha_bwd_sm90_") for n in names)
    assert "fmha_bwd_sm90_bf16_d128_causal_m64n128" in names
    assert "fmha_bwd_sm90_fp16_d64_none_m128n128" in names
    assert "fmha_bwd_sm90_fp16_d128_none_m128n128" not in names  # shared memory
    assert "fmha_bwd_sm90_bf16_d64_none_m64n128_sq" in names
    assert {n.removesuffix("_sc") for n in names if n.endswith("_sc")} == {n for n in names if n.endswith("_sq")}
    assert {n for n in names if n.endswith("_sq")} == {
        f"fmha_bwd_sm90_{dt}_d{d}_{m}_m{bm}n128_sq" for dt in ("fp16", "bf16") for m in ("none", "causal", "local")
        for d, bm in ((64, 64), (64, 128), (128, 64))}
    assert not any("_local_" in n and "_sq" not in n for n in names)  # example 88's loop has no window
    # Dropout: the split-dQ tiles without a mask or causal, each a plain tile's twin.
    assert {n.removesuffix("_dropout") for n in names if n.endswith("_dropout")} == {
        n for n in names if n.endswith("_sq") and "_local_" not in n}
    # A bias on the split-dQ mainloop, without a softcap or a window.
    assert {n.removesuffix("_bias") for n in names if n.endswith("_bias")} == {
        n for n in names if n.endswith("_sq") and "_local_" not in n}
    assert len({inst.content_hash() for inst in fam.SPACE}) == len(names)


def test_default_covers_every_dtype_head_dim_mask_once():
    keys = [(i.dtype, i.head_dim, i.mask, i.softcap, i.bias, i.dropout) for i in fam.DEFAULT]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(dt, d, m, sc, bias, drop) for dt in fam.DTYPES for d in fam.HEAD_DIMS for m in fam.MASKS
                         for sc in (False, True) for bias in (False, True) for drop in (False, True)
                         if not (d == 32 and m is Mask.LOCAL) and (not sc or d in fam.SOFTCAP_DEFAULT_HEAD_DIMS)
                         and (not bias or (d in fam.BIAS_DEFAULT_HEAD_DIMS and m is not Mask.LOCAL and not sc))
                         and (not drop or (d in fam.DROPOUT_DEFAULT_HEAD_DIMS and m is not Mask.LOCAL
                                           and not sc and not bias))}
    assert set(fam.DEFAULT) <= set(fam.SPACE)
    # The split-dQ mainloop wherever it runs (d64, d128), example 88's at d32.
    assert all(i.split_dq == (i.head_dim != 32) for i in fam.DEFAULT)


def test_built_by_default_for_sm90_only():
    assert [i for i in space.select_instances(Arch.SM90) if i.family == fam.FAMILY] == list(fam.DEFAULT)
    assert space.select_instances(Arch.SM90, families={fam.FAMILY}) == list(fam.DEFAULT)
    assert space.select_instances(Arch.SM90, families={fam.FAMILY}, all_instances=True) == list(fam.SPACE)
    assert not any(i.family == fam.FAMILY for i in space.select_instances(Arch.SM80, all_instances=True))
    # A backward family adds no head dim to what the forward accepts.
    assert space.supported_head_dims() == tuple(sorted({d for f in space.FAMILIES if f.KIND == "attention"
                                                        for d in f.HEAD_DIMS}))


@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(block_m=128), None),  # d64 128x128
    (dict(head_dim=32, block_m=128), None),
    (dict(head_dim=256), "head_dim 256"),
    (dict(head_dim=96), "head_dim 96"),
    (dict(head_dim=128, block_m=128), "shared memory"),
    (dict(block_n=64), "tile 64x64"),
    (dict(block_m=192), "tile 192x128"),
    (dict(split_dq=True), None),
    (dict(split_dq=True, head_dim=128), None),
    (dict(split_dq=True, head_dim=32), "split-dQ"),
    (dict(split_dq=True, block_m=128), None),  # d64 128x128: the d64 default
    (dict(split_dq=True, head_dim=128, block_m=128), "shared memory"),
    (dict(mask=Mask.LOCAL), "split-dQ mainloop only"),
    (dict(softcap=True), "softcap runs on the split-dQ"),
    (dict(softcap=True, split_dq=True), None),
    (dict(mask=Mask.LOCAL, split_dq=True), None),
])
def test_invalid_reason(change, reason):
    inst = dataclasses.replace(FmhaBwdSm90Instance(DType.BF16, 64, Mask.CAUSAL, 64, 128), **change)
    got = fam.invalid_reason(inst)
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize("name, smem", [
    # SharedStorageSize of the compiled instances (their _info)
    ("fmha_bwd_sm90_fp16_d32_causal_m64n128", 67072),
    ("fmha_bwd_sm90_fp16_d32_causal_m128n128", 117248),
    ("fmha_bwd_sm90_bf16_d64_none_m128n128", 199168),
    ("fmha_bwd_sm90_bf16_d128_none_m64n128", 214528),
    ("fmha_bwd_sm90_bf16_d128_none_m64n128_sq", 230912),
    ("fmha_bwd_sm90_bf16_d64_none_m128n128_sq", 231936),
])
def test_shared_memory_and_cost_inputs(name, smem):
    inst = next(i for i in fam.SPACE if i.name == name)
    assert inst.smem_bytes == smem and inst.threads == 384
    cost = inst.cost_inputs  # a CTA's rows are block_n keys, its columns block_m queries a step
    assert (cost.block_m, cost.block_n, cost.stages, cost.threads, cost.smem_bytes) == (
        inst.block_n, inst.block_m, 2, 384, smem)


def problem(**kw) -> BwdProblem:
    return BwdProblem(**{"dtype": "bf16", "head_dim": 64, "causal": False, "device": H100, "batch_heads": 32,
                         "seqlen_q": 1024, "seqlen_k": 1024, **kw})


CAUSAL_64 = FmhaBwdSm90Instance(DType.BF16, 64, Mask.CAUSAL, 64, 128)


@pytest.mark.parametrize("kw, reason", [
    (dict(), None),
    (dict(causal=True), None),
    (dict(causal=True, seqlen_q=1000, seqlen_k=77), None),  # partial tiles, Nq > Nk: masked
    (dict(causal=True, seqlen_q=77, seqlen_k=1000), None),  # key tiles past every query: zero dK, dV
    (dict(seqlen_q=1, seqlen_k=3), None),
    (dict(zero_scale=True), None),
    (dict(dropout=True), "no dropout"),
    (dict(bias=True), "no additive mask"),
    (dict(varlen=True), "split-dQ instances"),  # example 88's loop: fixed lengths only
    (dict(bias_grad=True), "no dbias"),
    (dict(deterministic=True), "not deterministic"),  # example 88's loop; the split-dQ one takes turns
    (dict(negative_scale=True), "scales >= 0"),
    (dict(gqa=4), "heads_kv == heads"),
    (dict(align=8), "16-byte aligned"),
    (dict(causal=True, causal_alignment="bottom_right", seqlen_q=1000), "top-left only"),
    (dict(causal=True, causal_alignment="bottom_right"), None),  # Nq == Nk: both alignments agree
    (dict(causal_alignment="bottom_right", seqlen_q=1000), None),  # no mask: the alignment is moot
    (dict(max_offset=2**31), "int32"),
    (dict(batch_heads=2**16, seqlen_q=2**10), "accumulator"),
    (dict(batch_heads=1, seqlen_q=1, seqlen_k=65535 * 128 + 1, causal=True), "key tiles"),  # grid y
    (dict(batch_heads=1, seqlen_q=1, seqlen_k=65535 * 128, causal=True), None),
    (dict(batch_heads=1, seqlen_q=1, seqlen_k=65535 * 128 + 1), None),  # no mask: key tiles in grid x
])
def test_problem_reason(kw, reason):
    got = fam.problem_reason(CAUSAL_64, problem(**kw))
    assert got is None if reason is None else reason in got


CAUSAL_64_SQ = dataclasses.replace(CAUSAL_64, split_dq=True)
LOCAL_64_SQ = dataclasses.replace(CAUSAL_64_SQ, mask=Mask.LOCAL)


@pytest.mark.parametrize("inst, kw", [
    # The split-dQ mainloop's band: causal in both alignments, sliding windows (launch parameters).
    (CAUSAL_64_SQ, dict(causal=True, causal_alignment="bottom_right", seqlen_q=1000)),
    (CAUSAL_64_SQ, dict(causal=True, causal_alignment="bottom_right", seqlen_q=1, seqlen_k=4097)),
    (CAUSAL_64_SQ, dict(causal=True, causal_alignment="bottom_right", seqlen_q=4097, seqlen_k=17)),
    (LOCAL_64_SQ, dict(window=(64, 64))),
    (LOCAL_64_SQ, dict(window=(0, 200), causal_alignment="bottom_right", seqlen_q=129, seqlen_k=4097)),
    (CAUSAL_64_SQ, dict(causal=True, deterministic=True)),  # dQ added in key-tile order
    (LOCAL_64_SQ, dict(window=(64, 0), deterministic=True)),
    # Packed sequences: one batch entry, each key masked to its own sequence's rows (band.h).
    (CAUSAL_64_SQ, dict(causal=True, varlen=True, seqlen_q=4097, seqlen_k=17)),
    (CAUSAL_64_SQ, dict(causal=True, causal_alignment="bottom_right", varlen=True)),
    (LOCAL_64_SQ, dict(window=(64, 0), varlen=True)),
])
def test_problem_reason_of_the_band(inst, kw):
    assert fam.problem_reason(inst, problem(**kw)) is None


def test_bias_on_bias_instances_only():
    """A call with an additive mask (no dbias) goes to `_bias` instances, which run nothing else, at
    fixed lengths, in both alignments, GQA and deterministic included."""
    bias_64 = dataclasses.replace(CAUSAL_64_SQ, bias=True)
    assert bias_64.name == "fmha_bwd_sm90_bf16_d64_causal_m64n128_sq_bias"
    assert "varlen" not in bias_64.params()  # no packed kernel: no mark
    for kw in (dict(causal=True), dict(causal=True, causal_alignment="bottom_right", seqlen_q=77),
               dict(causal=True, deterministic=True)):
        assert fam.problem_reason(bias_64, problem(bias=True, **kw)) is None
    assert "the problem has none" in fam.problem_reason(bias_64, problem(causal=True))
    assert "no additive mask" in fam.problem_reason(CAUSAL_64_SQ, problem(causal=True, bias=True))
    assert "fixed lengths only" in fam.problem_reason(bias_64, problem(causal=True, bias=True, varlen=True))
    assert "no dbias" in fam.problem_reason(bias_64, problem(causal=True, bias=True, bias_grad=True))
    for change, words in ((dict(softcap=True), "without a softcap"), (dict(mask=Mask.LOCAL), "window"),
                          (dict(split_dq=False), "split-dQ")):
        assert words in fam.invalid_reason(dataclasses.replace(bias_64, **change))


def test_dropout_on_dropout_instances_only():
    """A dropout call's backward goes to `_dropout` instances (the forward's mask drawn again), which
    run nothing else, at fixed lengths with fewer than 2^31 weights per head, deterministic
    included; built by default beside the default split-dQ tiles of d64 and d128."""
    drop_64 = dataclasses.replace(CAUSAL_64_SQ, dropout=True)
    assert drop_64.name == "fmha_bwd_sm90_bf16_d64_causal_m64n128_sq_dropout"
    assert "varlen" not in drop_64.params() and drop_64.params()["dropout"] is True
    for kw in (dict(causal=True), dict(causal=True, causal_alignment="bottom_right", seqlen_q=77),
               dict(causal=True, deterministic=True)):
        assert fam.problem_reason(drop_64, problem(dropout=True, **kw)) is None
    assert "the problem has none" in fam.problem_reason(drop_64, problem(causal=True))
    assert "`_dropout`" in fam.problem_reason(CAUSAL_64_SQ, problem(causal=True, dropout=True))
    assert "fixed lengths only" in fam.problem_reason(drop_64, problem(causal=True, dropout=True, varlen=True))
    assert "2^31" in fam.problem_reason(drop_64, problem(causal=True, dropout=True, seqlen_q=46341, seqlen_k=46341))
    for change in (dict(softcap=True), dict(mask=Mask.LOCAL), dict(split_dq=False), dict(bias=True)):
        assert "dropout runs on the split-dQ mainloop" in fam.invalid_reason(dataclasses.replace(drop_64, **change))
    built = {(i.dtype, i.head_dim, i.mask) for i in fam.DEFAULT if i.dropout}
    assert built == {(dt, d, m) for dt in fam.DTYPES for d in fam.DROPOUT_DEFAULT_HEAD_DIMS
                     for m in (Mask.NONE, Mask.CAUSAL)}
    assert all(dataclasses.replace(i, dropout=False) in fam.DEFAULT for i in fam.DEFAULT if i.dropout)


def test_packed_sequences_on_split_dq_instances_only():
    """The split-dQ instances carry the `varlen` and `deterministic_varlen` marks and run packed
    calls, deterministic ones too; example 88's loop runs none, and neither does a `_bias` one."""
    params = CAUSAL_64_SQ.params()
    assert params["varlen"] is True and params["deterministic_varlen"] is True
    assert "varlen" not in CAUSAL_64.params() and "deterministic_varlen" not in CAUSAL_64.params()
    assert fam.MARKED == ("varlen", "deterministic_varlen")
    for kw in (dict(causal=True), dict(causal=True, causal_alignment="bottom_right", seqlen_q=77), {},
               dict(window=(64, 0))):
        inst = LOCAL_64_SQ if "window" in kw else CAUSAL_64_SQ if kw else dataclasses.replace(CAUSAL_64_SQ, mask=Mask.NONE)
        assert fam.problem_reason(inst, problem(varlen=True, deterministic=True, **kw)) is None
    assert "split-dQ" in fam.problem_reason(CAUSAL_64, problem(causal=True, varlen=True, deterministic=True))


def test_builds_from_before_deterministic_packed_calls_are_kept_from_them(tmp_path, monkeypatch):
    """A split-dQ entry built before its kernel ran deterministic packed calls (params with the
    `varlen` mark, without `deterministic_varlen`) is refused them with a reason that says to
    rebuild, and still runs packed calls that are not deterministic and deterministic fixed-length
    ones."""
    from conftest import make_entry, write_build_dir
    from gemmgen.select import registry

    new = make_entry(CAUSAL_64_SQ)
    old = dataclasses.replace(new, params={k: v for k, v in new.params.items() if k != "deterministic_varlen"})
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(write_build_dir(tmp_path, [old])))
    registry.refresh()
    try:
        (cand,) = registry.load()[0]
        assert "built before its family ran deterministic calls over variable lengths" in registry.reject_reason(
            cand, problem(causal=True, varlen=True, deterministic=True))
        assert registry.reject_reason(cand, problem(causal=True, varlen=True)) is None
        assert registry.reject_reason(cand, problem(causal=True, deterministic=True)) is None
    finally:
        monkeypatch.delenv("GEMMGEN_BUILD_DIR")
        registry.refresh()


def test_registry_sends_a_window_to_local_instances_only():
    from gemmgen.select import registry

    windowed = problem(window=(64, 0))
    assert registry.functional_reason(fam, LOCAL_64_SQ, windowed) is None
    assert "mask causal" in registry.functional_reason(fam, CAUSAL_64_SQ, windowed)
    assert "mask local" in registry.functional_reason(fam, LOCAL_64_SQ, problem(causal=True))


def test_rendered_text():
    inst = next(i for i in fam.SPACE if i.name == "fmha_bwd_sm90_bf16_d128_causal_m64n128")
    tc = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")
    text = render.render_text(inst, tc)
    assert '#include "gemmgen/fmha_bwd_sm90/launch.h"' in text
    assert "Config<cutlass::bfloat16_t, /*BlockM=*/64, /*BlockN=*/128," in text
    assert "/*HeadDim=*/128,\n" in text and "/*Kind=*/gemmgen::fmha_bwd_sm90::BandKind::kCausal," in text
    assert "/*SplitDq=*/false,\n" in text and "/*Softcap=*/false," in text and "/*Bias=*/false,\n" in text
    assert "/*Dropout=*/false>;" in text
    split = next(i for i in fam.SPACE if i.name == "fmha_bwd_sm90_bf16_d128_causal_m64n128_sq")
    assert "/*SplitDq=*/true," in render.render_text(split, tc)
    capped = next(i for i in fam.SPACE if i.name == "fmha_bwd_sm90_bf16_d128_causal_m64n128_sq_sc")
    assert "/*Softcap=*/true," in render.render_text(capped, tc) and "softcap" not in split.params()
    biased = next(i for i in fam.SPACE if i.name == "fmha_bwd_sm90_bf16_d128_causal_m64n128_sq_bias")
    assert "/*Bias=*/true,\n" in render.render_text(biased, tc)
    assert "/*Dropout=*/true>;" in render.render_text(dataclasses.replace(split, dropout=True), tc)
    local = next(i for i in fam.SPACE if i.name == "fmha_bwd_sm90_bf16_d128_local_m64n128_sq")
    assert "BandKind::kLocal," in render.render_text(local, tc)
    sym = inst.symbol
    assert f"GEMMGEN_EXPORT int {sym}(const GemmgenAttnBwdParams* params, void* stream" in text
    assert f"GEMMGEN_EXPORT int64_t {sym}_workspace(const GemmgenAttnBwdParams* params)" in text
    assert f"GEMMGEN_EXPORT int {sym}_info(GemmgenInstanceInfo* info)" in text


# A real build: nvcc 13 with CUTLASS's headers, no GPU needed to load the library.

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_one_bwd(tmp_path_factory, fam.FAMILY, Arch.SM90, BUILD_ONE)


params = fake_bwd_params


def test_real_build_info(built):
    entry, kernel = built
    info = kernel.info()
    assert info.abi_version == abi.ABI_VERSION and info.flags & abi.INFO_BACKWARD
    assert not info.flags & abi.INFO_READS_GQA and not kernel.reads_gqa  # example 88's loop: expanded K, V
    assert (info.head_dim, info.block_m, info.block_n, info.causal, info.threads) == (32, 64, 128, 0, entry.threads)
    assert info.smem_bytes == entry.smem_bytes  # the family's figure is exact


def test_real_build_workspace(built):
    _, kernel = built
    # LSE copy and D: 2*3 rows of Nq rounded up to 8 floats, each part 256-byte aligned; then dQ in fp32.
    vec = -(-2 * 3 * 104 * 4 // 256) * 256
    assert kernel.workspace_bytes(params()) == 2 * vec + 2 * 3 * 100 * 32 * 4
    assert kernel.workspace_bytes(params(seqlen_q=1)) == 2 * 256 + 2 * 3 * 1 * 32 * 4
    assert kernel.workspace_bytes(params(head_dim=64)) == 0  # not this instance's: run() refuses it
    assert kernel.workspace_bytes(params(batch=0)) == 0


@pytest.mark.parametrize("kw, words", [
    (dict(head_dim=64), "head_dim 64, this instance runs 32"),
    (dict(seqlen_k=0), "bad sizes"),
    (dict(heads_kv=1), "heads_kv 1 != heads 3"),
    (dict(deterministic=1), "deterministic"),
    (dict(dropout_p=0.1), "this instance runs no dropout"),
    (dict(bias=0x1000), "this instance runs no additive mask"),
    (dict(dbias=0x1000), "this family runs no dbias"),
    (dict(cu_seqlens_q=0x1000), "variable lengths"),
    (dict(scale=-0.5), "scales >= 0"),
    (dict(scale=float("nan")), "scales >= 0"),
    (dict(q=0x10000008), "q: this family needs a 16-byte aligned pointer"),
    (dict(dv_row_stride=36), "dv: this family needs"),
    (dict(k_head_stride=100 * 32 + 4), "k: this family needs"),
    (dict(dk=0), "dk is NULL"),
    (dict(o_batch_stride=2**31 - 8), "o: element offsets pass int32"),
    (dict(batch=2**20, heads=2**12, heads_kv=2**12), "q: element offsets pass int32"),
    (dict(lse=0x10000002), "lse must be"),
    (dict(workspace=0x10000010), "workspace"),
    (dict(workspace_bytes=1024), "workspace"),
    (dict(local=1, window_left=8, window_right=8), "local is set: this instance runs no sliding window"),
    (dict(softcap=30.0), "this instance runs no logit softcap"),
])
def test_real_build_refuses(built, kw, words):
    """Every refusal comes before any CUDA call, so it runs without a GPU."""
    _, kernel = built
    with pytest.raises(GemmgenLaunchError, match="INVALID_ARGUMENT") as info:
        kernel.run(params(**kw), None)
    assert words in str(info.value)


def test_real_build_ignores_the_strides_of_single_dims(built):
    """A dim of extent 1 has no stride to align (it is taken as 0): such a call gets past every
    check, to the first CUDA call, which fails without a GPU (or runs with one)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the params point at no memory: only a machine without a GPU may get past the checks")
    _, kernel = built
    p = params(batch=1, q_batch_stride=3, heads=1, heads_kv=1, k_head_stride=5)
    try:
        kernel.run(p, None)
    except GemmgenLaunchError as exc:
        assert "INVALID_ARGUMENT" not in str(exc) and "CUDA_ERROR" in str(exc)
