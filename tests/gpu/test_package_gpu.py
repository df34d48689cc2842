"""A kernels wheel on the GPU: the build that serves a call is packaged (`gemmgen package --no-build`),
pip installs it into a fresh folder, and a fresh Python with no nvcc, no build folder and no
on-demand compiling runs fused_attention from it, against the float64 reference."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gemmgen
from conftest import ROOT, run_cli
from gemmgen.select import calls, selection

pytestmark = pytest.mark.gpu

CHECK = """
import torch, gemmgen
from gemmgen.ops.reference import attention_reference
from gemmgen.select import calls, selection
g = torch.Generator(device="cuda").manual_seed(7)
q, k, v = (torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
out = torch.full_like(q, float("nan"))
gemmgen.fused_attention(q, k, v, causal=True, out=out)
ref, _ = attention_reference(q, k, v, True, "top_left", None)
err = ((out.double() - ref).norm() / ref.norm()).item()
cand = selection.select(calls.problem_for(q, k, True, v=v))
print(cand.name, cand.build_dir, err)
"""


def test_fused_attention_runs_from_an_installed_wheel_without_nvcc(tmp_path):
    q = torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16)
    cand = selection.select(calls.problem_for(q, q, True, v=q))
    build, arch = cand.build_dir.parent, cand.build_dir.name
    proc = run_cli("package", "--arch", arch, "--no-build", "--build-dir", str(build), "-o", str(tmp_path / "dist"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    env = {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "GEMMGEN_NVCC": "/nonexistent", "GEMMGEN_JIT": "0", "GEMMGEN_BUILD_DIR": str(tmp_path / "no-build"),
           "GEMMGEN_CACHE_DIR": str(tmp_path / "cache")}
    ran = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    name, folder, err = ran.stdout.split()
    assert name == cand.name and Path(folder).is_relative_to(site), ran.stdout
    assert float(err) <= 1e-2, f"relative error {err}"
    assert gemmgen.__version__ in wheel.name
