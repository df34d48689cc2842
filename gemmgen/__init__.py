"""gemmgen: a CUTLASS-based fused-attention kernel generator.

    import gemmgen
    o = gemmgen.fused_attention(q, k, v, causal=True)

The torch-facing pieces load lazily, so `gemmgen generate` does not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from gemmgen.errors import (DeviceError, GemmgenError, GemmgenLaunchError, InputError, ManifestError,
                            NoInstanceError, ToolchainError)

__version__ = "0.1.0"

_LAZY_ATTRS = {
    "fused_attention": "gemmgen.ops",
    "selected_instance": "gemmgen.ops",
    "attention_reference": "gemmgen.reference",
    "set_build_dirs": "gemmgen.registry",
}
_SUBMODULES = {"abi", "arch", "build", "cli", "families", "manifest", "ops", "reference", "registry",
               "render", "space", "toolchain"}

__all__ = ["fused_attention", "selected_instance", "attention_reference", "set_build_dirs",
           "GemmgenError", "ToolchainError", "ManifestError", "InputError", "DeviceError",
           "NoInstanceError", "GemmgenLaunchError", "__version__"]


def __getattr__(name: str) -> Any:
    """Import the torch-facing API on first use."""
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gemmgen.{name}")
    raise AttributeError(f"module 'gemmgen' has no attribute {name!r}")
