"""Kernels packages: prebuilt instance libraries installed as a Python wheel (`gemmgen package`
builds one), so that a machine without nvcc runs gemmgen's kernels.

A kernels package is a Python package that declares itself under the entry-point group
`gemmgen.kernels` (name: its arch and CUDA, value: its module). Its folder holds what a build
directory holds for one arch, <arch>/manifest.json and <arch>/lib/*.so, and PACKAGE_FILE, what it
was built for. The registry searches every installed package that matches this gemmgen (its
version, the C ABI, the CUDA major version of this torch), after the build directories; a package
that does not match is left out with the reason (`gemmgen list` shows it). Which GPUs a package's
code runs on is the manifest's gencode, checked per call like any build's.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from gemmgen.generator.manifest import KERNELS_ENTRY_POINT, KERNELS_PACKAGE_FILE, cuda_major

ENTRY_POINT_GROUP = KERNELS_ENTRY_POINT
PACKAGE_FILE = KERNELS_PACKAGE_FILE


@dataclasses.dataclass(frozen=True)
class KernelPackage:
    """One installed kernels package: its distribution, its folder, what it was built for, and why
    it is left out (None: the registry searches it)."""

    distribution: str
    folder: Path | None
    info: dict[str, Any]
    reason: str | None

    @property
    def label(self) -> str:
        return f"kernels package {self.distribution}" + (f" ({self.folder})" if self.folder else "")


def mismatch(info: dict[str, Any]) -> str | None:
    """Why a package built as `info` (its PACKAGE_FILE) cannot serve this gemmgen and torch; None
    when it can."""
    import torch

    from gemmgen import __version__
    from gemmgen.generator.manifest import ABI_VERSION

    if info.get("gemmgen_version") != __version__:
        return f"built for gemmgen {info.get('gemmgen_version')}, this is gemmgen {__version__}"
    if info.get("abi_version") != ABI_VERSION:
        return f"built for C ABI {info.get('abi_version')}, this gemmgen calls ABI {ABI_VERSION}"
    ours = cuda_major(torch.version.cuda)
    if ours is not None and cuda_major(str(info.get("cuda"))) != ours:
        return f"built with CUDA {info.get('cuda')}, this torch runs CUDA {torch.version.cuda}"
    return None


def _load(entry: importlib.metadata.EntryPoint) -> KernelPackage:
    distribution = entry.dist.name if entry.dist is not None else entry.name
    spec = importlib.util.find_spec(entry.value)
    if spec is None or not spec.submodule_search_locations:
        return KernelPackage(distribution, None, {}, f"its module {entry.value!r} is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    try:
        info = json.loads((folder / PACKAGE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return KernelPackage(distribution, folder, {}, f"unreadable {PACKAGE_FILE}: {exc}")
    return KernelPackage(distribution, folder, info, mismatch(info))


def installed() -> list[KernelPackage]:
    """Every installed kernels package, in the order of their names, with its verdict."""
    entries = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return [_load(e) for e in sorted(entries, key=lambda e: (e.name, e.value))]
