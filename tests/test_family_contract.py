"""The family contract (gemmgen.generator.families.base) without a GPU: every family keeps it, names
and content hashes stay pinned, the runtime rebuilds typed instances from manifests, the head dims
fused_attention accepts come from the families, and a family defined outside gemmgen goes through
registration, rendering, the manifest and the registry like the built-in ones."""
from __future__ import annotations

import dataclasses
import itertools
import json
import types
from pathlib import Path

import pytest
import torch

import gemmgen
from conftest import make_entry, write_build_dir
from gemmgen.arch import Arch
from gemmgen.errors import DeviceError, InputError
from gemmgen.generator import build, manifest, space
from gemmgen.generator.families import base, fa2_sm80, mea_sm80
from gemmgen.generator.families.base import AttentionInstance, CostInputs, DType, Mask
from gemmgen.select import device, registry, selection
from gemmgen.select.problem import Problem

# Taken from the instances as they were before the contract existed: a change here changes build
# keys and tuning-database keys.
PINNED = {
    "fa2_sm80": [("fa2_sm80_fp16_d32_none_m64n32w4s1", "1792762f0405ac7b"),
                 ("fa2_sm80_bf16_d32_none_m128n128w4s1", "fef1873edcdef54e"),
                 ("fa2_sm80_bf16_d256_causal_m128n64w8s1", "4383f169bff0bd4a"),
                 ("fa2_sm80_bf16_d128_causal_m128n64w4s1_sc", "1fe5e1b3646b7416")],
    "fmha_sm90": [("fmha_sm90_fp16_d32_none_tma_m64n64s4", "020906f25fcacb00"),
                  ("fmha_sm90_bf16_d64_none_pingpong_m256n64s5_lr_q2", "df8fe39c84647d3e"),
                  ("fmha_sm90_bf16_d256_causal_pingpong_m128n64s5_lr", "c3adbeb492e8db48"),
                  ("fmha_sm90_fp8_d128_none_pingpong_m128n128s5_lr", "9e2350bfe8b9e6ab")],
    "mea_sm80": [("mea_sm80_fp16_k64_q32k128_aligned", "363ebe8e53846213"),
                 ("mea_sm80_bf16_k64_q64k64_aligned", "c57ce76b17bd2661"),
                 ("mea_sm80_bf16_k256_q128k64_aligned", "2a57f5c78c2a743c")],
    "decode_sm80": [("decode_sm80_fp16_d64_m16n32w1x2s2", "afb187f82a6980f0"),
                    ("decode_sm80_bf16_d128_m16n64w1x4s2", "380550d1e17fe307"),
                    ("decode_sm80_bf16_d256_m64n64w4x1s2", "d199d5cf8272c78e")],
    "gemm_sm80": [("gemm_sm80_strided_fp16_fp16_nn_m64n64k32w4s2a1", "463c91b0810f89ad"),
                  ("gemm_sm80_strided_bf16_bf16_nn_m64n64k32w4s2a1", "d28b688c1a424741"),
                  ("gemm_sm80_ptr_bf16_f32_nt_m256n128k64w8s3a8", "e4682ec3100f366a")],
    "gemm_sm90": [("gemm_sm90_strided_fp16_fp16_nn_m64n64k64_pp_c1", "1d2cc4beb83ef17e"),
                  ("gemm_sm90_strided_fp16_fp16_nn_m128n64k64_coop_c1_e64_io_el", "063c9d0a8bafe219"),
                  ("gemm_sm90_strided_bf16_f32_nt_m256n128k64_coop_c1x2_e128_sk", "297b125fe1507f0d")],
    "softmax_sm80": [("softmax_sm80_fp16_t128", "da357e7a6b5fc4ed"),
                     ("softmax_sm80_bf16_t128", "0ccd6327a940d1fd"),
                     ("softmax_sm80_bf16_t256", "c403177b4c75d245")],
    "fmha_bwd_sm90": [("fmha_bwd_sm90_fp16_d32_none_m64n128", "62b5283a5dbf62b3"),
                      ("fmha_bwd_sm90_bf16_d64_causal_m128n128", "382dc339c482ffc4"),
                      ("fmha_bwd_sm90_bf16_d128_causal_m64n128", "c414a2ba7eca8bcd"),
                      ("fmha_bwd_sm90_bf16_d128_causal_m64n128_sq", "0884fabe84d564c0")],
    "fa2_bwd_sm80": [("fa2_bwd_sm80_fp16_d32_m128n128w8s1", "a041e31e07015d26"),
                     ("fa2_bwd_sm80_bf16_d128_m64n128w8s1", "0d16b9d8608d759f"),
                     ("fa2_bwd_sm80_bf16_d256_m64n64w8s1_sc", "5f5cbe1c012c5a1b")],
    "mea_bwd_sm80": [("mea_bwd_sm80_fp16_k64_q64k64_preload", "e13e1cafb7ac930c"),
                     ("mea_bwd_sm80_bf16_k128_q128k128_preload_dropout", "457025b1e68956e7"),
                     ("mea_bwd_sm80_bf16_k256_q128k64", "c4de8ed16290850b")],
}
SPACE_SIZES = {"fa2_sm80": 1104, "fmha_sm90": 1962, "mea_sm80": 36, "decode_sm80": 566, "gemm_sm80": 1312, "gemm_sm90": 2576,
               "softmax_sm80": 4, "fmha_bwd_sm90": 80, "fa2_bwd_sm80": 188,
               "mea_bwd_sm80": 72}


