"""Locate the tools a build needs: nvcc and the CUTLASS headers, with their versions."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from gemmgen.errors import ToolchainError

DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")


def find_nvcc() -> Path:
    """Return nvcc's path: $GEMMGEN_NVCC if set, else the one on PATH, else /usr/local/cuda/bin/nvcc."""
    override = os.environ.get("GEMMGEN_NVCC")
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ToolchainError(f"GEMMGEN_NVCC={override} is not an executable file")
        return path
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    if DEFAULT_NVCC.is_file():
        return DEFAULT_NVCC
    raise ToolchainError("nvcc not found (looked at $GEMMGEN_NVCC, PATH and /usr/local/cuda/bin/nvcc); "
                         "install the CUDA toolkit or set GEMMGEN_NVCC")


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: Path) -> str:
    """Return nvcc's full version, e.g. "13.0.88", from `nvcc --version`."""
    try:
        text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                              check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"cannot run {nvcc} --version: {exc}") from exc
    match = re.search(r"V(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    if match is None:
        raise ToolchainError(f"cannot read a version from `{nvcc} --version`:\n{text}")
    return match.group(1)


def cutlass_root() -> Path:
    """Return the CUTLASS source root: $CUTLASS_PATH if set, else the nvidia-cutlass package's copy.

    The package is found without importing it: importing cutlass_library loads its generator.
    """
    override = os.environ.get("CUTLASS_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError("CUTLASS headers not found: install nvidia-cutlass (pip) "
                             "or set CUTLASS_PATH to a CUTLASS checkout")
    return Path(list(spec.submodule_search_locations)[0]) / "source"


def cutlass_include_dirs() -> list[Path]:
    """Return [<root>/include, <root>/tools/util/include, <root>/examples]; raise ToolchainError when
    the headers are missing. The families built on CUTLASS's own attention kernels include them
    from the examples folder (e.g. "88_hopper_fmha/kernel/fmha_kernel_builder.hpp")."""
    root = cutlass_root()
    dirs = [root / "include", root / "tools" / "util" / "include", root / "examples"]
    origin = "CUTLASS_PATH" if os.environ.get("CUTLASS_PATH") else "the nvidia-cutlass package"
    if not (dirs[0] / "cutlass" / "version.h").is_file() or not (dirs[0] / "cute").is_dir():
        raise ToolchainError(f"CUTLASS headers not found under {root} (from {origin}): "
                             f"expected include/cutlass/version.h and include/cute/")
    return dirs


def cutlass_version() -> str:
    """Return the CUTLASS version, e.g. "4.2.0", from the CUTLASS_MAJOR/MINOR/PATCH macros."""
    header = cutlass_include_dirs()[0] / "cutlass" / "version.h"
    text = header.read_text()
    parts = []
    for macro in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"):
        match = re.search(rf"#define\s+{macro}\s+(\d+)", text)
        if match is None:
            raise ToolchainError(f"{header} does not define {macro}")
        parts.append(match.group(1))
    return ".".join(parts)


def find_ninja() -> Path:
    """Return the ninja binary of the pip `ninja` package, else the one on PATH."""
    try:
        import ninja  # the pip package ships its binary in BIN_DIR

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    found = shutil.which("ninja")
    if found is None:
        raise ToolchainError("ninja not found: pip install ninja")
    return Path(found)
