"""Kernels wheels without a GPU: `gemmgen package` with a stand-in nvcc writes a valid wheel, pip
installs it into a fresh folder, a fresh Python finds its instances with no build folder, and a
package built for another gemmgen, ABI or CUDA is left out with its reason. tests/gpu runs kernels
from a wheel."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, fake_nvcc, run_cli
from gemmgen import __version__
from gemmgen.generator import manifest
from gemmgen.kernels import packages

SMALL = "d32_none"  # two default instances: fp16 and bf16, head_dim 32, no mask
NAMES = {"fa2_sm80_bf16_d32_none_m128n128w4s1", "fa2_sm80_fp16_d32_none_m128n128w4s1"}
# Stands in for nvcc: writes the depfile and a library holding the source's name.
FAKE_NVCC = fake_nvcc("""echo "$target: $src" > "$dep"
echo "$src" > "$out"
""")
MODULE = "gemmgen_kernels_sm80_cu13"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("package")
    nvcc = root / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    env = {"GEMMGEN_NVCC": str(nvcc), "GEMMGEN_CACHE_DIR": str(root / "cache")}
    proc = run_cli("package", "--arch", "sm80", "--filter", SMALL, "--jobs", "2", "--build-dir", str(root / "build"),
                   "-o", str(root / "dist"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 built, 0 failed" in proc.stdout and "(2 instances" in proc.stdout
    (path,) = (root / "dist").glob("*.whl")
    return path


def test_the_wheel_is_well_formed(wheel):
    assert wheel.name == f"{MODULE}-{__version__}-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist = f"{MODULE}-{__version__}.dist-info"
        record = list(csv.reader(io.StringIO(zf.read(f"{dist}/RECORD").decode())))
        for name, digest, size in record:  # every file hashed, the RECORD itself not
            if name == f"{dist}/RECORD":
                assert digest == size == ""
                continue
            blob = zf.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(blob)
        assert {r[0] for r in record} == names
        assert "Requires-Dist: gemmgen==" + __version__ in zf.read(f"{dist}/METADATA").decode()
        assert zf.read(f"{dist}/entry_points.txt").decode() == f"[gemmgen.kernels]\nsm80_cu13 = {MODULE}\n"
        info = json.loads(zf.read(f"{MODULE}/{packages.PACKAGE_FILE}"))
        assert info == {"arch": "sm80", "cuda": "13.0.88", "gemmgen_version": __version__,
                        "abi_version": manifest.ABI_VERSION, "cutlass_version": info["cutlass_version"],
                        "instances": 2}
        data = json.loads(zf.read(f"{MODULE}/sm80/manifest.json"))
        assert {e["name"] for e in data["instances"]} == NAMES
        for e in data["instances"]:
            assert e["state"] == "built" and zf.read(f"{MODULE}/sm80/{e['library']}").decode().strip().endswith(
                f"{e['name']}.cu")


def _install(wheel: Path, target: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _fresh_python(code: str, site: Path, tmp: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh Python that sees `site` and gemmgen, with no build folder of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "GEMMGEN_BUILD_DIR": str(tmp / "no-build-here"), "GEMMGEN_CACHE_DIR": str(tmp / "cache")}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True)


def test_installed_wheel_is_found_without_a_build_folder(wheel, tmp_path):
    site = tmp_path / "site"
    _install(wheel, site)
    proc = _fresh_python(
        "from gemmgen.select import registry\n"
        "found, errors = registry.load()\n"
        "print(sorted((c.name, c.build_dir.parent.name, c.library.is_file()) for c in found), errors)\n", site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted((n, MODULE, True) for n in NAMES)) + " []"
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "GEMMGEN_BUILD_DIR": str(tmp_path / "none")}
    listed = run_cli("list", env=env)
    assert listed.returncode == 0 and f"{site / MODULE}  sm80  2" in listed.stdout, listed.stdout + listed.stderr


def test_a_package_for_another_gemmgen_is_left_out_with_its_reason(wheel, tmp_path):
    site = tmp_path / "site"
    _install(wheel, site)
    info_path = site / MODULE / packages.PACKAGE_FILE
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "gemmgen_version": "0.0.1"}))
    proc = _fresh_python(
        "from gemmgen.select import registry\n"
        "found, errors = registry.load()\n"
        "print(len(found)); print(errors)\n", site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    count, errors = proc.stdout.splitlines()
    assert count == "0"
    assert f"kernels package {MODULE.replace('_', '-')}" in errors
    assert f"left out: built for gemmgen 0.0.1, this is gemmgen {__version__}" in errors
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "GEMMGEN_BUILD_DIR": str(tmp_path / "none")}
    listed = run_cli("list", env=env)
    assert "left out: built for gemmgen 0.0.1" in listed.stdout, listed.stdout + listed.stderr


def test_mismatch_names_version_abi_and_cuda(monkeypatch):
    import torch

    good = {"gemmgen_version": __version__, "abi_version": manifest.ABI_VERSION, "cuda": "13.0.88"}
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert packages.mismatch(good) is None
    assert "C ABI 3" in packages.mismatch({**good, "abi_version": 3})
    assert packages.mismatch({**good, "cuda": "12.8.61"}) == "built with CUDA 12.8.61, this torch runs CUDA 13.0"
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU torch: no CUDA to compare
    assert packages.mismatch({**good, "cuda": "12.8.61"}) is None


def test_nothing_built_is_not_packaged(tmp_path):
    out = tmp_path / "build"
    proc = run_cli("generate", "--arch", "sm80", "--no-compile", "--filter", SMALL, "--out", str(out),
                   env={"GEMMGEN_NVCC": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("package", "--arch", "sm80", "--no-build", "--build-dir", str(out), "-o", str(tmp_path / "dist"))
    assert proc.returncode == 1 and "lists no built instance" in proc.stderr
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())
