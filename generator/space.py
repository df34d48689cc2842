"""The registry of kernel families and the instance selection `gemmgen generate` builds.

A family is a module (see gemmgen/families/) exposing FAMILY, KIND ("attention", "gemm" or
"softmax"), optionally BUILT_BY_DEFAULT (False: `gemmgen generate` builds it only when named),
TEMPLATE, ARCHS, SPACE, DEFAULT, invalid_reason(instance, arch) (what is never built) and, for
attention families, problem_reason(params, problem) (what a built instance cannot run: the
registry rejects it for that call with this reason). Adding a family means adding its module to
FAMILIES.
"""
from __future__ import annotations

import functools
import re
from types import ModuleType
from typing import Any

from gemmgen.arch import Arch
from gemmgen.generator.families import fa2_sm80, fmha_sm90, gemm_sm80, gemm_sm90, mea_sm80, softmax_sm80

# Attention families first, in the order build_target tries them for a missing instance.
FAMILIES: tuple[ModuleType, ...] = (fa2_sm80, fmha_sm90, mea_sm80, gemm_sm80, gemm_sm90, softmax_sm80)


def built_by_default(family: ModuleType) -> bool:
    """Whether `gemmgen generate` without --family builds `family` (its BUILT_BY_DEFAULT, else True)."""
    return getattr(family, "BUILT_BY_DEFAULT", True)


def families_for(arch: Arch) -> list[ModuleType]:
    """Return the families that build for `arch`."""
    return [family for family in FAMILIES if arch in family.ARCHS]


def family_named(name: str) -> ModuleType:
    """Return the family module whose FAMILY is `name`; raise KeyError if none."""
    for family in FAMILIES:
        if family.FAMILY == name:
            return family
    raise KeyError(name)


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


@functools.cache  # on fused_attention's hot path
def supported_head_dims() -> tuple[int, ...]:
    """Head dims some family supports, sorted."""
    return tuple(sorted({inst.head_dim for family in FAMILIES
                         if getattr(family, "KIND", "attention") == "attention" for inst in family.SPACE}))
