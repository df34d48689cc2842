"""The build driver: --no-compile without nvcc, failure isolation (fake nvcc), and a real nvcc build
of one fp16 and one bf16 instance that is then loaded with ctypes."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import filelock
import pytest
import torch

from conftest import ROOT, fake_nvcc, real_generate, run_cli
from gemmgen.kernels import abi
from gemmgen.generator import build, manifest
from gemmgen.select import device, registry, selection
from gemmgen.errors import GemmgenLaunchError

SMALL = "d32_none"  # the two smallest default instances: fp16 and bf16, head_dim 32, no mask
SMALL_NAMES = ["fa2_sm80_bf16_d32_none_m128n128w4s1", "fa2_sm80_fp16_d32_none_m128n128w4s1"]

# Stands in for nvcc: writes the depfile and an empty library, and fails every bf16 source.
FAKE_NVCC = fake_nvcc("""case "$src" in *bf16*) echo "$src(7): error: fake failure for the test" >&2; echo "second line" >&2; exit 1;; esac
echo "$target: $src" > "$dep"
: > "$out"
""")


def test_no_compile_without_nvcc(tmp_path):
    proc = run_cli("generate", "--arch", "sm80", "--no-compile", "--out", str(tmp_path),
                   env={"GEMMGEN_NVCC": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert "86 rendered, not compiled" in proc.stdout
    data = manifest.load(tmp_path / "sm80" / "manifest.json")
    assert len(data.instances) == 86 and {e.state for e in data.instances} == {"rendered"}
    assert data.nvcc_version == "unknown"
    assert len(list((tmp_path / "sm80" / "src").glob("*.cu"))) == 86
    assert (tmp_path / "sm80" / "build.ninja").is_file()


def test_failure_isolated_and_reported(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    args = ("generate", "--arch", "sm80", "--filter", SMALL, "--jobs", "2", "--out", str(out))
    proc = run_cli(*args, env={"GEMMGEN_NVCC": str(nvcc)})
    assert proc.returncode == 1
    assert "1 built, 1 failed, 0 up to date" in proc.stdout
    assert "FAILED fa2_sm80_bf16_d32_none_m128n128w4s1" in proc.stdout
    assert "fake failure for the test" in proc.stderr
    entries = {e.name: e for e in manifest.load(out / "sm80" / "manifest.json").instances}
    assert entries["fa2_sm80_fp16_d32_none_m128n128w4s1"].state == "built"
    failed = entries["fa2_sm80_bf16_d32_none_m128n128w4s1"]
    assert failed.state == "failed" and failed.error.splitlines() == [
        "src/fa2_sm80_bf16_d32_none_m128n128w4s1.cu(7): error: fake failure for the test", "second line"]
    assert not (out / "sm80" / "lib" / "fa2_sm80_bf16_d32_none_m128n128w4s1.so").exists()
    again = run_cli(*args, env={"GEMMGEN_NVCC": str(nvcc)})
    assert again.returncode == 1 and "0 built, 1 failed, 1 up to date" in again.stdout


def test_lock_serializes_generates(tmp_path):
    (tmp_path / "sm80").mkdir()
    lock = filelock.FileLock(str(tmp_path / "sm80" / ".lock"))
    with lock:
        proc = subprocess.Popen([sys.executable, "-m", "gemmgen", "generate", "--arch", "sm80", "--no-compile",
                                 "--filter", SMALL, "--out", str(tmp_path)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
        # The first line the child prints is the wait (it cannot render before it holds the lock);
        # reading it, however long the child takes to start, proves it waited.
        first = proc.stdout.readline()
        assert "waiting for another gemmgen generate" in first
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting for the lock
        assert not (tmp_path / "sm80" / "manifest.json").exists()
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert "rendered 2 instances" in stdout


def test_jobs_and_ninja_text():
    assert build.default_jobs() >= 1
    text = build.ninja_text([], nvcc="/opt/my cuda/nvcc", flags=("-O3",), include_dirs=[])
    assert "nvcc = '/opt/my cuda/nvcc'" in text
    assert "-MD -MF $out.d -MT $out -o $out.tmp $in && mv -f $out.tmp $out" in text
    assert "deps = gcc" in text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One real generate of the two small instances (1-3 minutes of nvcc on 2 cores)."""
    out = tmp_path_factory.mktemp("build")
    return out, real_generate(out, "--filter", SMALL)


