"""Registry: candidates, reasons for each reject, the heuristic and the no-candidate message (CPU only)."""
from __future__ import annotations

import pytest

from gemmgen.generator import manifest
from gemmgen.select import registry, selection
from gemmgen.select.device import DeviceFacts
from gemmgen.errors import InputError, NoInstanceError
from gemmgen.generator.families import fa2_sm80 as fam
from gemmgen.generator.families.fa2_sm80 import DType, Fa2Sm80Instance, Mask

GENCODE = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


def entry(inst: Fa2Sm80Instance, state: str = "built", error: str | None = None) -> manifest.InstanceEntry:
    return manifest.InstanceEntry(name=inst.name, family=inst.family, params=inst.params(), arch="sm80",
                                  gencode=GENCODE, library=f"lib/{inst.name}.so", symbol=inst.symbol,
                                  smem_bytes=inst.smem_bytes, threads=inst.threads, content_hash="0" * 16,
                                  state=state, error=error)


@pytest.fixture
def build_dir(tmp_path):
    """A build dir with fp16 d64 none in two tiles, fp16 d64 causal failed, bf16 d64 none rendered."""
    insts = [Fa2Sm80Instance(DType.FP16, 64, Mask.NONE, 128, 128, 4),  # the DEFAULT tile
             Fa2Sm80Instance(DType.FP16, 64, Mask.NONE, 64, 64, 4)]
    entries = [entry(i) for i in insts]
    entries.append(entry(Fa2Sm80Instance(DType.FP16, 64, Mask.CAUSAL, 128, 128, 4), "failed",
                         "src/x.cu(12): error: something broke\nmore"))
    entries.append(entry(Fa2Sm80Instance(DType.BF16, 64, Mask.NONE, 128, 128, 4), "rendered"))
    (tmp_path / "sm80" / "lib").mkdir(parents=True)
    for e in entries:
        (tmp_path / "sm80" / e.library).touch()
    manifest.write(tmp_path / "sm80" / "manifest.json", manifest.Manifest(
        gemmgen_version="0.1.0", arch="sm80", nvcc_version="13.0.88", cutlass_version="4.2.0",
        flags=[], instances=entries))
    registry.set_build_dirs([tmp_path])
    yield tmp_path
    registry.set_build_dirs(None)


def problem(cc=(9, 0), smem_limit=227 * 1024, **kw) -> registry.Problem:
    device = DeviceFacts("test GPU", cc, sm_count=132, smem_per_block=smem_limit)
    return registry.Problem(**{"dtype": "fp16", "head_dim": 64, "causal": False, "device": device, **kw})


