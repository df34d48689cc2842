"""gemmgen: a CUTLASS-based fused-attention kernel generator.

    import gemmgen
    o = gemmgen.fused_attention(q, k, v, causal=True)
    o = gemmgen.fused_attention(q, k, v, dropout_p=0.1, attn_mask=mask)   # dropout, additive mask
    o = gemmgen.fused_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences

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
    "fused_attention_varlen": "gemmgen.ops",
    "selected_instance": "gemmgen.ops",
    "explain": "gemmgen.ops",
    "autotune": "gemmgen.tuner",
    "attention_reference": "gemmgen.reference",
    "set_build_dirs": "gemmgen.registry",
    "refresh": "gemmgen.registry",
    "cache_dir": "gemmgen.cache",
    "Shape": "gemmgen.shapes",
    "parse_shape": "gemmgen.shapes",
    "batched_gemm": "gemmgen.gemm",
    "batched_gemm_ptrs": "gemmgen.gemm",
    "unfused_attention": "gemmgen.unfused",
}
_SUBMODULES = {"abi", "arch", "buckets", "build", "cache", "cli", "cli_explain", "cli_profile", "cli_tune",
               "device", "families", "heuristic", "jit", "launch", "manifest", "ops", "plot", "problem",
               "reference", "registry", "render", "selection", "shapes", "space", "timing", "toolchain",
               "torch_op", "tuner", "tuning_db"}
_SUBMODULES |= {"gemm", "gemm_select", "unfused", "cli_gemm"}

__all__ = ["fused_attention", "fused_attention_varlen", "selected_instance", "explain", "autotune", "attention_reference",
           "set_build_dirs", "refresh", "cache_dir", "Shape", "parse_shape",
           "batched_gemm", "batched_gemm_ptrs", "unfused_attention",
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
