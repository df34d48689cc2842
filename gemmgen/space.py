"""The registry of kernel families and the instance selection `gemmgen generate` builds.

A family is a module (see gemmgen/families/) exposing FAMILY, KIND ("attention" or "gemm"),
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
from gemmgen.families import fa2_sm80

FAMILIES: tuple[ModuleType, ...] = (fa2_sm80,)


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
                     pattern: str | None = None) -> list[Any]:
    """Return the instances to build for `arch`: each family's DEFAULT (or SPACE), filtered by `pattern`."""
    chosen = []
    for family in families_for(arch):
        pool = family.SPACE if all_instances else family.DEFAULT
        chosen.extend(inst for inst in pool if pattern is None or matches(inst.name, pattern))
    return chosen


@functools.cache  # on fused_attention's hot path
def supported_head_dims() -> tuple[int, ...]:
    """Head dims some family supports, sorted."""
    return tuple(sorted({inst.head_dim for family in FAMILIES for inst in family.SPACE}))