def test_every_family_keeps_the_contract():
    assert [f.FAMILY for f in space.FAMILIES] == list(PINNED)
    for family in space.FAMILIES:
        base.check_family(family)
        assert family.KIND in base.KINDS and isinstance(family.BUILT_BY_DEFAULT, bool)
        assert {type(i) for i in family.SPACE} == {family.INSTANCE} and set(family.DEFAULT) <= set(family.SPACE)


@pytest.mark.parametrize("family", list(PINNED))
def test_names_and_content_hashes_are_pinned(family):
    fam = space.family_named(family)
    assert len(fam.SPACE) == SPACE_SIZES[family]
    by_name = {i.name: i for i in fam.SPACE}
    for name, digest in PINNED[family]:
        inst = by_name[name]
        assert (inst.symbol, inst.content_hash()) == (f"gemmgen_{name}", digest)


@pytest.mark.parametrize("family", list(PINNED))
def test_from_params_rebuilds_every_instance(family):
    fam = space.family_named(family)
    for inst in fam.SPACE:
        params = json.loads(json.dumps(inst.params()))  # as a manifest holds them
        assert fam.INSTANCE.from_params(params) == inst


def test_from_params_refuses_params_that_describe_no_instance():
    params = fa2_sm80.DEFAULT[0].params()
    for bad, words in ((dict(params, dtype="fp4"), "dtype 'fp4'"), (dict(params, block_m="64"), "block_m '64'"),
                       ({k: v for k, v in params.items() if k != "warps"}, "lack 'warps'")):
        with pytest.raises(ValueError, match=words):
            fa2_sm80.INSTANCE.from_params(bad)
    # Fields with defaults may be absent (stages 1).
    assert fa2_sm80.INSTANCE.from_params({k: v for k, v in params.items() if k != "stages"}).stages == 1


def test_one_dtype_table():
    assert [(d.cpp, d.itemsize) for d in DType] == [("cutlass::half_t", 2), ("cutlass::bfloat16_t", 2), ("float", 4),
                                                    ("cutlass::float_e4m3_t", 1)]
    for family in space.FAMILIES:
        assert not hasattr(family, "DTYPE_CPP") and not hasattr(family, "DTYPE_BYTES")
        assert all(type(i.dtype) is DType for i in family.SPACE[:1])


def test_cost_inputs_name_the_tile_the_same_way():
    assert fa2_sm80.SPACE[0].cost_inputs == CostInputs(64, 32, 1, 128, 8192)
    two_stage = next(i for i in fa2_sm80.SPACE if i.stages == 2)
    assert two_stage.cost_inputs.stages == 2
    mea = mea_sm80.DEFAULT[0]
    assert mea.cost_inputs == CostInputs(mea.block_m, mea.block_n, 1, mea.threads, mea.smem_bytes)
    with pytest.raises(ValueError):
        CostInputs(0, 64, 1, 128, 0)


def test_a_module_that_breaks_the_contract_is_refused():
    partial = types.ModuleType("half_done")
    partial.FAMILY, partial.KIND, partial.TEMPLATE = "half_done", "attention", "half_done.cu.jinja"
    with pytest.raises(TypeError) as info:
        space.register(partial)
    for member in ("BUILT_BY_DEFAULT", "HEADER_DIRS", "ARCHS", "INSTANCE", "SPACE", "DEFAULT", "invalid_reason",
                   "problem_reason", "HEAD_DIMS", "RELATIVE_SPEED"):
        assert f"lacks {member}" in str(info.value)
    partial.KIND = "decode"
    with pytest.raises(TypeError, match="KIND 'decode' is not one of attention, attention_bwd, gemm, softmax"):
        space.register(partial)
    with pytest.raises(ValueError, match="'fa2_sm80' is registered already"):
        space.register(fa2_sm80)
    assert "half_done" not in [f.FAMILY for f in space.FAMILIES]


