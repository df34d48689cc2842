"""The fa2_sm80 instance space and its validity predicate."""
from __future__ import annotations

import pytest

from gemmgen.generator import space
from gemmgen.arch import Arch, parse_arch
from gemmgen.generator.families import fa2_sm80 as fam
from gemmgen.generator.families.fa2_sm80 import DType, Fa2Sm80Instance, Mask


def test_space_nonempty_valid_unique():
    assert fam.SPACE
    assert all(fam.invalid_reason(inst) is None for inst in fam.SPACE)
    names = [inst.name for inst in fam.SPACE]
    assert len(names) == len(set(names))
    assert len({inst.symbol for inst in fam.SPACE}) == len(names)
    assert len({inst.content_hash() for inst in fam.SPACE}) == len(names)


def test_default_one_tile_per_functional_key():
    keys = [(i.dtype, i.head_dim, i.mask, i.softcap) for i in fam.DEFAULT]
    assert len(keys) == len(set(keys)) == len(fam.DTYPES) * len(fam.MASKS) * (
        len(fam.HEAD_DIMS) + len(fam.SOFTCAP_DEFAULT_HEAD_DIMS))
    assert {i.head_dim for i in fam.DEFAULT if i.softcap} == set(fam.SOFTCAP_DEFAULT_HEAD_DIMS)
    assert set(fam.DEFAULT) <= set(fam.SPACE)


def test_softcap_instances_keep_the_others_params():
    """softcap joined the family after its first builds: False is left out of params (the names,
    hashes and tuning records of those instances stay), True is named `_sc` and rendered."""
    plain = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4)
    capped = Fa2Sm80Instance(DType.BF16, 128, Mask.CAUSAL, 128, 64, 4, softcap=True)
    assert "softcap" not in plain.params() and capped.params()["softcap"] is True
    assert Fa2Sm80Instance.from_params(plain.params()) == plain
    assert Fa2Sm80Instance.from_params(capped.params()) == capped
    assert capped.name == plain.name + "_sc" and capped.content_hash() != plain.content_hash()
    from gemmgen.generator import render
    text = render.render_text(capped, render.Toolchain(flags=("-O3",), nvcc_version="13.0", cutlass_version="4.2.0"))
    assert "constexpr bool kSoftcap = true;" in text and "run<Traits, kCausal, kLocal, kSoftcap>(" in text


def test_pinned_names():
    inst = Fa2Sm80Instance(DType.FP16, 64, Mask.CAUSAL, 128, 128, 4)
    assert inst.name == "fa2_sm80_fp16_d64_causal_m128n128w4s1"
    assert inst.symbol == "gemmgen_fa2_sm80_fp16_d64_causal_m128n128w4s1"
    assert "fa2_sm80_bf16_d256_none_m128n64w8s1" in {i.name for i in fam.DEFAULT}


@pytest.mark.parametrize("inst, words", [
    (Fa2Sm80Instance(DType.FP16, 256, Mask.NONE, 128, 128, 8), "shared memory"),
    (Fa2Sm80Instance(DType.FP16, 256, Mask.NONE, 128, 64, 8, 2), "shared memory"),  # fits with 1 stage
    (Fa2Sm80Instance(DType.FP16, 64, Mask.NONE, 128, 64, 4, 3), "stages 3"),
    (Fa2Sm80Instance(DType.FP16, 64, Mask.NONE, 64, 64, 8), "16 rows x 8 warps"),
    (Fa2Sm80Instance(DType.BF16, 256, Mask.NONE, 128, 128, 4), "accumulators"),
    (Fa2Sm80Instance(DType.BF16, 80, Mask.NONE, 128, 64, 4), "head_dim 80"),
])
def test_predicate_rejects_with_reason(inst, words):
    reason = fam.invalid_reason(inst)
    assert reason is not None and words in reason
    assert inst not in fam.SPACE


def test_select_instances_and_head_dims():
    assert space.select_instances(Arch.SM80, families={fam.FAMILY}) == list(fam.DEFAULT)
    assert len(space.select_instances(Arch.SM80, all_instances=True, families={fam.FAMILY})) == len(fam.SPACE)
    chosen = space.select_instances(Arch.SM80, pattern="d32_none")
    assert sorted(i.name for i in chosen) == ["fa2_sm80_bf16_d32_none_m128n128w4s1",
                                              "fa2_sm80_fp16_d32_none_m128n128w4s1"]
    assert space.select_instances(Arch.SM80, pattern=r"fp16_d(64|128)_causal") != []
    assert space.select_instances(Arch.SM80, pattern="nothing-matches") == []
    assert set(fam.HEAD_DIMS) <= set(space.supported_head_dims())


def test_parse_arch():
    assert parse_arch(" SM80 ") is Arch.SM80
    with pytest.raises(ValueError, match="supported: sm80"):
        parse_arch("sm75")
