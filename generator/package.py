"""`gemmgen package`: a build directory's compiled instances of one arch as a kernels wheel.

The wheel (PEP 427) holds one Python package, gemmgen_kernels_<arch>_cu<CUDA major>, with
<arch>/manifest.json (the built entries only), <arch>/lib/*.so and the PACKAGE_FILE that says what it
was built for; it declares itself under the entry-point group gemmgen.kernels, where the runtime
finds it (gemmgen.kernels.packages). It is written directly (a zip with its .dist-info), so packaging
needs nothing beyond the standard library. It requires the gemmgen version that built it.
"""
from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
import json
import sysconfig
import zipfile
from pathlib import Path

from gemmgen import __version__
from gemmgen.arch import Arch
from gemmgen.errors import GemmgenError
from gemmgen.generator import manifest
from gemmgen.generator.manifest import KERNELS_ENTRY_POINT as ENTRY_POINT_GROUP
from gemmgen.generator.manifest import KERNELS_PACKAGE_FILE as PACKAGE_FILE
from gemmgen.generator.manifest import cuda_major


class PackageError(GemmgenError):
    """A build directory that cannot be packaged (nothing built, no CUDA version known)."""


@dataclasses.dataclass(frozen=True)
class Wheel:
    """A written kernels wheel: its path, distribution name and instance count."""

    path: Path
    distribution: str
    instances: int


def platform_tag() -> str:
    """This machine's wheel platform tag (linux_x86_64 for a linux-x86_64 Python)."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def write_wheel(build_dir: Path, arch: Arch, out_dir: Path, names: set[str] | None = None) -> Wheel:
    """Package the built instances of <build_dir>/<arch>/manifest.json (those in `names`, when given)
    as a wheel in `out_dir`."""
    source = build_dir / arch.value / manifest.MANIFEST_NAME
    data = manifest.load(source)  # raises ManifestError naming the file
    built = [e for e in data.instances if e.state == "built" and (source.parent / e.library).is_file()
             and (names is None or e.name in names)]
    if not built:
        raise PackageError(f"{source} lists no built instance with its library: nothing to package "
                           f"(run `gemmgen generate --arch {arch.value} --out {build_dir}`)")
    cuda = cuda_major(data.nvcc_version)
    if cuda is None:
        raise PackageError(f"{source} does not say which nvcc built it ({data.nvcc_version!r})")
    module = f"gemmgen_kernels_{arch.value}_cu{cuda}"
    distribution = module.replace("_", "-")
    dist_info = f"{module}-{__version__}.dist-info"
    files: dict[str, bytes] = {}
    for entry in built:
        files[f"{module}/{arch.value}/{entry.library}"] = (source.parent / entry.library).read_bytes()
    packaged = dataclasses.replace(data, instances=built)
    files[f"{module}/{arch.value}/{manifest.MANIFEST_NAME}"] = json.dumps(packaged.to_json(), indent=1).encode()
    info = {"arch": arch.value, "cuda": data.nvcc_version, "gemmgen_version": __version__,
            "abi_version": data.abi_version, "cutlass_version": data.cutlass_version, "instances": len(built)}
    files[f"{module}/{PACKAGE_FILE}"] = json.dumps(info, indent=1).encode()
    files[f"{module}/__init__.py"] = (
        f'"""gemmgen kernels for {arch.value}, built with nvcc {data.nvcc_version} by gemmgen {__version__}: '
        f'{len(built)} instances. gemmgen finds them when this package is installed."""\n').encode()
    tag = f"py3-none-{platform_tag()}"
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {__version__}\n"
        f"Summary: gemmgen's compiled kernels for {arch.value} (CUDA {cuda}), {len(built)} instances\n"
        f"Requires-Dist: gemmgen=={__version__}\n").encode()
    files[f"{dist_info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: gemmgen {__version__}\n"
                                   f"Root-Is-Purelib: false\nTag: {tag}\n").encode()
    files[f"{dist_info}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{arch.value}_cu{cuda} = {module}\n".encode()
    files[f"{dist_info}/top_level.txt"] = f"{module}\n".encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, blob in files.items():
        writer.writerow(_record_line(name, blob))
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{module}-{__version__}-{tag}.whl"
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, blob in files.items():
            zf.writestr(name, blob)
    tmp.replace(path)
    return Wheel(path, distribution, len(built))