# The head-dim rule: fused_attention accepts what some attention family serves.

def test_supported_head_dims_are_the_union_of_the_families():
    dims = space.supported_head_dims()
    assert dims == tuple(sorted(set(fa2_sm80.HEAD_DIMS) | set(mea_sm80.HEAD_DIMS)))
    assert 80 in dims and 81 not in dims
    assert space.describe_head_dims(dims) == "a multiple of 8 up to 256"
    assert space.describe_head_dims((32, 64, 128)) == "one of 32, 64, 128"


def _qkv(d: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 2, 16, d, dtype=torch.float16) for _ in range(3))


def test_head_dims_1_to_256_pass_validation_and_others_do_not():
    for d in (80, 81, 1, 59, 256):  # past every argument check (head dims without tiles padded): CPU tensors
        with pytest.raises(DeviceError):
            gemmgen.fused_attention(*_qkv(d))
    for d in (257, 0):
        with pytest.raises(InputError, match=f"from 1 to 256 .*; got {d}, {d}, {d}"):
            gemmgen.fused_attention(*_qkv(d))
    with pytest.raises(InputError, match="got 80, 81, 80"):  # no padding where they differ
        q, k, v = _qkv(80)
        gemmgen.fused_attention(q, torch.randn(1, 2, 16, 81, dtype=torch.float16), v)


def _problem(**kw) -> Problem:
    return Problem(**{"dtype": "fp16", "head_dim": 80, "causal": False, "device": device.synthetic((8, 0), 108),
                      "batch_heads": 32, "seqlen_q": 512, "seqlen_k": 512, **kw})


def test_the_registry_sends_head_dim_80_to_mea(tmp_path):
    insts = [i for i in fa2_sm80.DEFAULT + mea_sm80.DEFAULT if i.dtype is DType.FP16]
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(i) for i in insts])])
    try:
        good, rejected = registry.candidates(_problem())
        assert good and all(c.entry.family == "mea_sm80" and c.instance.max_head_dim >= 80 for c in good)
        assert any("head_dim 64, the problem has 80" in reason for _, reason in rejected)
        assert any("above this instance's bound 64" in reason for _, reason in rejected)
        assert selection.select(_problem()).entry.family == "mea_sm80"
        assert registry.build_target(_problem())[1].name == "mea_sm80_fp16_k128_q32k128_aligned"
    finally:
        registry.set_build_dirs(None)


def test_candidate_instance_and_params_that_describe_none(tmp_path):
    good_inst = fa2_sm80.DEFAULT[0]
    broken = dataclasses.replace(make_entry(fa2_sm80.DEFAULT[1]), params={"dtype": "fp16", "head_dim": 32})
    registry.set_build_dirs([write_build_dir(tmp_path, [make_entry(good_inst), broken])])
    try:
        cands = {c.name: c for c in registry.load()[0]}
        assert cands[good_inst.name].instance == good_inst
        reasons = dict(registry.candidates(_problem(head_dim=32))[1])
        assert "its params describe no fa2_sm80 instance (fa2_sm80 params lack 'mask')" in \
            reasons[cands[broken.name].label]
    finally:
        registry.set_build_dirs(None)


# A family defined outside gemmgen, the way a user adds one.

TOY_TEMPLATE = """\
// Generated by gemmgen {{ gemmgen_version }} from toy_sm80.cu.jinja. Do not edit.
// instance {{ name }} (content hash {{ content_hash }})
#include "gemmgen/abi.h"

GEMMGEN_EXPORT int {{ symbol }}(const GemmgenAttnParams* params, void* stream, char* err, int err_len) {
  return toy::run<{{ element }}, /*HeadDim=*/{{ head_dim }}, /*BlockM=*/{{ block_m }}, {{ causal }}>(
      params, err, err_len);
}
"""


