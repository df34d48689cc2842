"""Render instances into .cu sources: one Jinja template per family, one file per instance."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import jinja2

from gemmgen import __version__
from gemmgen.arch import Arch
from gemmgen.generator.space import family_named


def templates_dir() -> Path:
    """Return the templates folder: the installed `gemmgen.templates` package, else the source tree's."""
    spec = importlib.util.find_spec("gemmgen.templates")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    # Running from a source checkout that is not installed: templates/ sits beside generator/.
    return Path(__file__).resolve().parent.parent / "templates"


def include_dir() -> Path:
    """Return the folder of the hand-written C++ headers (passed to nvcc as -I)."""
    return templates_dir() / "include"


@functools.lru_cache(maxsize=None)
def environment(folder: Path) -> jinja2.Environment:
    """A Jinja environment over `folder` that fails on any undefined template variable."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """What, besides the instance and its template, decides a compiled library's bits."""

    flags: tuple[str, ...]
    nvcc_version: str
    cutlass_version: str


def source_path(out: Path, arch: Arch, inst: Any) -> Path:
    """Where `inst`'s source goes: <out>/<arch>/src/<name>.cu."""
    return Path(out) / arch.value / "src" / f"{inst.name}.cu"


def template_path(inst: Any) -> Path:
    """`inst`'s family template: its TEMPLATE under the templates folder (TEMPLATE itself where it
    is absolute, for a family kept outside gemmgen)."""
    return templates_dir() / family_named(inst.family).TEMPLATE


def template_text(inst: Any) -> str:
    """The text of `inst`'s family template."""
    return template_path(inst).read_text()


@functools.lru_cache(maxsize=None)
def headers_hash(family: str) -> str:
    """Hash of the headers families share (abi.h, report.h, smem.h, sequence.h) and `family`'s own:
    include/gemmgen/<dir>/ for each dir of the family's HEADER_DIRS. A kernel change changes the key
    of every instance of its family, and of no other."""
    root = include_dir() / "gemmgen"
    dirs = family_named(family).HEADER_DIRS
    digest = hashlib.sha256()
    shared = [root / "abi.h", root / "report.h", root / "smem.h", root / "sequence.h"]
    for path in [*shared, *(p for d in dirs for p in sorted((root / d).rglob("*.h")))]:
        if path.is_file():
            digest.update(path.relative_to(include_dir()).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def content_hash(inst: Any, toolchain: Toolchain) -> str:
    """The build key of `inst`: its parameters, template and kernel-header text, flags, nvcc and
    CUTLASS versions."""
    parts = [inst.content_hash(), hashlib.sha256(template_text(inst).encode()).hexdigest(), headers_hash(inst.family),
             "\0".join(toolchain.flags), toolchain.nvcc_version, toolchain.cutlass_version]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def render_text(inst: Any, toolchain: Toolchain) -> str:
    """Render `inst`'s family template with the instance's values and the toolchain's."""
    path = template_path(inst)
    template = environment(path.parent).get_template(path.name)
    values = {**inst.template_values(), "gemmgen_version": __version__,
              "content_hash": content_hash(inst, toolchain),
              "nvcc_version": toolchain.nvcc_version, "cutlass_version": toolchain.cutlass_version}
    return template.render(**values)


def write_if_different(path: Path, text: str) -> bool:
    """Write `text` to `path` only if the file's text differs (so ninja sees no change); True if written.

    The new text goes to a temporary file renamed over the old one, so a reader never sees half a file.
    """
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def render_instance(inst: Any, *, out: Path, arch: Arch, toolchain: Toolchain) -> Path:
    """Render `inst` into <out>/<arch>/src/<name>.cu (rewritten only when its text changed)."""
    path = source_path(out, arch, inst)
    write_if_different(path, render_text(inst, toolchain))
    return path
