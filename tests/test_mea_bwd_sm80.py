"""The mea_bwd_sm80 family without a GPU: instance space and predicate, names, rendering,
problem_reason, the family contract, and one real nvcc compile loaded with ctypes (its _info, its
_workspace, and the argument checks its run entry point makes before touching the GPU)."""
from __future__ import annotations

import ctypes
import dataclasses
import types

import pytest

from conftest import real_generate
from gemmgen.arch import Arch
from gemmgen.errors import GemmgenLaunchError
from gemmgen.generator import manifest, render, space
from gemmgen.generator.families import base
from gemmgen.generator.families import mea_bwd_sm80 as fam
from gemmgen.generator.families.mea_bwd_sm80 import DType, MeaBwdSm80Instance
from gemmgen.kernels import abi
from gemmgen.select import device, registry
from gemmgen.select.problem import BwdProblem

SMALL = "mea_bwd_sm80_fp16_k64_q64k64_preload"
TC = render.Toolchain(flags=("-O3",), nvcc_version="13.0.88", cutlass_version="4.2.0")


def problem(**kw) -> BwdProblem:
    base_kw = dict(dtype="fp16", head_dim=64, causal=False, device=device.synthetic((8, 0), 108),
                   batch_heads=16, seqlen_q=512, seqlen_k=512)
    return BwdProblem(**{**base_kw, **kw})


def test_space_and_predicate():
    assert fam.KIND == "attention_bwd" and fam.BUILT_BY_DEFAULT and fam.ARCHS == (Arch.SM80,)
    assert len(fam.SPACE) == 72 and len(set(fam.SPACE)) == 72
    assert set(fam.DEFAULT) <= set(fam.SPACE) and len(fam.DEFAULT) == 6
    assert all(fam.invalid_reason(i) is None for i in fam.SPACE)
    assert {i.max_head_dim for i in fam.SPACE} == set(fam.MAX_HEAD_DIMS)
    assert {(i.dtype, i.dropout) for i in fam.SPACE} == {(d, p) for d in fam.DTYPES for p in (False, True)}
    assert all(i.smem_bytes <= Arch.SM80.max_smem_bytes for i in fam.SPACE)
    assert all(not i.preload or i.max_head_dim <= i.block_m for i in fam.SPACE)
    assert space.family_named("mea_bwd_sm80") is fam and fam in space.families_for(Arch.SM80)
    assert fam.HEAD_DIMS == tuple(range(8, 257, 8))
    # Built by default: `gemmgen generate --arch sm80` includes the DEFAULT set.
    chosen = space.select_instances(Arch.SM80)
    assert [i for i in chosen if i.family == fam.FAMILY] == list(fam.DEFAULT)
    assert {(i.dtype, i.max_head_dim) for i in fam.DEFAULT} == {(d, k) for d in fam.DTYPES for k in fam.MAX_HEAD_DIMS}
    assert not any(i.dropout for i in fam.DEFAULT)


def test_family_contract():
    base.check_family(fam)
    assert fam.INSTANCE is MeaBwdSm80Instance and issubclass(fam.INSTANCE, base.AttentionInstance)
    for inst in fam.SPACE:
        assert fam.INSTANCE.from_params(inst.params()) == inst
        assert inst.cost_inputs == base.CostInputs(inst.block_m, inst.block_n, 1, inst.threads, inst.smem_bytes)


@pytest.mark.parametrize("inst, words", [
    (MeaBwdSm80Instance(DType.FP16, 512, 64, 64, False, False), "max_head_dim 512"),
    (MeaBwdSm80Instance(DType.FP16, 64, 32, 64, False, False), "tile 32x64"),
    (MeaBwdSm80Instance(DType.FP16, 64, 64, 256, False, False), "tile 64x256"),
    (MeaBwdSm80Instance(DType.BF16, 256, 128, 64, True, False), "preload needs dK and dV in registers"),
    (MeaBwdSm80Instance(DType.BF16, 128, 64, 64, True, True), "above block_m 64"),
])
def test_predicate_rejects_with_reason(inst, words):
    reason = fam.invalid_reason(inst)
    assert reason is not None and words in reason
    assert inst not in fam.SPACE


def test_predicate_rejects_shared_memory_over_the_arch():
    inst = MeaBwdSm80Instance(DType.FP16, 128, 128, 128, True, True)
    assert inst.smem_bytes == 162304 + 16 and fam.invalid_reason(inst) is None  # fits sm80's 163 KB
    small = types.SimpleNamespace(value="sm86", max_smem_bytes=99 * 1024)
    assert "exceeds sm86's" in fam.invalid_reason(inst, small)