def toy_family(template: Path) -> types.ModuleType:
    """A module declaring the contract: an attention family serving head dim 512 only."""
    toy = types.ModuleType("toy_sm80")
    toy.FAMILY, toy.KIND, toy.BUILT_BY_DEFAULT = "toy_sm80", "attention", False
    toy.TEMPLATE, toy.HEADER_DIRS, toy.ARCHS = str(template), (), (Arch.SM80,)
    toy.RELATIVE_SPEED = 1.0
    toy.DTYPES, toy.HEAD_DIMS, toy.MASKS, toy.BLOCK_MS = (DType.FP16, DType.BF16), (512,), (Mask.NONE, Mask.CAUSAL), (64, 128, 256)

    @dataclasses.dataclass(frozen=True)
    class ToySm80Instance(AttentionInstance):
        dtype: DType
        head_dim: int
        mask: Mask
        block_m: int

        family = "toy_sm80"
        threads = 128

        @property
        def name(self) -> str:
            return f"toy_sm80_{self.dtype.value}_d{self.head_dim}_{self.mask.value}_m{self.block_m}"

        @property
        def smem_bytes(self) -> int:
            return self.block_m * self.head_dim * self.dtype.itemsize  # the Q tile

        @property
        def cost_inputs(self) -> CostInputs:
            return CostInputs(self.block_m, 64, 1, self.threads, self.smem_bytes)

        def template_values(self) -> dict:
            return {**super().template_values(), "causal": "true" if self.mask is Mask.CAUSAL else "false"}

    def invalid_reason(inst, arch=Arch.SM80):
        return f"shared memory {inst.smem_bytes} B" if inst.smem_bytes > arch.max_smem_bytes else None

    def problem_reason(inst, problem):
        return "toy_sm80 has no dropout" if problem.dropout else None

    toy.INSTANCE, toy.invalid_reason, toy.problem_reason = ToySm80Instance, invalid_reason, problem_reason
    toy.SPACE = tuple(inst for inst in itertools.starmap(
        ToySm80Instance, itertools.product(toy.DTYPES, toy.HEAD_DIMS, toy.MASKS, toy.BLOCK_MS))
        if invalid_reason(inst) is None)
    toy.DEFAULT = tuple(inst for inst in toy.SPACE if inst.block_m == 64)
    return toy


def test_a_family_from_outside_is_rendered_listed_and_selected(tmp_path):
    template = tmp_path / "toy_sm80.cu.jinja"
    template.write_text(TOY_TEMPLATE)
    toy = toy_family(template)
    assert [i.name for i in toy.SPACE] == [f"toy_sm80_{dt}_d512_{m}_m{bm}" for dt in ("fp16", "bf16")
                                          for m in ("none", "causal") for bm in (64, 128)]  # 256 rows do not fit
    out = tmp_path / "build"
    with space.registered(toy):
        assert space.family_named("toy_sm80") is toy and 512 in space.supported_head_dims()
        with pytest.raises(DeviceError):  # fused_attention accepts what the families serve
            gemmgen.fused_attention(*_qkv(512))
        chosen = space.select_instances(Arch.SM80, families={"toy_sm80"})
        assert chosen == list(toy.DEFAULT)
        result = build.generate(Arch.SM80, chosen, out=out, compile=False, log=lambda line: None)
        assert sorted(result.rendered) == sorted(i.name for i in toy.DEFAULT)
        text = (out / "sm80" / "src" / "toy_sm80_bf16_d512_causal_m64.cu").read_text()
        assert text.startswith("// Generated by gemmgen") and "Do not edit" in text
        assert "toy::run<cutlass::bfloat16_t, /*HeadDim=*/512, /*BlockM=*/64, true>" in text
        assert "GEMMGEN_EXPORT int gemmgen_toy_sm80_bf16_d512_causal_m64(" in text
        written = manifest.load(out / "sm80" / "manifest.json")
        assert {e.family for e in written.instances} == {"toy_sm80"}
        assert all(e.state == "rendered" and e.params["head_dim"] == 512 for e in written.instances)

        registry.set_build_dirs([out])
        try:
            _, rejected = registry.candidates(_problem(head_dim=512))
            reasons = dict(rejected)
            assert "rendered but not compiled" in reasons[f"toy_sm80_fp16_d512_none_m64 ({out / 'sm80'})"]
            assert reasons[f"toy_sm80_bf16_d512_none_m64 ({out / 'sm80'})"] == "dtype bf16, the problem is fp16"
            # A fake library stands in for nvcc's: the manifest says built, the file exists.
            for e in written.instances:
                e.state = "built"
                (out / "sm80" / e.library).touch()
            manifest.write(out / "sm80" / "manifest.json", written)
            registry.refresh()
            pick = selection.select(_problem(head_dim=512, causal=True))
            assert pick.name == "toy_sm80_fp16_d512_causal_m64"
            assert pick.instance == next(i for i in toy.DEFAULT if i.name == pick.name)
            good, rejected = registry.candidates(_problem(head_dim=512, dropout=True))
            assert good == [] and any("toy_sm80 has no dropout" in reason for _, reason in rejected)
        finally:
            registry.set_build_dirs(None)
    assert "toy_sm80" not in [f.FAMILY for f in space.FAMILIES] and 512 not in space.supported_head_dims()
    with pytest.raises(InputError, match="head_dim"):
        gemmgen.fused_attention(*_qkv(512))
