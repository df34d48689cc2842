"""The manifest: <out>/<arch>/manifest.json, the list of instances a build directory holds.

The registry reads manifests and never guesses from file names.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

from gemmgen.errors import ManifestError

SCHEMA = 1
# The C ABI the rendered libraries implement: GEMMGEN_ABI_VERSION of templates/include/gemmgen/abi.h
# (keep the two in step). The manifest records it; the runtime checks it before loading a library.
ABI_VERSION = 4
MANIFEST_NAME = "manifest.json"
# A kernels wheel (`gemmgen package`) declares itself under this entry-point group, and its package
# folder holds this file (what it was built for) beside <arch>/manifest.json.
KERNELS_ENTRY_POINT = "gemmgen.kernels"
KERNELS_PACKAGE_FILE = "gemmgen_kernels.json"


def cuda_major(version: str | None) -> str | None:
    """'13' of '13.0' or '13.0.88'; None for None or 'unknown'."""
    if not version or not version[0].isdigit():
        return None
    return version.split(".")[0]
STATES = ("built", "failed", "rendered")


@dataclasses.dataclass
class InstanceEntry:
    """One instance of a build directory and what happened to it."""

    name: str
    family: str
    params: dict[str, Any]
    arch: str
    gencode: list[str]
    library: str  # relative to the manifest's folder
    symbol: str
    smem_bytes: int
    threads: int
    content_hash: str
    state: str
    error: str | None = None


@dataclasses.dataclass
class Manifest:
    """The whole manifest of one <out>/<arch> build directory."""

    gemmgen_version: str
    arch: str
    nvcc_version: str
    cutlass_version: str
    flags: list[str]
    instances: list[InstanceEntry]
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    schema: int = SCHEMA
    abi_version: int = ABI_VERSION
    # Entries of the file left out on load because they do not fit the schema (not written back).
    dropped: list[str] = dataclasses.field(default_factory=list, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The manifest as plain JSON values, top-level keys in schema order."""
        data = dataclasses.asdict(self)
        order = ["schema", "gemmgen_version", "arch", "abi_version", "nvcc_version", "cutlass_version",
                 "flags", "created", "instances"]  # not `dropped`
        return {key: data[key] for key in order}


# Expected JSON types, checked on load so a bad file fails here and not in the registry.
_TOP_FIELDS = {"schema": int, "gemmgen_version": str, "arch": str, "abi_version": int,
               "nvcc_version": str, "cutlass_version": str, "flags": list, "created": str,
               "instances": list}
_ENTRY_FIELDS = {"name": str, "family": str, "params": dict, "arch": str, "gencode": list,
                 "library": str, "symbol": str, "smem_bytes": int, "threads": int,
                 "content_hash": str, "state": str, "error": (str, type(None))}


def _check_fields(data: Any, fields: dict[str, Any], where: str, path: Path) -> None:
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: {where} is not a JSON object")
    for key, kind in fields.items():
        if key not in data:
            raise ManifestError(f"{path}: {where} lacks the field {key!r}")
        if not isinstance(data[key], kind) or (kind is int and isinstance(data[key], bool)):
            raise ManifestError(f"{path}: {where} field {key!r} has the wrong type "
                                f"({type(data[key]).__name__})")


def from_json(data: Any, path: Path) -> Manifest:
    """Validate parsed JSON against the schema and return the Manifest; raise ManifestError if invalid."""
    _check_fields(data, _TOP_FIELDS, "the manifest", path)
    if data["schema"] != SCHEMA:
        raise ManifestError(f"{path}: schema {data['schema']}, this gemmgen reads schema {SCHEMA}; "
                            f"regenerate it with `gemmgen generate`")
    if data["abi_version"] != ABI_VERSION:
        raise ManifestError(f"{path}: ABI version {data['abi_version']}, this gemmgen calls ABI "
                            f"{ABI_VERSION}; regenerate it with `gemmgen generate`")
    entries, dropped = [], []
    for i, raw in enumerate(data["instances"]):
        try:
            entries.append(_entry(raw, i, path))
        except ManifestError as exc:
            dropped.append(str(exc).removeprefix(f"{path}: "))
    top = {key: data[key] for key in _TOP_FIELDS if key != "instances"}
    return Manifest(**top, instances=entries, dropped=dropped)


_NAME = re.compile(r"[A-Za-z0-9_]+")


def _entry(raw: Any, i: int, path: Path) -> InstanceEntry:
    """One instance entry checked against the schema: field types, a known state, a name and symbol
    of identifier characters, a library inside the build folder (lib/<name>.so), sizes in range."""
    _check_fields(raw, _ENTRY_FIELDS, f"instance #{i}", path)
    name = raw["name"]
    problems = []
    if raw["state"] not in STATES:
        problems.append(f"state {raw['state']!r}, expected one of {STATES}")
    if not _NAME.fullmatch(name) or not _NAME.fullmatch(raw["symbol"]):
        problems.append("a name or symbol that is not an identifier")
    if raw["library"] != f"lib/{name}.so":
        problems.append(f"library {raw['library']!r}, expected 'lib/{name}.so'")
    if raw["smem_bytes"] < 0 or raw["threads"] <= 0:
        problems.append(f"smem_bytes {raw['smem_bytes']} / threads {raw['threads']} out of range")
    if not all(isinstance(g, str) for g in raw["gencode"]):
        problems.append("gencode flags that are not strings")
    if not all(isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool, list)))
               for k, v in raw["params"].items()):
        problems.append("params that are not plain values")
    if problems:
        raise ManifestError(f"{path}: instance #{i} {name!r} has {'; '.join(problems)}")
    return InstanceEntry(**{key: raw[key] for key in _ENTRY_FIELDS})


def load(path: Path) -> Manifest:
    """Read and validate a manifest.json; raise ManifestError naming the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest; run `gemmgen generate`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not a readable JSON manifest ({exc})") from exc
    return from_json(data, path)


def write(path: Path, manifest: Manifest) -> None:
    """Write the manifest atomically: a temporary file in the same folder, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(tmp, path)
