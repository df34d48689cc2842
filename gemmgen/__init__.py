"""gemmgen: a CUTLASS-based fused-attention kernel generator.

    import gemmgen
    o = gemmgen.fused_attention(q, k, v, causal=True)

The torch-facing pieces load lazily, so `gemmgen generate` does not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from gemmgen.errors import (CacheError, DeviceError, GemmgenError, GemmgenLaunchError, GemmgenWarning,
                            InputError, ManifestError, NoInstanceError, ToolchainError, TuningDatabaseError)

__version__ = "0.1.0"

_LAZY_ATTRS = {
    "fused_attention": "gemmgen.ops",
    "selected_instance": "gemmgen.ops",
    "explain": "gemmgen.ops",
    "autotune": "gemmgen.tuner",
    "attention_reference": "gemmgen.reference",
    "set_build_dirs": "gemmgen.registry",
    "refresh": "gemmgen.registry",
    "cache_dir": "gemmgen.cache",
    "Shape": "gemmgen.shapes",
    "parse_shape": "gemmgen.shapes",
}
_SUBMODULES = {"abi", "arch", "buckets", "build", "cache", "cli", "cli_explain", "cli_profile", "cli_tune",
               "device", "families", "heuristic", "jit", "launch", "manifest", "ops", "plot", "problem",
               "reference", "registry", "render", "selection", "shapes", "space", "timing", "toolchain",
               "torch_op", "tuner", "tuning_db"}

__all__ = ["fused_attention", "selected_instance", "explain", "autotune", "attention_reference",
           "set_build_dirs", "refresh", "cache_dir", "Shape", "parse_shape",
           "GemmgenError", "ToolchainError", "ManifestError", "InputError", "DeviceError",
           "NoInstanceError", "GemmgenLaunchError", "CacheError", "TuningDatabaseError",
           "GemmgenWarning", "__version__"]


def __getattr__(name: str) -> Any:
    """Import the torch-facing API on first use."""
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gemmgen.{name}")
    raise AttributeError(f"module 'gemmgen' has no attribute {name!r}")