def test_real_compile(compiled):
    out, proc = compiled
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 built, 0 failed, 0 up to date" in proc.stdout
    data = manifest.load(out / "sm80" / "manifest.json")
    assert sorted(e.name for e in data.instances) == SMALL_NAMES
    assert {e.state for e in data.instances} == {"built"} and data.nvcc_version != "unknown"
    assert sorted(p.name for p in (out / "sm80" / "lib").iterdir()) == [f"{n}.so" for n in SMALL_NAMES]


def test_noop_rebuild(compiled):
    out, _ = compiled
    lib = out / "sm80" / "lib" / f"{SMALL_NAMES[0]}.so"
    before = lib.stat().st_mtime_ns
    proc = run_cli("generate", "--arch", "sm80", "--filter", SMALL, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "2/2 instances up to date, nothing to compile" in proc.stdout
    assert "0 built, 0 failed, 2 up to date" in proc.stdout
    assert lib.stat().st_mtime_ns == before


def test_info_matches_manifest(compiled):
    out, _ = compiled
    for e in manifest.load(out / "sm80" / "manifest.json").instances:
        info = abi.bind(out / "sm80" / e.library, e.symbol).info().as_dict()
        assert info == {"abi_version": abi.ABI_VERSION, "head_dim": e.params["head_dim"],
                        "block_m": e.params["block_m"], "block_n": e.params["block_n"],
                        "threads": e.threads, "smem_bytes": e.smem_bytes,
                        "causal": int(e.params["mask"] == "causal"), "flags": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_launch_without_gpu_is_a_clean_error(compiled):
    out, _ = compiled
    kernel = abi.bind(out / "sm80" / "lib" / f"{SMALL_NAMES[1]}.so", f"gemmgen_{SMALL_NAMES[1]}")
    n, d = 17, 32
    strides = {f"{t}_{s}_stride": n * d if s != "row" else d for t in "qkvo" for s in ("batch", "head", "row")}
    params = abi.AttnParams(q=0x10000, k=0x20000, v=0x30000, o=0x40000, lse=None, batch=1, heads=1,
                            heads_kv=1, seqlen_q=n, seqlen_k=n, head_dim=d, scale=0.125, causal_offset=0,
                            **strides)
    with pytest.raises(GemmgenLaunchError) as info:
        kernel.run(params, None)
    message = str(info.value).lower()
    assert "cuda" in message or "driver" in message
    params.head_dim = 64
    with pytest.raises(GemmgenLaunchError, match="head_dim 64, this instance runs 32"):
        kernel.run(params, None)


def test_registry_binds_built_instance(compiled):
    out, _ = compiled
    registry.set_build_dirs([out])
    try:
        cand = selection.select(registry.Problem(dtype="bf16", head_dim=32, causal=False,
                                                device=device.synthetic((8, 6), 84), seqlen_q=100))
        assert cand.name == SMALL_NAMES[0]
        assert cand.kernel.info().head_dim == 32  # loaded, bound and ABI-checked without a GPU
    finally:
        registry.set_build_dirs(None)


def test_a_truncated_manifest_keeps_every_built_instance(tmp_path):
    """Two instances built, the manifest cut short, one of them generated again: the other, still
    on disk and current, stays in the manifest (and so in the registry); a library whose source
    changed since is not taken back."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(fake_nvcc('echo "$target: $src" > "$dep"\n: > "$out"\n'))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    env = {"GEMMGEN_NVCC": str(nvcc)}
    first = ("generate", "--arch", "sm80", "--filter", SMALL, "--out", str(out))
    assert run_cli(*first, env=env).returncode == 0
    path = out / "sm80" / "manifest.json"
    path.write_text(path.read_text()[:200])
    proc = run_cli("generate", "--arch", "sm80", "--filter", SMALL_NAMES[1], "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "was unreadable" in proc.stdout and "recovered 2 built instance(s)" in proc.stdout
    entries = {e.name: e for e in manifest.load(path).instances}
    assert sorted(entries) == SMALL_NAMES and {e.state for e in entries.values()} == {"built"}
    # A source that no longer renders the same (edited, or from another toolchain) is not recovered.
    src = out / "sm80" / "src" / f"{SMALL_NAMES[0]}.cu"
    src.write_text(src.read_text() + "// changed\n")
    path.write_text("{")
    proc = run_cli("generate", "--arch", "sm80", "--filter", SMALL_NAMES[1], "--out", str(out), env=env)
    assert proc.returncode == 0 and "recovered 1 built instance(s)" in proc.stdout, proc.stdout
    assert [e.name for e in manifest.load(path).instances] == [SMALL_NAMES[1]]