@pytest.mark.parametrize("cc, ok", [((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True),
                                    ((7, 5), False), ((10, 0), False), ((12, 0), False)])
def test_runs_on_sm_codes(cc, ok):
    assert registry.runs_on(GENCODE, cc) is ok


def test_runs_on_ptx_and_arch_specific():
    assert registry.runs_on(["-gencode=arch=compute_80,code=compute_80"], (12, 0))
    assert not registry.runs_on(["-gencode=arch=compute_80,code=compute_80"], (7, 5))
    assert registry.runs_on(["-gencode=arch=compute_90a,code=sm_90a"], (9, 0))
    assert not registry.runs_on(["-gencode=arch=compute_90a,code=sm_90a"], (10, 0))
    assert registry.runs_on(["-gencode arch=compute_80,code=[sm_80,compute_80]"], (10, 0))


def test_reasons_for_each_reject(build_dir):
    good, rejected = registry.candidates(problem(dtype="bf16"))
    reasons = dict((label.split()[0], reason) for label, reason in rejected)
    assert good == []
    assert "rendered but not compiled" in reasons["fa2_sm80_bf16_d64_none_m128n128w4s1"]
    assert "dtype fp16, the problem is bf16" in reasons["fa2_sm80_fp16_d64_none_m64n64w4s1"]
    _, rejected = registry.candidates(problem(causal=True))
    reasons = dict((label.split()[0], reason) for label, reason in rejected)
    assert "failed to build (src/x.cu(12): error: something broke)" in reasons[
        "fa2_sm80_fp16_d64_causal_m128n128w4s1"]
    assert "mask none, the problem needs causal" in reasons["fa2_sm80_fp16_d64_none_m128n128w4s1"]
    _, rejected = registry.candidates(problem(head_dim=128))
    assert any("head_dim 64, the problem has 128" in r for _, r in rejected)
    _, rejected = registry.candidates(problem(cc=(7, 5)))
    assert any("no code for this GPU's arch sm_75" in r for _, r in rejected)
    _, rejected = registry.candidates(problem(smem_limit=40000))
    assert any("needs 49152 B of shared memory, this GPU allows 40000 B" in r for _, r in rejected)


def test_missing_library(build_dir):
    (build_dir / "sm80" / "lib" / "fa2_sm80_fp16_d64_none_m64n64w4s1.so").unlink()
    _, rejected = registry.candidates(problem())
    assert any("is missing" in r for _, r in rejected)


def test_heuristic(build_dir):
    # Equal estimates (16 waves of 128 rows or 32 of 64), equally far from the default tile: the name.
    big = problem(batch_heads=512, seqlen_q=1024, seqlen_k=1024)
    assert selection.select(big).name == "fa2_sm80_fp16_d64_none_m128n128w4s1"
    assert selection.select(problem(seqlen_q=129)).name == "fa2_sm80_fp16_d64_none_m64n64w4s1"  # 192 < 256 rows
    assert selection.select(problem(seqlen_q=17)).name == "fa2_sm80_fp16_d64_none_m64n64w4s1"
    forced = selection.select(problem(seqlen_q=129), "fa2_sm80_fp16_d64_none_m128n128w4s1")
    assert forced.name == "fa2_sm80_fp16_d64_none_m128n128w4s1"
    assert selection.select(problem(seqlen_q=129)) is selection.select(problem(seqlen_q=129))  # cached


def test_no_candidate_message(build_dir):
    with pytest.raises(NoInstanceError) as info:
        selection.select(problem(causal=True))
    text = str(info.value)
    assert "No gemmgen instance can run fp16 head_dim=64 causal on sm_90" in text
    for name in ("fa2_sm80_fp16_d64_none_m128n128w4s1", "fa2_sm80_bf16_d64_none_m128n128w4s1",
                 "fa2_sm80_fp16_d64_causal_m128n128w4s1"):
        assert name in text
    default = next(i.name for i in fam.DEFAULT if (i.dtype.value, i.head_dim, i.causal) == ("fp16", 64, True))
    assert f"gemmgen generate --arch sm80 --out {build_dir} --filter {default}" in text
    with pytest.raises(NoInstanceError, match="No gemmgen family supports"):
        selection.select(problem(cc=(7, 5)))


def test_named_instance_errors(build_dir):
    with pytest.raises(InputError, match="no instance named 'nope'"):
        selection.select(problem(), "nope")
    with pytest.raises(NoInstanceError, match="dtype fp16, the problem is bf16"):
        selection.select(problem(dtype="bf16"), "fa2_sm80_fp16_d64_none_m64n64w4s1")


def test_build_dirs_from_env(monkeypatch, tmp_path):
    registry.set_build_dirs(None)
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", f"{tmp_path}/a:{tmp_path}/b")
    assert registry.build_dirs() == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.delenv("GEMMGEN_BUILD_DIR")
    assert [str(p) for p in registry.build_dirs()] == ["build"]


def test_empty_build_dir_message(tmp_path):
    registry.set_build_dirs([tmp_path])
    try:
        with pytest.raises(NoInstanceError, match="No built instances found in"):
            selection.select(problem())
    finally:
        registry.set_build_dirs(None)
