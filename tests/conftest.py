"""Shared test set-up: GPU tests skip cleanly (with the reason) where torch sees no CUDA GPU, each test
gets a private cache directory, and helpers that run the CLI and write synthetic build directories."""
from __future__ import annotations

import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_FAKE_NVCC_PROLOGUE = '''#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
while [ $# -gt 0 ]; do
  case "$1" in -o) out=$2; shift;; -MF) dep=$2; shift;; -MT) target=$2; shift;; *.cu) src=$1;; esac
  shift
done
'''


def fake_nvcc(body: str) -> str:
    """A shell script standing in for nvcc: answers --version, parses -o/-MF/-MT and the .cu source
    into $out, $dep, $target and $src, then runs `body`."""
    return _FAKE_NVCC_PROLOGUE + body


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run `python -m gemmgen ARGS` from the repository root; returns the finished process."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gemmgen", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def real_generate(out: Path, *args: str) -> subprocess.CompletedProcess:
    """`gemmgen generate --arch sm80 ARGS --jobs 2 --out OUT` with the real nvcc (skips the test
    when there is none); reports the compile time on stderr."""
    from gemmgen.errors import ToolchainError
    from gemmgen.generator import toolchain

    try:
        toolchain.find_nvcc()
    except ToolchainError as exc:
        pytest.skip(f"nvcc is missing: {exc}")
    start = time.monotonic()
    proc = run_cli("generate", "--arch", "sm80", *args, "--jobs", "2", "--out", str(out))
    print(f"\ncompiled {' '.join(args)} in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return proc


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own cache directory (tuning databases, on-demand builds) and no autotune."""
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("GEMMGEN_AUTOTUNE", raising=False)


GENCODE = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]


@pytest.fixture
def cpu_ops_library(monkeypatch: pytest.MonkeyPatch):
    """register(**impls) gives gemmgen's ops CPU implementations for one test (removed after); the
    backward's launch calls the stand-in kernel's run() directly and tensors report device 0, so
    the real Python path from autograd to the C ABI params runs without a GPU."""
    from gemmgen.kernels import launch

    monkeypatch.setattr(launch, "run_bwd", lambda kernel, p, index, workspace_bytes=None: kernel.run(p, None))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    lib = torch.library.Library("gemmgen", "IMPL")

    def register(**impls) -> None:
        for op, fn in impls.items():
            lib.impl(op, fn, "CPU")

    yield register
    lib._destroy()


def make_entry(inst, state: str = "built", error: str | None = None, content_hash: str | None = None):
    """A manifest entry for a family instance (content hash: the instance's own, unless given)."""
    from gemmgen.generator import manifest

    return manifest.InstanceEntry(name=inst.name, family=inst.family, params=inst.params(), arch="sm80",
                                  gencode=GENCODE, library=f"lib/{inst.name}.so", symbol=inst.symbol,
                                  smem_bytes=inst.smem_bytes, threads=inst.threads,
                                  content_hash=content_hash or inst.content_hash(), state=state, error=error)


def write_build_dir(root: Path, entries: list) -> Path:
    """A build directory <root>/sm80 holding `entries` (with empty library files); returns root."""
    from gemmgen.generator import manifest

    (root / "sm80" / "lib").mkdir(parents=True, exist_ok=True)
    for e in entries:
        (root / "sm80" / e.library).touch()
    manifest.write(root / "sm80" / "manifest.json", manifest.Manifest(
        gemmgen_version="0.1.0", arch="sm80", nvcc_version="13.0.88", cutlass_version="4.2.0",
        flags=[], instances=entries))
    return root


def fake_bwd_params(**kw):
    """GemmgenAttnBwdParams of a dense [2, 3, 100, 32] fp16 call (100 keys) at fake 256-byte aligned
    addresses, for the refusals a backward library makes before any CUDA call; `kw` overrides
    seqlen_q, seqlen_k, head_dim and any field."""
    from gemmgen.kernels import abi

    b, h, nq, nk, d = 2, 3, kw.pop("seqlen_q", 100), kw.pop("seqlen_k", 100), kw.pop("head_dim", 32)
    p = abi.AttnBwdParams()
    for i, name in enumerate(("q", "k", "v", "o", "d_o", "lse", "dq", "dk", "dv", "workspace")):
        setattr(p, name, 0x10000000 * (i + 1))
    p.workspace_bytes = 1 << 30
    p.batch, p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim = b, h, h, nq, nk, d
    for name in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
        n = nk if name in ("k", "v", "dk", "dv") else nq
        for dim, stride in zip(("batch", "head", "row"), (h * n * d, n * d, d)):
            setattr(p, f"{name}_{dim}_stride", stride)
    p.scale, p.causal_offset = 0.125, 2**31 - 1
    for key, value in kw.items():
        setattr(p, key, value)
    return p


def build_one_bwd(tmp_path_factory, family: str, arch, name: str):
    """Compile the one backward instance `name` of `family` for `arch` with nvcc (skipping the test
    where nvcc is missing) and bind its library: (manifest entry, abi kernel). No GPU is needed."""
    from gemmgen.errors import ToolchainError
    from gemmgen.generator import manifest, toolchain
    from gemmgen.kernels import abi

    try:
        toolchain.find_nvcc()
    except ToolchainError as exc:
        pytest.skip(f"nvcc is missing: {exc}")
    out = tmp_path_factory.mktemp(family)
    start = time.monotonic()
    proc = run_cli("generate", "--arch", arch.value, "--family", family, "--all", "--filter", f"^{name}$",
                   "--out", str(out), "--jobs", "1")
    print(f"\ncompiled {name} in {time.monotonic() - start:.0f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry = manifest.load(out / arch.value / "manifest.json").instances[0]
    assert entry.name == name and entry.state == "built" and entry.gencode == list(arch.gencode)
    return entry, abi.bind_bwd(out / arch.value / entry.library, entry.symbol)