def test_names_unique_stable_and_hashed():
    names = [i.name for i in fam.SPACE]
    assert len(set(names)) == len(names) and all("bwd" in n and n.startswith("mea_bwd_sm80_") for n in names)
    inst = MeaBwdSm80Instance(DType.BF16, 128, 128, 128, True, True)
    assert inst.name == "mea_bwd_sm80_bf16_k128_q128k128_preload_dropout"
    assert inst.symbol == f"gemmgen_{inst.name}"
    assert MeaBwdSm80Instance(DType.FP16, 256, 128, 64, False, False).name == "mea_bwd_sm80_fp16_k256_q128k64"
    assert inst.content_hash() == MeaBwdSm80Instance(DType.BF16, 128, 128, 128, True, True).content_hash()
    assert inst.content_hash() != dataclasses.replace(inst, dropout=False).content_hash()
    params = inst.params()
    assert "head_dim" not in params and "mask" not in params
    assert params == {"dtype": "bf16", "max_head_dim": 128, "block_m": 128, "block_n": 128, "preload": True,
                      "dropout": True}
    assert inst.head_dim is None and inst.mask is None and inst.threads == 512


def test_render(tmp_path):
    inst = MeaBwdSm80Instance(DType.BF16, 256, 128, 64, False, True)
    path = render.render_instance(inst, out=tmp_path, arch=Arch.SM80, toolchain=TC)
    text = path.read_text()
    assert text.startswith("// Generated by gemmgen") and "Do not edit" in text
    assert "KernelTraits<cutlass::bfloat16_t, /*BlockI=*/128, /*BlockJ=*/64," in text
    assert "/*MaxHeadDim=*/256, /*Preload=*/false," in text and "/*Dropout=*/true>" in text
    assert f"GEMMGEN_EXPORT int {inst.symbol}(const GemmgenAttnBwdParams* params" in text
    assert f"GEMMGEN_EXPORT int64_t {inst.symbol}_workspace(const GemmgenAttnBwdParams* params)" in text
    assert f"GEMMGEN_EXPORT int {inst.symbol}_info(GemmgenInstanceInfo* info)" in text
    assert '#include "gemmgen/mea_bwd_sm80/launch.h"' in text
    # The kernel is included from the CUTLASS package, never copied into the tree.
    kernel = (render.include_dir() / "gemmgen" / "mea_bwd_sm80" / "kernel.h").read_text()
    assert '#include "41_fused_multi_head_attention/kernel_backward.h"' in kernel
    assert "struct AttentionBackwardKernel" not in kernel


K128 = MeaBwdSm80Instance(DType.FP16, 128, 128, 128, True, False)
K128_DROP = MeaBwdSm80Instance(DType.FP16, 128, 128, 128, True, True)


@pytest.mark.parametrize("inst, kw, words", [
    (K128, {"head_dim": 160}, "above this instance's bound 128"),
    (K128, {"head_dim": 36}, "multiple of 8"),
    (K128, {"align": 8}, "16-byte aligned"),
    (K128, {"gqa": 4}, "the caller expands them"),
    (K128, {"dropout": True}, "built without dropout"),
    (K128_DROP, {}, "built for dropout"),
    (K128_DROP, {"dropout": True, "seqlen_q": 65536, "seqlen_k": 65536}, "32-bit"),
    (K128, {"varlen": True, "causal": True, "causal_alignment": "bottom_right"}, "top-left only"),
    (K128, {"bias": True, "bias_grad": True, "seqlen_k": 97}, "seqlen_k a multiple of 8"),
    (K128, {"max_offset": 2**31}, "exceed int32"),
])
def test_problem_reason_rejects(inst, kw, words):
    reason = fam.problem_reason(inst, problem(**kw))
    assert reason is not None and words in reason


@pytest.mark.parametrize("inst, kw", [
    (K128, {}), (K128, {"head_dim": 128}), (K128, {"head_dim": 40}),
    (K128, {"causal": True}), (K128, {"causal": True, "causal_alignment": "bottom_right", "seqlen_q": 129}),
    (K128, {"bias": True, "bias_grad": True}), (K128, {"varlen": True, "causal": True}),
    (K128, {"deterministic": True}), (K128, {"negative_scale": True}), (K128, {"layout": "mixed"}),
    (K128_DROP, {"dropout": True, "causal": True}), (K128_DROP, {"dropout": True, "bias": True, "varlen": True}),
])
def test_problem_reason_accepts(inst, kw):
    assert fam.problem_reason(inst, problem(**kw)) is None
    assert registry.functional_reason(fam, inst, problem(**kw)) is None


