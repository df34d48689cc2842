"""The ctypes structs match abi.h field for field (checked against the C++ compiler's layout)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from gemmgen.kernels import abi
from gemmgen.generator import render


def compiler_layout(tmp_path, struct: str, fields: list[str]) -> list[int]:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to check the layout against")
    body = " ".join(f'printf("%zu ", offsetof({struct}, {f}));' for f in fields)
    src = tmp_path / "layout.cc"
    src.write_text(f'#include <cstddef>\n#include <cstdio>\n#include "gemmgen/abi.h"\n'
                   f'int main() {{ {body} printf("%zu\\n", sizeof({struct})); }}\n')
    exe = tmp_path / "layout"
    subprocess.run([cxx, f"-I{render.include_dir()}", str(src), "-o", str(exe)], check=True)
    return [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]


@pytest.mark.parametrize("struct, mirror", [("GemmgenAttnParams", abi.AttnParams),
                                            ("GemmgenAttnBwdParams", abi.AttnBwdParams),
                                            ("GemmgenInstanceInfo", abi.InstanceInfo),
                                            ("GemmgenBatchedGemmStridedArgs", abi.BatchedGemmStridedArgs),
                                            ("GemmgenBatchedGemmPtrArgs", abi.BatchedGemmPtrArgs),
                                            ("GemmgenGemmInfo", abi.GemmInfo),
                                            ("GemmgenSoftmaxArgs", abi.SoftmaxArgs)])
def test_layout_matches_header(tmp_path, struct, mirror):
    fields = [name for name, _ in mirror._fields_]
    expected = compiler_layout(tmp_path, struct, fields)
    assert [getattr(mirror, f).offset for f in fields] + [ctypes.sizeof(mirror)] == expected


def test_abi_version_matches_header():
    header = (render.include_dir() / "gemmgen" / "abi.h").read_text()
    assert f"#define GEMMGEN_ABI_VERSION {abi.ABI_VERSION}" in header
