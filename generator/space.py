"""The registry of kernel families and the instance selection `gemmgen generate` builds.

A family is a module that declares the members of the family contract
(gemmgen.generator.families.base: `Family`, and `AttentionFamily` or `GemmFamily` by its KIND).
FAMILIES holds the built-in families and those added with `register` (or `registered`, for a
while): the one registration point, which checks the contract, so code that reads a family reads
its members directly. Adding a family to gemmgen means adding its module to BUILTIN.
"""
from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any

from gemmgen.arch import Arch
from gemmgen.generator.families import (decode_sm80, fa2_bwd_sm80, fa2_sm80, fmha_bwd_sm90, fmha_sm90, gemm_sm80,
                                         gemm_sm90, mea_bwd_sm80, mea_sm80, softmax_sm80)
from gemmgen.generator.families.base import Family, check_family

# Attention families first, in the order build_target tries them for a missing instance.
BUILTIN: tuple[Family, ...] = (fa2_sm80, fmha_sm90, mea_sm80, decode_sm80, gemm_sm80, gemm_sm90, softmax_sm80,
                               fmha_bwd_sm90, fa2_bwd_sm80, mea_bwd_sm80)


class FamilyList(Sequence):
    """The registered families, in registration order (read-only: `register` adds one)."""

    def __init__(self) -> None:
        self._families: list[Family] = []

    def __getitem__(self, index: Any) -> Any:
        return self._families[index]

    def __len__(self) -> int:
        return len(self._families)

    def __repr__(self) -> str:
        return f"FamilyList({', '.join(f.FAMILY for f in self._families)})"


FAMILIES = FamilyList()


def register(family: Family) -> None:
    """Add `family` (a module, or any object with the module's members) to FAMILIES, after the
    others. Raises TypeError when it breaks the family contract, ValueError when its FAMILY name is
    taken."""
    check_family(family)
    if any(f.FAMILY == family.FAMILY for f in FAMILIES):
        raise ValueError(f"a family named {family.FAMILY!r} is registered already")
    FAMILIES._families.append(family)
    _changed()


def unregister(family: Family) -> None:
    """Remove `family` from FAMILIES (ValueError if it is not there)."""
    FAMILIES._families.remove(family)
    _changed()


_version = 0


def version() -> int:
    """A number that changes whenever FAMILIES does (what is cached on the family list checks it)."""
    return _version


def _changed() -> None:
    global _version
    _version += 1
    supported_head_dims.cache_clear()
    _BY_NAME.clear()


@contextlib.contextmanager
def registered(family: Family) -> Iterator[Family]:
    """Register `family` for the duration of a `with` block (a test's family, say)."""
    register(family)
    try:
        yield family
    finally:
        unregister(family)


def built_by_default(family: Family) -> bool:
    """Whether `gemmgen generate` without --family builds `family`."""
    return family.BUILT_BY_DEFAULT


def families_for(arch: Arch) -> list[Family]:
    """Return the families that build for `arch`."""
    return [family for family in FAMILIES if arch in family.ARCHS]


_BY_NAME: dict[str, Family] = {}


def family_named(name: str) -> Family:
    """Return the family whose FAMILY is `name`; raise KeyError if none (a dict lookup: selection
    asks for every candidate of every new problem)."""
    if not _BY_NAME:
        _BY_NAME.update((family.FAMILY, family) for family in FAMILIES)
    return _BY_NAME[name]


def matches(name: str, pattern: str) -> bool:
    """True when `pattern` is a substring of `name` or a regex found in it (an invalid regex is a substring)."""
    if pattern in name:
        return True
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def select_instances(arch: Arch, *, all_instances: bool = False,
                     pattern: str | None = None, families: set[str] | None = None) -> list[Any]:
    """Return the instances to build for `arch`: each family's DEFAULT (or SPACE), filtered by `pattern`.

    `families` names the families to take (default: those built_by_default; the others, such as
    mea_sm80 and the GEMM and softmax families, build only when named)."""
    chosen = []
    for family in families_for(arch):
        if families is None and not built_by_default(family):
            continue
        if families is not None and family.FAMILY not in families:
            continue
        pool = family.SPACE if all_instances else family.DEFAULT
        chosen.extend(inst for inst in pool if pattern is None or matches(inst.name, pattern))
    return chosen


@functools.cache  # on fused_attention's hot path; register() clears it
def supported_head_dims() -> tuple[int, ...]:
    """The head dims some attention family serves (the union of their HEAD_DIMS), sorted."""
    return tuple(sorted({d for family in FAMILIES if family.KIND == "attention" for d in family.HEAD_DIMS}))


def fp8_head_dims() -> tuple[int, ...]:
    """The head dims some attention family serves with fp8 inputs (their FP8_HEAD_DIMS), sorted."""
    return tuple(sorted({d for family in FAMILIES if family.KIND == "attention"
                         for d in getattr(family, "FP8_HEAD_DIMS", ())}))


def describe_head_dims(dims: Sequence[int]) -> str:
    """`dims` in a few words: "a multiple of 8 up to 256" where they are every multiple of their
    smallest up to their largest, else "one of 32, 64, 128"."""
    if len(dims) > 2 and list(dims) == list(range(dims[0], dims[-1] + 1, dims[0])):
        return f"a multiple of {dims[0]} up to {dims[-1]}"
    return f"one of {', '.join(map(str, dims))}"


for _family in BUILTIN:
    register(_family)