def test_the_family_serves_what_its_instances_serve():
    served = {d for d in range(1, 300) if any(fam.problem_reason(i, problem(head_dim=d)) is None for i in fam.SPACE)}
    assert served == set(fam.HEAD_DIMS)


def test_registry_builds_the_preferred_tile_on_demand():
    """A backward problem on sm_80 that only this family runs (an additive mask, dropout; fa2_bwd_sm80
    takes the others) goes to it: the DEFAULT tile of the smallest bound that fits, the first dropout
    instance of SPACE for dropout, a smaller tile where shared memory is less."""
    arch, inst = registry.build_target(problem(head_dim=96, bias=True))
    assert arch is Arch.SM80 and inst.name == "mea_bwd_sm80_fp16_k128_q128k128_preload"
    arch, inst = registry.build_target(problem(dtype="bf16", head_dim=32, dropout=True))
    assert inst.name == "mea_bwd_sm80_bf16_k64_q64k64_preload_dropout"
    arch, inst = registry.build_target(problem(head_dim=128, bias=True, device=device.synthetic((8, 6), 84)))
    assert inst.family == fam.FAMILY and inst.max_head_dim >= 128 and inst.smem_bytes <= 99 * 1024
    # Forward problems never reach a backward family.
    from gemmgen.select.problem import Problem
    fwd = Problem(dtype="fp16", head_dim=64, causal=False, device=device.synthetic((8, 0), 108))
    assert registry.build_target(fwd)[1].family != fam.FAMILY


# ---- one real compile ----------------------------------------------------------------------------

D, B, H, NQ, NK = 64, 2, 3, 100, 72


def bwd_params(**kw) -> abi.AttnBwdParams:
    """Params of a [B, H, N, D] contiguous call with fake, 256-byte aligned device addresses (the
    checks and the workspace size read only the numbers)."""
    p = abi.AttnBwdParams()
    addr = 1 << 40
    for name in ("q", "k", "v", "o", "d_o", "lse", "dq", "dk", "dv"):
        setattr(p, name, addr)
        addr += 1 << 30
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = B, H, H, NQ, NK, D
    for name, n in (("q", NQ), ("k", NK), ("v", NK), ("o", NQ), ("do", NQ), ("dq", NQ), ("dk", NK), ("dv", NK)):
        setattr(p, f"{name}_batch_stride", H * n * D)
        setattr(p, f"{name}_head_stride", n * D)
        setattr(p, f"{name}_row_stride", D)
    p.scale, p.causal_offset, p.deterministic = 0.125, 2**31 - 1, 1
    for key, value in kw.items():
        setattr(p, key, value)
    return p


# Workspace of bwd_params() on the 64x64 instance (dK, dV in registers, one key split): per (batch,
# head) the dQ accumulators (2 query blocks x 1 column block x (16 + 64 * 64 * 4) bytes), then delta
# [B, H, NQ] and the LSE copy [B, H, 128] in float32, each part 256-byte aligned.
DQ_ACCUM = B * H * 2 * (16 + 64 * 64 * 4)
WORKSPACE = -(-DQ_ACCUM // 256) * 256 + -(-B * H * NQ * 4 // 256) * 256 + B * H * 128 * 4


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("bwd_build")
    proc = real_generate(out, "--family", "mea_bwd_sm80", "--filter", f"^{SMALL}$")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (entry,) = manifest.load(out / "sm80" / "manifest.json").instances
    return out / "sm80", entry


def test_real_compile_info_and_workspace(small_build):
    """One real nvcc build (sm_80 and sm_90 code), loaded with ctypes: the three entry points."""
    folder, entry = small_build
    assert entry.name == SMALL and entry.state == "built" and entry.family == "mea_bwd_sm80"
    assert entry.gencode == list(Arch.SM80.gencode)
    inst = fam.INSTANCE.from_params(entry.params)
    kernel = abi.bind_bwd(folder / entry.library, entry.symbol)
    info = kernel.info().as_dict()
    assert info == {"abi_version": abi.ABI_VERSION, "head_dim": 64, "block_m": 64, "block_n": 64,
                    "threads": inst.threads, "smem_bytes": inst.smem_bytes, "causal": 0, "flags": abi.INFO_BACKWARD}
    assert info["flags"] & abi.INFO_BACKWARD and entry.smem_bytes == inst.smem_bytes == 44288
    assert kernel.workspace_bytes(bwd_params()) == WORKSPACE
    # O whose rows the kernel cannot address with the gradients' stride goes through a packed copy.
    o_bnhd = bwd_params(o_batch_stride=NQ * H * D, o_head_stride=D, o_row_stride=3 * D)
    assert kernel.workspace_bytes(o_bnhd) == WORKSPACE + B * H * NQ * D * 2
    # Gradients with unlike row strides go through packed copies (dQ [NQ] and dK, dV [NK] rows).
    dq_bnhd = bwd_params(dq_batch_stride=NQ * H * D, dq_head_stride=D, dq_row_stride=H * D)
    assert kernel.workspace_bytes(dq_bnhd) == WORKSPACE + B * H * (NQ + 2 * NK) * D * 2
    # O and the gradients [B, N, H, D] alike: the kernel addresses them directly.
    bnhd = {f"{n}_{dim}": v for n, rows in (("o", NQ), ("dq", NQ), ("dk", NK), ("dv", NK))
            for dim, v in (("batch_stride", rows * H * D), ("head_stride", D), ("row_stride", H * D))}
    assert kernel.workspace_bytes(bwd_params(**bnhd)) == WORKSPACE
    # Params the instance rejects ask for no workspace: the run call says why.
    assert kernel.workspace_bytes(bwd_params(heads_kv=1)) == 0


@pytest.mark.parametrize("kw, words", [
    ({"heads_kv": 1}, "heads_kv 1 differs from heads 3"),
    ({"head_dim": 72}, "head_dim 72, this instance runs multiples of 8 up to 64"),
    ({"seqlen_k": 0}, "bad sizes"),
    ({"batch": -1}, "bad sizes"),
    ({"dropout_p": 0.1}, "built without dropout"),
    ({"q": (1 << 40) + 2}, "16-byte aligned"),
    ({"k_row_stride": 68}, "multiple of 8 elements"),
    ({"dq_head_stride": 0}, "overlap"),
    ({"dbias": 1 << 44, "dbias_batch_stride": 0, "dbias_head_stride": 0, "dbias_row_stride": NK},
     "broadcast (0) strides"),
    ({"dbias": 1 << 44, "seqlen_k": 70, "dbias_batch_stride": H * NQ * 72, "dbias_head_stride": NQ * 72,
      "dbias_row_stride": 72}, "seqlen_k must be a multiple of 8"),
    ({"causal_offset": 5}, "causal_offset 5 on 100 x 72"),
    ({"causal_offset": 3, "cu_seqlens_q": 1 << 45, "cu_seqlens_k": 1 << 46}, "variable lengths"),
    ({"cu_seqlens_q": 1 << 45}, "go together"),
    ({"q_row_stride": 2**30}, "exceeds int32"),
    ({"lse": 0}, "must be set"),
    ({}, "this call needs"),  # no workspace
    ({"workspace": 1 << 47, "workspace_bytes": 64}, "this call needs"),
    ({"workspace": (1 << 47) + 16, "workspace_bytes": 1 << 30}, "256-byte aligned"),
])
def test_run_rejects_before_touching_the_gpu(small_build, kw, words):
    folder, entry = small_build
    kernel = abi.bind_bwd(folder / entry.library, entry.symbol)
    with pytest.raises(GemmgenLaunchError, match="INVALID_ARGUMENT") as info:
        kernel.run(bwd_params(**kw), None)
    assert words in str(info.value)


@pytest.mark.parametrize("seqlen_q, offset", [(NQ, 0), (NQ, -50), (NQ, -200), (NQ, NK - NQ), (NQ, NK - 1),
                                              (NQ, 2**31 - 1), (50, NK - 50), (50, 10), (50, 0)])
def test_causal_offsets_the_kernel_runs_pass_the_checks(small_build, seqlen_q, offset):
    """Top-left, bottom-right, negative offsets, offsets between top-left and bottom-right and no mask
    pass every check (the call then stops at the missing workspace)."""
    folder, entry = small_build
    kernel = abi.bind_bwd(folder / entry.library, entry.symbol)
    with pytest.raises(GemmgenLaunchError, match="this call needs"):
        kernel.run(bwd_params(seqlen_q=seqlen_q, causal_offset=offset), None)


def test_null_params_and_info_pointer(small_build):
    folder, entry = small_build
    lib = ctypes.CDLL(str(folder / entry.library))
    run = getattr(lib, entry.symbol)
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    err = ctypes.create_string_buffer(256)
    assert run(None, None, err, 256) == 1 and b"params is NULL" in err.value
    ws = getattr(lib, f"{entry.symbol}_workspace")
    ws.argtypes, ws.restype = [ctypes.c_void_p], ctypes.c_int64
    assert ws(None) == 0
    info = getattr(lib, f"{entry.symbol}_info")
    info.argtypes = [ctypes.c_void_p]
    assert info(None) == 1
